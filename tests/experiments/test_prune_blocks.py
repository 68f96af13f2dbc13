"""prune-blocks against plain-transformers references: blocks removed by rebuilding the HF
model's decoder layers (an nn.ModuleList of the kept blocks, use_cache=False), greedy order
against a brute-force search, angular windows against `output_hidden_states`."""

import copy
import math

import pytest
import torch

from blockscope.experiments.prune_blocks import ORDERS, block_curve, block_params, headline
from blockscope.inputs.text import tokenize
from blockscope.sweeps.settings import RunSettings

from ..references import PATHS, hf_kl, hf_ppl, layers


def without(hf, family, removed) -> torch.nn.Module:
    """The HF model with the blocks `removed` taken out of its ModuleList of layers."""
    cut = copy.deepcopy(hf)
    parent, name = cut, PATHS[family].split(".")
    for part in name[:-1]:
        parent = getattr(parent, part)
    kept = [b for i, b in enumerate(getattr(parent, name[-1])) if i not in removed]
    setattr(parent, name[-1], torch.nn.ModuleList(kept))
    return cut


def blocks_of(removed: str) -> list[int]:
    return [int(i) for i in removed.split(",")] if removed else []


@pytest.fixture(scope="module")
def curves(four_blocks):
    family, model, _, ids = four_blocks
    # the naive loop for the two orders whose variants take the new entry kinds: greedy's
    # steps share the blocks already removed ("blocks-shared"); angular windows do not
    return {"cached": block_curve(model, ids, orders=ORDERS),
            "naive": block_curve(model, ids, orders=("greedy", "angular"),
                                 settings=RunSettings(engine="naive"))}


def test_every_step_equals_hf_with_those_blocks_deleted(four_blocks, curves):
    family, model, hf, ids = four_blocks
    ppl, kl = {}, {}
    for c in curves["cached"][0]:
        for r in c.itertuples():
            key = tuple(sorted(blocks_of(r.removed)))
            if key not in ppl:
                cut = without(hf, family, key)
                ppl[key], kl[key] = hf_ppl(cut, ids), hf_kl(hf, cut, ids)
            assert r.perplexity == pytest.approx(ppl[key], rel=1e-5), (r.order, key)
            # the KL to the NLL's own precision (1e-5 of it), and relative where it is large
            assert r.kl == pytest.approx(kl[key], rel=1e-4, abs=1e-5 * r.nll), (r.order, key)
    assert len(ppl) > 6  # the orders really differ
    assert min(v for k, v in kl.items() if k) > 1e-3  # the KL is not vanishingly small


def test_engine_equals_naive(curves):
    cached_of = {c.loc[0, "order"]: c for c in curves["cached"][0]}
    for naive in curves["naive"][0]:
        cached = cached_of[naive.loc[0, "order"]]
        assert list(cached["removed"]) == list(naive["removed"])
        assert cached["nll"].tolist() == pytest.approx(naive["nll"].tolist(), rel=1e-5)
        assert cached["kl"].tolist() == pytest.approx(naive["kl"].tolist(), rel=1e-4,
                                                      abs=1e-5 * naive.loc[0, "nll"])
        assert "fallback" not in cached.attrs["engine"]
    assert curves["cached"][0][0].attrs["engine"]["replay"] != "naive"


def test_greedy_equals_a_brute_force_search(four_blocks, curves):
    family, model, hf, ids = four_blocks
    greedy = curves["cached"][0][ORDERS.index("greedy")]
    removed: list[int] = []
    for r in greedy.iloc[1:].itertuples():
        left = [i for i in range(4) if i not in removed]
        tried = [hf_ppl(without(hf, family, removed + [i]), ids) for i in left]
        best = min(range(len(left)), key=lambda k: (tried[k], k))
        removed.append(left[best])
        assert blocks_of(r.removed) == removed
        assert r.perplexity == pytest.approx(tried[best], rel=1e-5)
        # the choice is not a float32 coin toss: runner-up well apart (or the last block)
        assert len(left) == 1 or sorted(tried)[1] / tried[best] > 1 + 1e-4


