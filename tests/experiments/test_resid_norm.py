import pytest
import torch

from blockscope.errors import BlockscopeError
from blockscope.experiments.resid_norm import resid_norms
from blockscope.inputs.text import tokenize
from blockscope.model.loading import load_model, spec_for

from ..references import hf_stream

PROMPT = "The capital of France is"


@pytest.mark.parametrize("prepend_bos", [False, True])
def test_norms_equal_hf_hidden_states(tiny, hf, prepend_bos):
    ids = tokenize(tiny.tokenizer, PROMPT, prepend_bos=prepend_bos)
    df = resid_norms(tiny, ids, positions=range(ids.shape[1]))
    hidden, records = hf_stream(hf, ids)
    n_layers = len(records)
    for p in range(ids.shape[1]):
        rows = df[df["position"] == p].reset_index(drop=True)
        expected = [hidden[0][0, p].norm()]  # embeddings: token + position
        for i, rec in enumerate(records):
            expected.append((rec["in"] + rec["attn"])[0, p].norm())  # resid_mid
            # HF's last hidden state is after ln_f, so the last block's output comes from a hook
            out = hidden[i + 1] if i < n_layers - 1 else rec["out"]
            expected.append(out[0, p].norm())
        assert torch.allclose(torch.tensor(rows["norm"].tolist()), torch.stack(expected).float(),
                              rtol=1e-5)
        assert rows["ratio_to_embed"].iloc[0] == 1.0
    labels = list(df[df["position"] == 0]["after"])
    assert labels == ["embeddings", "block 0 attn", "block 0", "block 1 attn", "block 1",
                      "block 2 attn", "block 2"]


def test_default_is_last_token_and_bad_position(tiny):
    ids = tokenize(tiny.tokenizer, PROMPT, prepend_bos=False)
    df = resid_norms(tiny, ids)
    assert set(df["position"]) == {4} and set(df["token"]) == {" is"}  # its own text
    assert len(df) == 1 + 2 * tiny.cfg.n_layers
    with pytest.raises(BlockscopeError, match="position"):
        resid_norms(tiny, ids, positions=[5])


def test_bos_and_processed_weights_change_the_norms(tiny, tiny_dir):
    no_bos = resid_norms(tiny, tokenize(tiny.tokenizer, PROMPT, prepend_bos=False))
    bos = resid_norms(tiny, tokenize(tiny.tokenizer, PROMPT, prepend_bos=True))
    processed = load_model(spec_for(str(tiny_dir), device="cpu", processed=True))
    proc = resid_norms(processed, tokenize(tiny.tokenizer, PROMPT, prepend_bos=False))
    assert not torch.allclose(torch.tensor(no_bos["norm"]), torch.tensor(bos["norm"]), rtol=1e-3)
    assert not torch.allclose(torch.tensor(no_bos["norm"]), torch.tensor(proc["norm"]), rtol=1e-3)
