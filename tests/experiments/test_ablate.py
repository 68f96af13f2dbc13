"""Block ablation against independent references built on the plain HF model."""

import copy

import pytest
import torch

from blockscope.errors import BlockscopeError
from blockscope.experiments.ablate import block_ablation
from blockscope.inputs.text import tokenize
from blockscope.sweeps.settings import RunSettings

from ..references import hf_ppl, hf_sliding_ppl

REL = 1e-5
SENTENCE = "Alice was beginning to get very tired of sitting by her sister on the bank."



@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize(tiny.tokenizer, SENTENCE, prepend_bos=True)


def replace_output(module, value_fn):
    """Forward hook on an HF module replacing its (first) output by value_fn(output)."""

    def hook(mod, args, output):
        if isinstance(output, tuple):
            return (value_fn(output[0]), *output[1:])
        return value_fn(output)

    return module.register_forward_hook(hook)


def test_baseline_equals_hf_labels_loss(tiny, hf, ids):
    df = block_ablation(tiny, ids)
    assert df.loc[0, "variant"] == "baseline"
    assert df.loc[0, "perplexity"] == pytest.approx(hf_ppl(hf, ids), rel=REL)
    assert df.loc[0, "n_scored"] == ids.shape[1] - 1


@pytest.mark.parametrize("prepend_bos", [True, False])
def test_skipping_a_block_equals_deleting_it(tiny, hf, prepend_bos):
    ids = tokenize(tiny.tokenizer, SENTENCE, prepend_bos=prepend_bos)
    df = block_ablation(tiny, ids)
    assert list(df["layer"][1:]) == [0, 1, 2]
    for i in range(3):
        cut = copy.deepcopy(hf)
        del cut.transformer.h[i]
        assert df.loc[i + 1, "perplexity"] == pytest.approx(hf_ppl(cut, ids), rel=REL)
    assert df["perplexity"][1:].std() > 0  # the blocks really differ on this checkpoint


@pytest.mark.parametrize("part, module", [("attn", "attn"), ("mlp", "mlp")])
def test_zeroing_a_half_equals_hf_with_that_output_zeroed(tiny, hf, ids, part, module):
    df = block_ablation(tiny, ids, part=part)
    for i in range(3):
        handle = replace_output(getattr(hf.transformer.h[i], module), torch.zeros_like)
        try:
            expected = hf_ppl(hf, ids)
        finally:
            handle.remove()
        assert df.loc[i + 1, "perplexity"] == pytest.approx(expected, rel=REL)
        assert df.loc[i + 1, "part"] == part


@pytest.mark.parametrize("part, module", [("attn", "attn"), ("mlp", "mlp")])
def test_mean_ablating_a_half_equals_hf_with_its_clean_mean(tiny, hf, ids, part, module):
    df = block_ablation(tiny, ids, part=part, method="mean")
    for i in range(3):
        seen = []
        handle = replace_output(getattr(hf.transformer.h[i], module), lambda o: seen.append(o) or o)
        hf_ppl(hf, ids)
        handle.remove()
        mean = seen[0].mean(dim=1, keepdim=True)  # (1, 1, d_model)
        handle = replace_output(getattr(hf.transformer.h[i], module), lambda o: mean.expand_as(o))
        try:
            expected = hf_ppl(hf, ids)
        finally:
            handle.remove()
        assert df.loc[i + 1, "perplexity"] == pytest.approx(expected, rel=REL)


def test_mean_skipping_a_block_adds_its_clean_mean_contribution(tiny, hf, ids):
    df = block_ablation(tiny, ids, method="mean")
    for i in range(3):
        block, inputs, outputs = hf.transformer.h[i], [], []
        pre = block.register_forward_pre_hook(lambda m, a, k: inputs.append(a[0]), with_kwargs=True)
        post = replace_output(block, lambda o: outputs.append(o) or o)
        hf_ppl(hf, ids)  # clean run: HF's own hidden_states[-1] is after ln_f, so hook the block
        post.remove()
        delta = (outputs[0] - inputs[0]).mean(dim=1, keepdim=True)  # block i's mean write
        post = replace_output(block, lambda o: inputs[-1] + delta)
        try:
            expected = hf_ppl(hf, ids)
        finally:
            pre.remove()
            post.remove()
        assert df.loc[i + 1, "perplexity"] == pytest.approx(expected, rel=REL)


def test_long_text_uses_sliding_windows_like_hf_guide(tiny, hf, alice_text):
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True)
    n_ctx = tiny.cfg.n_ctx
    assert ids.shape[1] > 3 * n_ctx  # several windows, never silently truncated
    for stride in (64, 100):
        df = block_ablation(tiny, ids, layers=[1], settings=RunSettings(stride=stride))
        assert df.loc[0, "n_scored"] == ids.shape[1] - 1
        assert df.loc[0, "perplexity"] == pytest.approx(hf_sliding_ppl(hf, ids, n_ctx, stride),
                                                        rel=REL)
        cut = copy.deepcopy(hf)
        del cut.transformer.h[1]
        assert df.loc[1, "perplexity"] == pytest.approx(hf_sliding_ppl(cut, ids, n_ctx, stride),
                                                        rel=REL)


def test_hooks_are_removed_after_a_sweep(tiny, ids):
    block_ablation(tiny, ids, method="mean")
    assert not any(hp.has_hooks() for hp in tiny.hook_dict.values())
    first = block_ablation(tiny, ids).loc[0, "perplexity"]
    assert block_ablation(tiny, ids).loc[0, "perplexity"] == first


def test_bad_options(tiny, ids):
    with pytest.raises(BlockscopeError, match="part"):
        block_ablation(tiny, ids, part="head")
    with pytest.raises(BlockscopeError, match="method"):
        block_ablation(tiny, ids, method="resample")
    with pytest.raises(BlockscopeError, match="layers"):
        block_ablation(tiny, ids, layers=[3])