FINAL_NORM = {"gpt2": "transformer.ln_f", "llama": "model.norm",
              "gpt_neox": "gpt_neox.final_layer_norm"}


def test_angular_windows_equal_output_hidden_states(four_blocks, curves):
    family, model, hf, ids = four_blocks
    final = hf.get_submodule(FINAL_NORM[family])
    seen = []
    handle = final.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.inference_mode():
            hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()
    # hidden_states[:4]: the blocks' inputs; the last block's output (HF's last hidden
    # state is after the final norm) is what the final norm receives
    x = [h[0, 1:].double() for h in (*hidden[:4], seen[0])]  # all but token 0
    _, metrics = curves["cached"]
    for m in metrics["angular"]:
        n = m["n"]
        d = [float((torch.arccos(torch.nn.functional.cosine_similarity(
            x[i], x[i + n], dim=-1).clamp(-1, 1)) / math.pi).mean()) for i in range(5 - n)]
        best = min(range(len(d)), key=lambda i: (d[i], i))
        assert (m["first"], m["distance"]) == (best, pytest.approx(d[best], rel=1e-6))
    angular = curves["cached"][0][ORDERS.index("angular")]
    for r in angular.iloc[1:].itertuples():
        first = metrics["angular"][r.n_removed - 1]["first"]
        assert blocks_of(r.removed) == list(range(first, first + r.n_removed))


def test_share_of_parameters_counts_the_hf_blocks(four_blocks):
    family, model, hf, _ = four_blocks
    per, total = block_params(model)
    assert total == sum(p.numel() for p in hf.parameters())
    assert per == [sum(p.numel() for p in b.parameters()) for b in layers(hf)]


def test_headline_is_the_last_step_before_leaving_the_band(curves):
    import pandas as pd

    c = curves["cached"][0][0].copy()
    c["ratio"] = [1.0, 1.01, 1.2, 1.02, 1.5][: len(c)]
    found = headline([c], 0.05, 4)[c.loc[0, "order"]]
    assert found["n_removed"] == 1
    assert "leaves it" in found["sentence"]
    c["ratio"] = 1.0
    assert headline([c], 0.05, 4)[c.loc[0, "order"]]["n_removed"] == 4
    assert isinstance(c, pd.DataFrame)


@pytest.mark.parametrize("order, kind", [("greedy", "blocks-shared"), ("angular", "blocks")])
def test_a_slip_in_the_several_blocks_entry_falls_back(tiny, monkeypatch, order, kind):
    """A wrong residual from the several-blocks entry (with or without the shared pruned
    pass) is caught by the self-check before any number is given: the naive loop's numbers
    are reported, and the fallback says why."""
    from dataclasses import replace

    from blockscope.sweeps import entries

    ids = tokenize(tiny.tokenizer, "Alice was beginning to get very tired of sitting by her "
                   "sister on the bank.", prepend_bos=True)
    naive = block_curve(tiny, ids, orders=(order,), settings=RunSettings(engine="naive"))[0][0]
    original = entries._blocks_start

    def slipped(n_layers, v, base):
        s = original(n_layers, v, base)
        return replace(s, resid=lambda c, f=s.resid: f(c).flip(1))  # positions reversed

    monkeypatch.setattr(entries, "_blocks_start", slipped)
    curve = block_curve(tiny, ids, orders=(order,))[0][0]
    assert f"its {kind} entry" in curve.attrs["engine"]["fallback"]
    assert curve["nll"].tolist() == pytest.approx(naive["nll"].tolist(), rel=1e-5)


def test_shared_skips_are_found_by_value_not_by_object():
    import torch

    from blockscope.interventions import skip_block
    from blockscope.sweeps.entries import shared_skips
    from blockscope.sweeps.variant import Variant

    fill = torch.ones(4)
    a = Variant({}, (skip_block(1), skip_block(2, fill), skip_block(3)))
    b = Variant({}, (skip_block(1), skip_block(2, fill.clone()), skip_block(4)))
    assert shared_skips([a, b]) == (skip_block(1), skip_block(2, torch.ones(4)))
    assert skip_block(2, fill) != skip_block(2, 2 * fill) and skip_block(2) != skip_block(2, fill)
