"""The logit lens and direct logit attribution, held to plain-transformers references."""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.errors import BlockscopeError
from blockscope.experiments.logit_lens import attribution, lens, target_id
from blockscope.inputs.text import tokenize

from ..conftest import result
from ..references import hf_stream

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize(tiny.tokenizer, PROMPT, prepend_bos=True)


def test_lens_equals_hf_final_norm_and_lm_head_at_every_point(tiny, hf, ids):
    """At every point the lens is HF's ln_f then lm_head on HF's own residual there (the
    embeddings, after each attention half, after each block); at the last point it is the
    model's logits."""
    positions = [2, ids.shape[1] - 1]
    df = lens(tiny, ids, positions=positions, k=3)
    hidden, records = hf_stream(hf, ids)
    with torch.no_grad():
        stream = [("embeddings", hidden[0])]
        for i, rec in enumerate(records):
            stream += [(f"block {i} attn", rec["in"] + rec["attn"]),
                       (f"block {i}", rec["out"])]
        logits = hf(ids).logits[0]
    assert list(dict.fromkeys(df["point"])) == [name for name, _ in stream]
    for name, x in stream:
        with torch.no_grad():
            ref = hf.lm_head(hf.transformer.ln_f(x))[0].log_softmax(-1)
        for pos in positions:
            row = df[(df["point"] == name) & (df["position"] == pos)].iloc[0]
            top = ref[pos].topk(3)
            assert row["top1"] == tiny.tokenizer.decode([int(top.indices[0])])
            assert row["p1"] == pytest.approx(float(top.values[0].exp()), rel=1e-4)
            t = int(logits[pos].argmax())
            assert row["target_id"] == t  # the model's own top-1 by default
            assert row["target_rank"] == int((ref[pos] > ref[pos, t]).sum()) + 1
    last = df[df["point"] == stream[-1][0]]
    assert (last["target_rank"] == 1).all() and last["kl_from_final"].abs().max() < 1e-12


def frozen_reference(hf, ids, pos, target, contrast=None):
    """Each write's direct logit by hand from HF modules: centred, over ln_f's scale at the
    final residual, times ln_f's weight, dotted with lm_head's row(s); and the bias term."""
    hidden, records = hf_stream(hf, ids)
    ln, W = hf.transformer.ln_f, hf.lm_head.weight.double()
    row = (W[target] - (0 if contrast is None else W[contrast])).detach()
    x = records[-1]["out"][0, pos].double()
    scale = ((x - x.mean()).pow(2).mean() + ln.eps).sqrt()

    def dla(v):
        v = v[0, pos].double()
        return float(((v - v.mean()) / scale * ln.weight.double()).detach() @ row.detach())

    ref = {"embeddings": dla(hidden[0])}
    for i, rec in enumerate(records):
        ref[f"block {i} attn"] = dla(rec["attn"])
        ref[f"block {i} mlp"] = dla(rec["out"] - rec["in"] - rec["attn"])
    ref["biases (final norm, unembedding)"] = float(ln.bias.detach().double() @ row.detach())
    return ref


@pytest.mark.parametrize("contrast", [None, " London"])
def test_attribution_equals_a_hand_reference_and_sums_to_the_logit(tiny, hf, ids, contrast):
    pos = ids.shape[1] - 1
    t = target_id(tiny.tokenizer, " Paris")
    c = None if contrast is None else target_id(tiny.tokenizer, contrast)
    df = attribution(tiny, ids, position=pos, target=t, contrast=c)
    with torch.no_grad():
        logits = hf(ids).logits[0, pos].double()
    want = float(logits[t] - (0 if c is None else logits[c]))
    for level in ("block", "head"):
        assert df[df["level"] == level]["contribution"].sum() == pytest.approx(want, abs=1e-5)
    blocks = df[df["level"] == "block"].set_index("component")["contribution"]
    ref = frozen_reference(hf, ids, pos, t, c)
    assert set(blocks.index) == set(ref)
    for name, value in ref.items():
        assert blocks[name] == pytest.approx(value, abs=1e-5), name


