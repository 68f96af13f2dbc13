"""The pruning curve: every head removed in steps, its first step, seeds, the headline."""

import math

import pandas as pd
import pytest

from blockscope.errors import BadValue
from blockscope.experiments.prune_heads import prunable, pruning_curve
from blockscope.inputs.text import tokenize
from blockscope.sweeps.naive import model_windows, token_nll
from blockscope.sweeps.settings import RunSettings

REL = 1e-5
SENTENCE = "Alice was beginning to get very tired of sitting by her sister on the bank."


@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize(tiny.tokenizer, SENTENCE, prepend_bos=True)


def test_the_curve_starts_at_the_baseline(tiny, ids):
    base = token_nll(tiny, ids, model_windows(tiny, ids, None))
    curve = pruning_curve(tiny, ids, order="random", step=0.5)
    assert curve.loc[0, "heads_removed"] == 0
    assert curve.loc[0, "perplexity"] == pytest.approx(math.exp(base.mean()), rel=REL)


@pytest.mark.parametrize("order", ["gradient", "ablation", "random"])
def test_pruning_curve_removes_every_head_in_steps(tiny, ids, order):
    curve = pruning_curve(tiny, ids, order=order, step=0.25)
    removed = list(curve["heads_removed"])
    assert removed[0] == 0 and removed[-1] == 12
    assert all(b > a for a, b in zip(removed, removed[1:], strict=False))
    assert removed[1] == 3  # 25% of 12
    assert curve["share_removed"].iloc[-1] == 1.0
    best = prunable(curve, tolerance=10.0)
    assert best["heads_removed"] == curve[curve["ratio"] <= 11]["heads_removed"].max()


def test_random_curve_is_reproducible_with_its_seed(tiny, ids):
    a = pruning_curve(tiny, ids, order="random", step=1, settings=RunSettings(seed=3))
    b = pruning_curve(tiny, ids, order="random", step=1, settings=RunSettings(seed=3))
    c = pruning_curve(tiny, ids, order="random", step=1, settings=RunSettings(seed=4))
    assert a.equals(b)
    assert not a["perplexity"].equals(c["perplexity"])


def test_bad_orders_and_steps_are_refused(tiny, ids):
    """The library names the parameter as it calls it; the CLI says the flag."""
    with pytest.raises(BadValue, match="^order must be one of") as bad:
        pruning_curve(tiny, ids, order="magnitude")
    assert bad.value.as_flag().startswith("--order must be one of")
    with pytest.raises(BadValue, match="^step must be") as bad:
        pruning_curve(tiny, ids, step=1.5)
    assert bad.value.as_flag().startswith("--step must be")


def test_the_headline_stops_where_the_curve_first_leaves_the_band():
    """A later step back inside the band does not count: heads go cumulatively."""
    curve = pd.DataFrame({"heads_removed": [0, 10, 20, 30, 40],
                          "ratio": [1.0, 1.01, 1.20, 1.02, 1.50]})
    assert int(prunable(curve, tolerance=0.05)["heads_removed"]) == 10
    assert int(prunable(curve, tolerance=0.25)["heads_removed"]) == 30
    assert int(prunable(curve, tolerance=0.6)["heads_removed"]) == 40


def test_the_step_that_leaves_the_band_is_retraced_one_head_at_a_time(tiny, ids):
    """Half the heads per step, then the first step out of the band redone head by head:
    each retraced row equals the one-head-per-step curve of the same order (the brute-force
    reference), and the headline is the one-head curve's, at a resolution of one head."""
    from blockscope.experiments.prune_heads import band_exit

    fine = pruning_curve(tiny, ids, order="random", step=1, settings=RunSettings(seed=2))
    ratio = fine.set_index("heads_removed")["ratio"]
    # a band the 6-head step leaves, first left by the fine curve at k < 6 heads
    k = next(k for k in range(2, 6) if ratio[k] > ratio[:k].max() and ratio[6] > ratio[:k].max())
    tol = (ratio[:k].max() + ratio[k]) / 2 - 1
    coarse = pruning_curve(tiny, ids, order="random", step=0.5, refine=tol,
                           settings=RunSettings(seed=2))
    retraced = coarse[coarse["refined"]]
    assert list(retraced["heads_removed"]) == [1, 2, 3, 4, 5]
    want = fine.set_index("heads_removed").loc[[1, 2, 3, 4, 5], "perplexity"]
    assert retraced["perplexity"].tolist() == pytest.approx(want.tolist(), rel=REL)
    assert prunable(coarse, tol)["heads_removed"] == k - 1 == prunable(fine, tol)["heads_removed"]
    assert band_exit(coarse, tol)["removed"] == 1
    unrefined = pruning_curve(tiny, ids, order="random", step=0.5, settings=RunSettings(seed=2))
    assert band_exit(unrefined, tol)["removed"] == 6 and not unrefined["refined"].any()
