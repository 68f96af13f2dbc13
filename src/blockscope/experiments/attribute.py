"""Attribution patching over `patch`'s whole grid, checked against exact patching.

The grid is `patch`'s: every (layer, position) of `resid-pre`, `attn-out` and `mlp-out`, and
every (layer, head) of `z` at all positions, the clean run's activation written into the
corrupted run. Each cell's effect is estimated from gradients (`sweeps.attribution`: AtP, or
integrated gradients), in the direction and normalisation of `patch`: `estimate` is the
metric's estimated change, and `normalized` is estimate / (clean - corrupted), so 0 is the
corrupted run and 1 the clean run. The two commands' CSVs line up column for column: the
same cells in the same order, `normalized` beside patch's `normalized`, and the checked
cells' `exact_<metric>` and `exact_normalized` equal to patch's `<metric>` and `normalized`.

Every run checks itself: per site, the `check` cells of largest |estimate| and `check` cells
drawn at random from the rest (`seed`) are patched exactly on the interchange engine (what
`patch` runs), or every cell (`check=None`). Over the checked cells: the Pearson and
Spearman correlations of estimate and exact effect, the largest miss, and the largest exact
effect among the random cells, a bound on what the estimate's ranking missed (AtP*'s check,
Kramar et al. 2024). Inert cells, where the clean and corrupted activations are equal (the
positions before the prompts first differ), change nothing: they are never drawn, and are
left out of the statistics, whose ranks would otherwise order float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.experiments.agreement import agreement, picked
from blockscope.experiments.patch import (
    SITES,
    check_lengths,
    check_sites,
    patched,
    variants,
)
from blockscope.sweeps import attribution
from blockscope.sweeps.interchange import Run
from blockscope.sweeps.metrics import LogitDiff, TargetLogProb
from blockscope.sweeps.settings import RunSettings

METHODS = ("atp", "ig", "atp-star")
MEANING = {
    "estimate": "the estimated change of the metric when the clean run's activation is "
    "written into the corrupted run at the row's site: " + attribution.SIGN,
    "normalized": "estimate / (clean - corrupted): 0 is the corrupted run, 1 the clean run, "
    "as in patch's CSV",
    "exact": "the metric of the corrupted run with the clean activation written at the row's "
    "site, computed by patching (empty where the row was not checked)",
    "exact_normalized": "(exact - corrupted) / (clean - corrupted), as patch's normalized",
    "graddrop": "atp-star only: AtP*'s GradDrop, the mean over blocks l of |estimate| with "
    "block l's writes to the residual stream given no gradient (a bound against "
    "cancellation, in the metric's units; not signed); the cells are ranked by it",
    "checked": "top: among the largest |estimate| of its site (atp-star: the largest "
    "graddrop); random: drawn from the rest; all: every cell was checked; empty: not "
    "checked",
    "z": "one head's z at every position (head column; position empty)",
}


MEANING_PAIRS = {
    "estimate": "the estimated change of the metric, averaged over pairs",
    "normalized": "the mean estimate over the mean clean - corrupted gap (a ratio of means: "
    "a pair with a small gap weighs little)",
    "ci_low": "normalized's 95% bootstrap interval over pairs, low end",
    "ci_high": "normalized's 95% bootstrap interval over pairs, high end",
    "exact_normalized": "the mean exact change over the mean gap, the checked rows patched "
    "in every pair",
    "exact_ci_low": "exact_normalized's 95% bootstrap interval over pairs, low end",
    "exact_ci_high": "exact_normalized's 95% bootstrap interval over pairs, high end",
}


SIGN_RULE = ("estimate: " + attribution.SIGN + "; normalized = estimate / (clean - "
             "corrupted), 0 the corrupted run, 1 the clean run, as patch normalises")
STAR_RULE = ("atp-star: q and k cells by the QK fix (the block's pattern with the clean "
             "queries, or keys, computed exactly by the model's own attention, then (A' - A) "
             ". dM/dA), every other cell as atp; graddrop: the mean over blocks l of the "
             "|estimate| with block l's attention and MLP writes detached, summed over L and "
             "divided by L - 1 (Kramar et al. 2024)")
EDGE_CHECK_RULE = ("the K edges of largest |estimate| (top) and K drawn from the rest with "
                   "numpy default_rng(seed) (random) are patched exactly: one forward of the "
                   "corrupted run whose reader reads the clean run's writer there, at every "
                   "position (sweeps.edges.rewired)")
PATH_RULE = ("ig: the gradient is the mean over alpha = k/m, k = 0..m-1, of the gradient at "
             "block 0's input corrupted + alpha (clean - corrupted), the left Riemann sum "
             "(m = 1 is atp)")
CHECK_RULE = ("per site, the K cells of largest |estimate| (top) and K drawn from the rest "
              "with numpy default_rng(seed) (random) are patched exactly on the interchange "
              "engine, as patch patches them; correlations over the checked cells but the "
              "inert ones (the clean and corrupted activations equal there: the patch writes "
              "what is there), which are never drawn")


def check_method(method: str, steps: int) -> None:
    if method not in METHODS:
        raise BadValue(f"`method` must be one of {', '.join(METHODS)} (got {method})")
    if not 1 <= steps <= 1000:
        raise BadValue(f"`ig_steps` must be between 1 and 1,000 (got {steps})")


def check_count(check: int | None) -> None:
    if check is not None and check < 0:
        raise BadValue(f"`check` must be a count of 0 or more, or all (got {check})")


def attribute(model, clean: torch.Tensor, corrupted: torch.Tensor, *, target: int,
              contrast: int | None = None, sites=("resid-pre",), method: str = "atp",
              steps: int = 5, check: int | None = 20, seed: int = 0,
              settings: RunSettings = RunSettings()) -> pd.DataFrame:
    """One row per cell of `patch`'s grid over `sites`: `site, layer, head, position, token,
    estimate, normalized` (estimated), with `atp-star` its `graddrop`, `checked`, and for
    the checked rows `exact_<metric>` and `exact_normalized` (patch's `<metric>` and
    `normalized`). attrs: the clean and corrupted
    values, the metric, the estimate's passes (`attribution`), the check's statistics per
    site (`agreement`), how the exact patches ran (`how`), and per row whether it is inert
    (`inert`: its patch writes the values already there)."""
    check_sites(sites)
    check_lengths(clean.shape[-1], corrupted.shape[-1])
    check_method(method, steps)
    check_count(check)
    metric = TargetLogProb(target) if contrast is None else LogitDiff(target, contrast)
    n = clean.shape[-1]
    grid = variants(model.cfg, n, sites)
    base, sources = Run(corrupted), {"clean": Run(clean)}
    est = attribution.estimate(model, base, sources, grid, metric, method=method, steps=steps)
    lo, hi = est.base, est.sources["clean"]
    gap = hi - lo
    words = [model.tokenizer.decode([t]) for t in clean[0].tolist()]
    rows = []
    for v, e in zip(grid, est.values, strict=True):
        p = v.label["position"]
        rows.append({**v.label, "token": "" if p is None else words[p], "estimate": e,
                     "normalized": e / gap if gap else math.nan})
    df = pd.DataFrame(rows)
    rank = "estimate"
    if est.bound is not None:
        df["graddrop"] = est.bound
        rank = "graddrop"
    df["head"] = df["head"].astype("Int64")
    df["position"] = df["position"].astype("Int64")

    chosen = picked(df, check, seed, est.inert, rank)
    df["checked"] = chosen
    picks = [i for i, c in enumerate(chosen) if c]
    exact = patched(model, base, sources, [grid[i] for i in picks], metric, settings)
    df[f"exact_{metric.name}"] = math.nan
    df.loc[picks, f"exact_{metric.name}"] = exact.values[:, 0]
    e_lo, e_hi = float(exact.base[0]), float(exact.sources["clean"][0])
    df["exact_normalized"] = ((df[f"exact_{metric.name}"] - e_lo) / (e_hi - e_lo)
                              if e_hi != e_lo else math.nan)
    df.attrs.update(clean=hi, corrupted=lo, metric=metric.name, attribution=est.how,
                    how=exact.how, agreement=agreement(df, metric.name, e_lo, est.inert),
                    check=("all" if check is None else check), seed=seed,
                    inert=est.inert.tolist())
    return df


def attribute_pairs(model, items: list, *, sites=("resid-pre",), method: str = "atp",
                    steps: int = 5, check: int | None = 20, seed: int = 0,
                    settings: RunSettings = RunSettings(), comm=None,
                    kept=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`attribute` over many pairs (`experiments.pairs.Tokens`): (one row per cell, as
    `attribute`'s, its values averaged over pairs; one row per pair). `estimate` and
    `exact_<metric>` are means over pairs, `normalized` and `exact_normalized` the mean
    change as a share of the mean gap, each with its bootstrap interval over pairs
    (`ci_low`, `ci_high`, `exact_ci_low`, `exact_ci_high`). The cells checked are picked
    on the averaged estimates, and patched exactly in every pair. Pairs are shared across
    processes under torchrun (`comm`) and kept as they finish (`kept`), twice: the
    estimates, then the exact patches. `settings.progress` is told of each pair done, in
    each pass."""
    from blockscope.experiments import pairs as px

    progress, settings = settings.progress, settings.quiet()

    check_sites(sites)
    check_method(method, steps)
    check_count(check)
    px.check_aligned(items, sites, "given")

    def metric_of(t):
        return TargetLogProb(t.target) if t.contrast is None else LogitDiff(t.target, t.contrast)

    def runs(t):
        return Run(t.corrupted), {"clean": Run(t.clean)}

    def estimated(t) -> dict:
        est = attribution.estimate(model, *runs(t), variants(model.cfg, t.length, sites),
                                   metric_of(t), method=method, steps=steps)
        return {"values": est.values, "inert": est.inert, "bound": est.bound,
                "base": est.base, "clean": est.sources["clean"], "how": est.how}

    ests = px.over(items, estimated, comm, kept, progress)
    grid = variants(model.cfg, items[0].length, sites)
    values = np.stack([e["values"] for e in ests])  # (pairs, cells)
    lo, hi = np.array([e["base"] for e in ests]), np.array([e["clean"] for e in ests])
    inert = np.all([e["inert"] for e in ests], axis=0)
    share, ci_lo, ci_hi = px.ratio(values, hi - lo)
    words = common_tokens(model.tokenizer, items)
    df = pd.DataFrame([{**v.label, "token": "" if v.label["position"] is None
                        else words[v.label["position"]]} for v in grid])
    df["estimate"], df["normalized"] = values.mean(0), share
    df["ci_low"], df["ci_high"] = ci_lo, ci_hi
    rank = "estimate"
    if ests[0]["bound"] is not None:
        df["graddrop"] = np.mean([e["bound"] for e in ests], axis=0)
        rank = "graddrop"
    df["head"] = df["head"].astype("Int64")
    df["position"] = df["position"].astype("Int64")
    df["checked"] = picked(df, check, seed, inert, rank)
    picks = [i for i, c in enumerate(df["checked"]) if c]
    name = metric_of(items[0]).name

    def exact(t) -> dict:
        cells = variants(model.cfg, t.length, sites)
        got = patched(model, *runs(t), [cells[i] for i in picks], metric_of(t), settings)
        return {"values": got.values[:, 0], "base": float(got.base[0]),
                "clean": float(got.sources["clean"][0]), "how": got.how}

    exs = px.over(items, exact, comm, kept, progress) if picks else []
    for col in (f"exact_{name}", "exact_normalized", "exact_ci_low", "exact_ci_high"):
        df[col] = math.nan
    e_lo = float(np.mean([e["base"] for e in exs])) if exs else float(lo.mean())
    if exs:
        got = np.stack([e["values"] for e in exs])  # (pairs, picked)
        base = np.array([e["base"] for e in exs])
        gap = np.array([e["clean"] for e in exs]) - base
        df.loc[picks, f"exact_{name}"] = got.mean(0)
        cols = ["exact_normalized", "exact_ci_low", "exact_ci_high"]
        df.loc[picks, cols] = np.stack(px.ratio(got - base[:, None], gap), axis=1)
    per_pair = px.per_pair(items, name, hi, lo)
    df.attrs.update(clean=float(hi.mean()), corrupted=float(lo.mean()), metric=name,
                    attribution={**ests[0]["how"], "pairs": len(items),
                                 "seconds": round(sum(e["how"].get("seconds", 0)
                                                      for e in ests), 3)},
                    how=exs[0]["how"] if exs else {},
                    agreement=agreement(df, name, e_lo, inert),
                    check=("all" if check is None else check), seed=seed,
                    inert=inert.tolist(), n_pairs=len(items))
    return df, per_pair


def common_tokens(tokenizer, items: list) -> list[str]:
    """Per position, the clean prompts' token where every pair has the same one, else
    "(varies)" (positions line up: the pairs have one length where positions are asked)."""
    n = min(t.length for t in items)
    ids = np.stack([t.clean[0, :n].numpy() for t in items])
    return [tokenizer.decode([int(col[0])]) if (col == col[0]).all() else "(varies)"
            for col in ids.T]


__all__ = ["METHODS", "MEANING", "SITES", "attribute", "attribute_pairs"]