def test_a_heads_attribution_is_what_zeroing_its_w_o_rows_takes_away(tiny, hf, ids):
    """Head h of layer 1: its direct logit equals the direct logit of the change in layer
    1's attention write when HF's c_proj rows of that head are zeroed (the write at layer 1
    depends only on the layers before it)."""
    pos, t = ids.shape[1] - 1, target_id(tiny.tokenizer, " Paris")
    df = attribution(tiny, ids, position=pos, target=t)
    heads = df[(df["level"] == "head") & (df["layer"] == 1) & df["head"].notna()]
    d_head = hf.config.n_embd // hf.config.n_head
    _, records = hf_stream(hf, ids)
    ln, W = hf.transformer.ln_f, hf.lm_head.weight.double()[t]
    x = records[-1]["out"][0, pos].double()
    scale = ((x - x.mean()).pow(2).mean() + ln.eps).sqrt()
    for h in range(hf.config.n_head):
        cut = copy.deepcopy(hf)
        with torch.no_grad():
            cut.transformer.h[1].attn.c_proj.weight[h * d_head:(h + 1) * d_head] = 0
        _, cut_records = hf_stream(cut, ids)
        v = (records[1]["attn"] - cut_records[1]["attn"])[0, pos].double()
        ref = float(((v - v.mean()) / scale * ln.weight.detach().double()) @ W.detach())
        got = heads[heads["head"] == h]["contribution"].iloc[0]
        assert got == pytest.approx(ref, abs=1e-5)


def test_lens_and_attribution_on_an_rms_norm_family(tmp_path):
    """A tiny Llama (RMSNorm, no centring, rotary): the lens at every block output equals
    HF's norm and lm_head on output_hidden_states, and the attribution adds up."""
    from transformers import AutoModelForCausalLM

    from blockscope.model.loading import load_model, spec_for

    from ..builders import save_checkpoint

    path = save_checkpoint("llama", tmp_path / "llama")
    model = load_model(spec_for(str(path)))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = tokenize(model.tokenizer, PROMPT, prepend_bos=True)
    pos = ids.shape[1] - 1
    df = lens(model, ids, positions=[pos], k=1)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    outputs = df[~df["point"].str.endswith("attn")]
    for k, (_, row) in enumerate(outputs.iloc[:-1].iterrows()):  # the last: after the norm
        with torch.no_grad():
            ref = hf.lm_head(hf.model.norm(out.hidden_states[k]))[0, pos].log_softmax(-1)
        assert row["p1"] == pytest.approx(float(ref.max().exp()), rel=1e-4)
    t = int(out.logits[0, pos].argmax())
    attrs = attribution(model, ids, position=pos, target=t)
    for level in ("block", "head"):
        total = attrs[attrs["level"] == level]["contribution"].sum()
        assert total == pytest.approx(float(out.logits[0, pos, t]), abs=1e-4)


def test_a_target_must_be_one_token(tiny):
    with pytest.raises(BlockscopeError, match="is 2 tokens"):
        target_id(tiny.tokenizer, " Paris France")


def test_command_writes_lens_attribution_and_picture(tiny_dir, tmp_path):
    res = CliRunner().invoke(app, ["logit-lens", PROMPT, "--model", str(tiny_dir), "--target",
                                   " Paris", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "never trained to be read" in " ".join(res.stdout.split())
    assert result(tmp_path, "logit-lens-tiny-gpt2.csv").exists()
    attrs = result(tmp_path, "logit-lens-tiny-gpt2-attribution.csv").read_text()
    assert "head 2.3" in attrs and "block 2 mlp" in attrs
    meta = json.loads(result(tmp_path, "logit-lens-tiny-gpt2.json").read_text())
    assert meta["target"] == " Paris" and "frozen" in meta["attribution"]["final_norm"]
    assert result(tmp_path, "logit-lens-tiny-gpt2.png").read_bytes()[:4] == b"\x89PNG"
    grid = CliRunner().invoke(app, ["logit-lens", PROMPT, "--model", str(tiny_dir),
                                    "--all-positions", "--no-attribution", "--out-dir",
                                    str(tmp_path / "g")])
    assert grid.exit_code == 0, grid.output
    assert result(tmp_path / "g", "logit-lens-tiny-gpt2-all.png").exists()
    bad = CliRunner().invoke(app, ["logit-lens", PROMPT, "--model", str(tiny_dir),
                                   "--position", "9", "--out-dir", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "--position 9 is outside the 6 tokens" in bad.stderr
    assert not (tmp_path / "b").exists()
