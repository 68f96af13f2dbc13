"""rearrange against plain-transformers references: the HF model with its ModuleList of
decoder layers rebuilt in the new order (a block repeated is the same module twice; a
parallel run is a module summing its blocks' writes), use_cache=False."""

import copy

import pytest
import torch

from blockscope.errors import BadValue
from blockscope.experiments.rearrange import adjacent_swaps, arrangement, rearranged
from blockscope.sweeps.settings import RunSettings

from ..references import PATHS, hf_kl, hf_ppl

ARRANGEMENTS = [("swap", "0,2"), ("reverse", "1:3"), ("repeat", "2x3"), ("parallel", "1:2")]


class Parallel(torch.nn.Module):
    """Blocks run side by side on one input, their writes summed: x + sum (block(x) - x)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x, *args, **kwargs):
        outs = [b(x, *args, **kwargs) for b in self.blocks]
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        return x + sum(o - x for o in outs)


def rebuilt(hf, family, steps, first, last):
    """The HF model with blocks first..last replaced by `steps` (tuples of block indices)."""
    cut = copy.deepcopy(hf)
    parent, name = cut, PATHS[family].split(".")
    for part in name[:-1]:
        parent = getattr(parent, part)
    old = list(getattr(parent, name[-1]))
    new = old[:first] + [old[s[0]] if len(s) == 1 else Parallel([old[j] for j in s])
                         for s in steps] + old[last + 1:]
    setattr(parent, name[-1], torch.nn.ModuleList(new))
    for key in ("num_hidden_layers", "n_layer"):  # HF loops over config-many layers
        if hasattr(cut.config, key):
            setattr(cut.config, key, len(new))
    return cut


@pytest.fixture(scope="module")
def sweeps(four_blocks):  # noqa: F811
    family, model, _, ids = four_blocks
    arrs = [arrangement(k, t, 4) for k, t in ARRANGEMENTS] + adjacent_swaps(4)
    return arrs, rearranged(model, ids, arrs), rearranged(model, ids, arrs,
                                                          settings=RunSettings(engine="naive"))


def test_every_arrangement_equals_hf_with_its_layers_rebuilt(four_blocks, sweeps):  # noqa: F811
    family, model, hf, ids = four_blocks
    arrs, cached, _ = sweeps
    assert cached.loc[0, "perplexity"] == pytest.approx(hf_ppl(hf, ids), rel=1e-5)
    for a, r in zip(arrs, cached.iloc[1:].itertuples(), strict=True):
        cut = rebuilt(hf, family, a.steps, a.first, a.last)
        assert r.perplexity == pytest.approx(hf_ppl(cut, ids), rel=1e-5), a.name
        kl = hf_kl(hf, cut, ids)
        assert kl > 1e-3  # a real change, not a KL lost in rounding
        assert r.kl == pytest.approx(kl, rel=1e-4, abs=1e-5 * r.nll), a.name


def test_engine_equals_naive(sweeps):
    _, cached, naive = sweeps
    assert cached["nll"].tolist() == pytest.approx(naive["nll"].tolist(), rel=1e-5)
    assert cached["kl"].tolist() == pytest.approx(naive["kl"].tolist(), rel=1e-4,
                                                  abs=1e-5 * naive.loc[0, "nll"])
    assert "fallback" not in cached.attrs["engine"]
    assert naive.attrs["engine"]["replay"] == "naive"


def test_orders_read_as_the_blocks_run():
    assert arrangement("swap", "1,3", 5).order(5) == "0 3 2 1 4"
    assert arrangement("reverse", "1:3", 5).order(5) == "0 3 2 1 4"
    assert arrangement("repeat", "4", 5).order(5) == "0 1 2 3 4 4"
    assert arrangement("parallel", "0:2", 5).order(5) == "(0+1+2) 3 4"


@pytest.mark.parametrize("kind, text, why", [
    ("swap", "3,3", "must come before"), ("swap", "1", "i,j"), ("reverse", "2:9", "0 to 4"),
    ("repeat", "2x1", "2 or more"), ("parallel", "a:b", "i:j"), ("swap", "-1,2", "0 to 4")])
def test_bad_arrangements_are_refused_in_one_line(kind, text, why):
    with pytest.raises(BadValue, match=why):
        arrangement(kind, text, 5)


def test_a_slip_in_the_rearranged_entry_falls_back(tiny, monkeypatch):
    """A wrong residual from the rearrangement's entry is caught by the variant self-check:
    the naive loop's numbers are reported, and the fallback says why."""
    from dataclasses import replace

    from blockscope.inputs.text import tokenize
    from blockscope.sweeps import entries

    ids = tokenize(tiny.tokenizer, "Alice was beginning to get very tired of sitting by her "
                   "sister on the bank.", prepend_bos=True)
    arrs = [arrangement("swap", "0,1", 3)]
    naive = rearranged(tiny, ids, arrs, settings=RunSettings(engine="naive"))
    original = entries.start

    def slipped(*a, **k):
        s = original(*a, **k)
        return replace(s, resid=lambda c, plain, f=s.resid: f(c, plain) * 1.01)

    monkeypatch.setattr(entries, "start", slipped)
    from blockscope.sweeps import scoring

    monkeypatch.setattr(scoring, "start", slipped)
    got = rearranged(tiny, ids, arrs)
    assert "rearranged entry" in got.attrs["engine"]["fallback"]
    assert got["nll"].tolist() == pytest.approx(naive["nll"].tolist(), rel=1e-12)
