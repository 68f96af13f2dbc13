"""Head ablation and importance against the plain HF model and finite differences
(the pruning curve: test_pruning.py)."""

import copy
import math

import pytest
import torch

from blockscope.errors import BadValue
from blockscope.experiments.heads import head_importance, one_head_per_layer, single_head_ablation
from blockscope.inputs.text import tokenize
from blockscope.interventions import applied, mask_heads
from blockscope.sweeps.naive import model_windows, token_nll
from blockscope.sweeps.settings import RunSettings

from ..references import hf_ppl

REL = 1e-5
SENTENCE = "Alice was beginning to get very tired of sitting by her sister on the bank."


@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize(tiny.tokenizer, SENTENCE, prepend_bos=True)



def without_heads(hf, layer, heads, d_head=16):
    """HF copy with the rows of W_O (c_proj weight, (d_model in, d_model out)) of `heads` zeroed."""
    cut = copy.deepcopy(hf)
    with torch.no_grad():
        for h in heads:
            cut.transformer.h[layer].attn.c_proj.weight[h * d_head:(h + 1) * d_head] = 0
    return cut


def test_zeroing_a_head_equals_zeroing_its_rows_of_w_o(tiny, hf, ids):
    df = single_head_ablation(tiny, ids)
    assert len(df) == 1 + 3 * 4
    assert df.loc[0, "perplexity"] == pytest.approx(hf_ppl(hf, ids), rel=REL)
    for row in df.iloc[1:].itertuples():
        expected = hf_ppl(without_heads(hf, row.layer, [row.head]), ids)
        assert row.perplexity == pytest.approx(expected, rel=REL)
    assert df["perplexity"][1:].std() > 0


def test_mean_ablating_a_head_writes_its_clean_mean_z(tiny, hf, ids):
    df = single_head_ablation(tiny, ids, method="mean", layers=[1], heads=[2])
    proj = hf.transformer.h[1].attn.c_proj
    seen = []
    handle = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    hf_ppl(hf, ids)
    handle.remove()
    mean = seen[0][:, :, 32:48].mean(dim=1, keepdim=True)  # head 2's z, merged layout

    def replace(m, a):
        z = a[0].clone()
        z[:, :, 32:48] = mean
        return (z,)

    handle = proj.register_forward_pre_hook(replace)
    try:
        expected = hf_ppl(hf, ids)
    finally:
        handle.remove()
    assert df.loc[1, "perplexity"] == pytest.approx(expected, rel=REL)


def test_removing_every_head_of_a_layer_leaves_only_the_bias_b_o(tiny, hf, ids):
    """All of a layer's z zeroed = its attention output replaced by c_proj's bias b_O
    (not by zero: the bias is added after the heads are summed)."""
    wins = model_windows(tiny, ids, None)
    for layer in range(3):
        keep = torch.ones(3, 4)
        keep[layer] = 0
        with applied(tiny, mask_heads(keep)):
            ppl = math.exp(token_nll(tiny, ids, wins).mean())
        attn = hf.transformer.h[layer].attn
        handle = attn.register_forward_hook(
            lambda m, a, o: (attn.c_proj.bias.expand_as(o[0]), *o[1:]))
        try:
            expected = hf_ppl(hf, ids)
        finally:
            handle.remove()
        assert ppl == pytest.approx(expected, rel=REL)


def test_a_mask_of_ones_is_the_baseline(tiny, ids):
    wins = model_windows(tiny, ids, None)
    base = token_nll(tiny, ids, wins)
    ones = torch.ones(3, 4).requires_grad_(True)  # forces a hook on every layer
    with applied(tiny, mask_heads(ones)):
        assert torch.allclose(token_nll(tiny, ids, wins), base, rtol=1e-6)


def test_gradient_importance_matches_a_finite_difference(tiny, ids):
    importance, normalised = head_importance(tiny, ids)
    assert importance.shape == (3, 4) and (importance > 0).all()
    wins = model_windows(tiny, ids, None)
    eps = 1e-2
    for layer, head in [(0, 0), (1, 3), (2, 1)]:
        losses = []
        for sign in (1, -1):
            keep = torch.ones(3, 4, dtype=torch.float64)
            keep[layer, head] += sign * eps
            with applied(tiny, mask_heads(keep)):
                losses.append(float(token_nll(tiny, ids, wins).mean()))
        fd = abs(losses[0] - losses[1]) / (2 * eps)
        assert importance[layer, head].item() == pytest.approx(fd, rel=2e-2, abs=1e-4)
    assert torch.allclose(normalised.norm(dim=-1), torch.ones(3))
    assert all(p.requires_grad for p in tiny.parameters())  # weights unfrozen afterwards


def test_gradient_importance_sums_over_windows(tiny, alice_text):
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=300)
    importance, _ = head_importance(tiny, ids, settings=RunSettings(stride=64))
    assert torch.isfinite(importance).all() and (importance > 0).all()


def test_one_head_per_layer_equals_hf_without_the_others(tiny, hf, ids):
    importance, _ = head_importance(tiny, ids)
    df = one_head_per_layer(tiny, ids, importance)
    for row in df.iloc[1:].itertuples():
        assert row.kept_head == int(importance[row.layer].argmax())
        others = [h for h in range(4) if h != row.kept_head]
        expected = hf_ppl(without_heads(hf, row.layer, others), ids)
        assert row.perplexity == pytest.approx(expected, rel=REL)


def test_out_of_range_filters_and_bad_options(tiny, ids):
    with pytest.raises(BadValue, match="^layers must be between 0 and") as bad:
        single_head_ablation(tiny, ids, layers=[3])
    assert bad.value.as_flag().startswith("--layers must be")
    with pytest.raises(BadValue, match="^heads must be between"):
        single_head_ablation(tiny, ids, heads=[-1])
