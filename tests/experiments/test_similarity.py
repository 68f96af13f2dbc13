"""Block Influence and angular distance against a direct computation on the HF model."""

import math

import pandas as pd
import pytest
import torch

from blockscope.experiments.ablate import block_ablation, metric_correlations
from blockscope.experiments.similarity import spearman
from blockscope.inputs.text import tokenize
from blockscope.sweeps.naive import model_windows
from blockscope.sweeps.settings import RunSettings


def hf_block_io(hf, ids):
    """Each block's input and output hidden states, from HF hooks."""
    ins, outs, handles = [], [], []
    for block in hf.transformer.h:
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k: ins.append(a[0]), with_kwargs=True))
        handles.append(block.register_forward_hook(
            lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            hf(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return ins, outs


@pytest.mark.parametrize("engine", ["cached", "naive"])
def test_metrics_equal_direct_computation(tiny, hf, alice_text, engine):
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=100)
    df = block_ablation(tiny, ids, settings=RunSettings(engine=engine))
    ins, outs = hf_block_io(hf, ids)
    for k in range(3):
        cos = torch.nn.functional.cosine_similarity(ins[k][0, 1:].double(),
                                                    outs[k][0, 1:].double(), dim=-1)
        row = df[df["layer"] == k].iloc[0]
        assert row["block_influence"] == pytest.approx(1 - cos.mean().item(), rel=1e-5)
        assert row["angular_distance"] == pytest.approx(
            (torch.arccos(cos.clamp(-1, 1)) / math.pi).mean().item(), rel=1e-5)
    assert df.loc[0, ["block_influence", "angular_distance"]].isna().all()  # baseline row


def test_metrics_over_windows_agree_between_engines(tiny, alice_text):
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=300)
    naive = block_ablation(tiny, ids, settings=RunSettings(stride=100, engine="naive"))
    cached = block_ablation(tiny, ids, settings=RunSettings(stride=100))
    for m in ("block_influence", "angular_distance"):
        assert torch.allclose(torch.tensor(naive[m][1:].tolist()),
                              torch.tensor(cached[m][1:].tolist()), rtol=1e-6)
    corr = metric_correlations(cached)
    assert set(corr) == {"block_influence", "angular_distance"}
    assert all(-1 <= v <= 1 for v in corr.values())


@pytest.mark.parametrize("stride", [None, 100])
def test_naive_metrics_come_from_its_own_baseline_pass(tiny, alice_text, monkeypatch, stride):
    """The naive loop runs one forward per window for the baseline and one per variant and
    window, nothing more: the block metrics are read off the baseline's forward."""
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=300)
    hf_model = tiny.original_model
    calls, real = [], hf_model.forward
    monkeypatch.setattr(hf_model, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    df = block_ablation(tiny, ids, settings=RunSettings(stride=stride, engine="naive"))
    n_windows = len(model_windows(tiny, ids, stride))
    assert len(calls) == (1 + 3) * n_windows
    assert df["block_influence"][1:].notna().all()


def test_spearman():
    assert spearman(pd.Series([1, 2, 3, 4]), pd.Series([10, 20, 30, 40])) == pytest.approx(1)
    assert spearman(pd.Series([1, 2, 3, 4]), pd.Series([4, 3, 2, 1])) == pytest.approx(-1)
    # ties get average ranks: ranks (1.5, 1.5, 3) vs (1, 2, 3)
    assert spearman(pd.Series([5, 5, 9]), pd.Series([1, 2, 3])) == pytest.approx(
        0.8660254, rel=1e-6)


@pytest.mark.parametrize("part,engine", [("attn", "cached"), ("mlp", "naive")])
def test_a_halfs_metrics_are_its_own(tiny, hf, alice_text, part, engine):
    """--part attn|mlp: what the half reads against that plus its write, from HF hooks on
    the attention module's output (GPT-2: resid_mid = input + attn output)."""
    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=60)
    df = block_ablation(tiny, ids, part=part, settings=RunSettings(engine=engine))
    ins, outs = hf_block_io(hf, ids)
    attn_out, handles = [], [b.attn.register_forward_hook(
        lambda m, a, o: attn_out.append(o[0])) for b in hf.transformer.h]
    with torch.no_grad():
        hf(ids, use_cache=False)
    for h in handles:
        h.remove()
    for k in range(3):
        mid = ins[k] + attn_out[k]
        x, y = (ins[k], mid) if part == "attn" else (mid, outs[k])
        cos = torch.nn.functional.cosine_similarity(x[0, 1:].double(), y[0, 1:].double(), -1)
        row = df[df["layer"] == k].iloc[0]
        assert row["block_influence"] == pytest.approx(1 - cos.mean().item(), rel=1e-5)
