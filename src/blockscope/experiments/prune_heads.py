"""How many heads can go: remove them cumulatively, least important first, and score each
step (Michel et al. 2019's gradient order, the single-head ablation ranking, or a random
one); `prunable` reads the headline off the curve."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pandas as pd
import torch

from blockscope.choices import HeadOrder, one_of
from blockscope.errors import BadValue
from blockscope.experiments.heads import prepare_fill, single_head_ablation
from blockscope.inputs.corpus import as_docs
from blockscope.interventions import head_edits
from blockscope.sweeps import scoring
from blockscope.sweeps.gradient import gradient_pass
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

# What each pruning step records of its run (the intervals are paired with step 0).
ROW = ["n_scored", "nll", "perplexity", "delta", "ratio", "kl", "ci_low", "ci_high",
       "delta_ci_low", "delta_ci_high"]


def check_pruning(order: str, step: float) -> None:
    one_of(HeadOrder, order, "order")
    if step <= 0 or (step >= 1 and step != int(step)):
        raise BadValue("`step` must be a fraction in (0, 1) or a whole number of heads")


def pruning_curve(
    model, tokens, *, order: str = "gradient", step: float = 0.1,
    method: str = "zero", ablation: pd.DataFrame | None = None,
    importance: torch.Tensor | None = None, prepared: scoring.Prepared | None = None,
    refine: float | None = None, settings: RunSettings = RunSettings(),
) -> pd.DataFrame:
    """Remove heads cumulatively, least important first, until none is left.

    order: "gradient" re-computes the normalised importance of the remaining heads after
    every step (as Michel et al. do); "ablation" uses the single-head ablation ranking
    (`ablation`, from `single_head_ablation`), computed once; "random" a permutation drawn
    with `settings.seed`.
    step: below 1, that fraction of the remaining heads per step (at least one); else a count.
    importance: the normalised importance of the whole model (`head_importance`), if at hand;
    prepared: from `prepare` with the same method and engine, if at hand.
    refine: a tolerance. The first step that takes perplexity past baseline x (1 + refine)
    is retraced one head at a time, in the order that step removed them (rows with
    `refined` True), so that where the curve leaves the band is known to one head.

    With the gradient order, zero ablation and the cached engine, a step's perplexity is
    read off the forward pass of the next step's gradient (the hooked model with the step's
    mask: the naive loop's own computation), not from a second forward: one pass per step.
    """
    cfg = model.cfg
    check_pruning(order, step)
    docs = as_docs(tokens)
    prepared, fill = prepare_fill(model, docs, method, settings, prepared)
    stride, ci, progress = settings.stride, settings.ci, settings.progress
    quiet = settings.quiet()  # each step's sweep: this curve reports per step
    run = functools.partial(scoring.run, model, docs, settings=quiet, prepared=prepared)
    base = scoring.scores(model, docs, [], quiet, prepared=prepared)  # checked, or naive
    fused = order == "gradient" and settings.engine == "cached" and fill is None
    n_total = cfg.n_layers * cfg.n_heads
    keep = torch.ones(cfg.n_layers, cfg.n_heads)
    static = None
    if order == "ablation":
        if ablation is None:
            ablation = single_head_ablation(model, docs, method=method, prepared=prepared,
                                            settings=quiet)
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        static = [(int(r.layer), int(r.head)) for r in rows.itertuples()]
    elif order == "random":
        g = torch.Generator().manual_seed(settings.seed)
        perm = torch.randperm(n_total, generator=g).tolist()
        static = [divmod(i, cfg.n_heads) for i in perm]
    records = [{"step": 0, "heads_removed": 0, **base.frame(ci).iloc[0][ROW].to_dict()}]
    score = importance
    if progress:
        progress(total=n_total + 1)  # at most one step per head
        progress()
    removed, how, refined = 0, {}, refine is None
    while removed < n_total:
        remaining = n_total - removed
        n = max(1, int(step * remaining)) if step < 1 else min(int(step), remaining)
        if static is not None:
            chosen = [lh for lh in static if keep[lh] == 1][:n]
        else:
            if score is None:
                _, score, _ = gradient_pass(model, docs, stride=stride, keep=keep,
                                            prepared=prepared if fused else None)
            ranked = score.masked_fill(keep == 0, float("inf")).flatten()
            chosen = [divmod(int(i), cfg.n_heads) for i in ranked.argsort(stable=True)[:n]]
            score = None
        before = keep.clone()
        for lh in chosen:
            keep[lh] = 0
        removed += len(chosen)
        if fused and removed < n_total:  # this step's NLL and the next step's gradient
            _, score, scored = gradient_pass(model, docs, stride=stride, keep=keep,
                                             prepared=prepared, kl=True)
            df = dataclasses.replace(
                base, labels=base.labels + scored.labels,
                sums=np.concatenate([base.sums, scored.sums], axis=1)).frame(ci)
            ran = scored.how
        else:
            df = run([Variant({}, tuple(head_edits(keep.clone(), fill)))])
            ran = df.attrs["engine"]
        row = df.iloc[1][ROW].to_dict()
        how = ran if "fallback" in ran or not how else how
        step_no = 1 + sum(not r.get("refined", False) for r in records[1:])
        records.append({"step": step_no, "heads_removed": removed, **row})
        if not refined and row["ratio"] > 1 + refine:
            refined = True
            records += _one_at_a_time(run, before, chosen[:-1], fill, step_no, removed -
                                      len(chosen))
        if progress:
            progress(total=len(records) + _steps_left(n_total - removed, step))
            progress()
    df = pd.DataFrame(records)
    df["refined"] = df.get("refined", pd.Series(False, index=df.index)).fillna(False)
    df = df.sort_values("heads_removed", kind="stable").reset_index(drop=True)
    df.insert(0, "order", order)
    df.insert(3, "share_removed", df["heads_removed"] / n_total)
    df.attrs["engine"] = how  # how the steps ran (a fallback, if any step had one)
    return df


def _one_at_a_time(run, keep: torch.Tensor, heads: list, fill, step_no: int,
                   start: int) -> list[dict]:
    """The heads of one step removed one by one from the mask before it: one row each."""
    if not heads:
        return []
    masks, k = [], keep.clone()
    for lh in heads:
        k[lh] = 0
        masks.append(k.clone())
    df = run([Variant({}, tuple(head_edits(m, fill))) for m in masks])
    return [{"step": step_no, "heads_removed": start + i + 1, **df.iloc[1 + i][ROW].to_dict(),
             "refined": True} for i in range(len(heads))]


def _steps_left(remaining: int, step: float) -> int:
    n = 0
    while remaining > 0:
        remaining -= max(1, int(step * remaining)) if step < 1 else min(int(step), remaining)
        n += 1
    return n


def prunable(curve: pd.DataFrame, tolerance: float) -> pd.Series:
    """The last row before the curve first leaves the band perplexity <= baseline*(1+tol):
    heads go cumulatively, so a later step back inside the band does not count."""
    rows = curve.sort_values("heads_removed", kind="stable").reset_index(drop=True)
    out = (rows["ratio"] > 1 + tolerance).to_numpy()
    first_out = int(out.argmax()) if out.any() else len(rows)
    return rows.iloc[max(first_out - 1, 0)]


def band_exit(curve: pd.DataFrame, tolerance: float) -> dict | None:
    """The step at which the curve first leaves the band, and how many heads that one step
    removed (the headline's resolution); None if it never leaves."""
    rows = curve.sort_values("heads_removed", kind="stable").reset_index(drop=True)
    out = (rows["ratio"] > 1 + tolerance).to_numpy()
    if not out.any():
        return None
    i = int(out.argmax())
    before = int(rows.loc[i - 1, "heads_removed"]) if i else 0
    return {"step": int(rows.loc[i, "step"]), "removed": int(rows.loc[i, "heads_removed"])
            - before, "ratio": float(rows.loc[i, "ratio"]),
            "refined": bool(rows["refined"].any()) if "refined" in rows else False}


def headline(curves: list[pd.DataFrame], tolerance: float, n_total: int) -> dict:
    """Per order: how many heads can go within the band (`prunable`), and where the curve
    first leaves it (`band_exit`), with the sentence that says so."""
    found = {}
    for c in curves:
        r, exit = prunable(c, tolerance), band_exit(c, tolerance)
        base = c.loc[0, "perplexity"]
        sentence = (f"{c.loc[0, 'order']} order: {int(r.heads_removed)} of {n_total} heads "
                    f"({r.share_removed:.0%}) can go with perplexity {r.perplexity:,.2f} "
                    f"within +{tolerance:.0%} of the baseline {base:,.2f} (the last step "
                    "before the curve first leaves that band)" + exit_clause(exit))
        found[c.loc[0, "order"]] = {"heads_removed": int(r.heads_removed),
                                    "share": float(r.share_removed),
                                    "perplexity": float(r.perplexity), "left_band": exit,
                                    "sentence": sentence}
    return found


def exit_clause(exit: dict | None) -> str:
    """What set the headline's resolution: the step that left the band, and a finer step
    when that step removed several heads at once."""
    if exit is None:
        return "; the curve never leaves the band"
    if exit.get("refined"):
        return (f"; step {exit['step']} left it, and retraced one head at a time it leaves "
                f"at the next head (x{exit['ratio']:.3f}): resolution one head")
    text = (f"; step {exit['step']} removed {exit['removed']} head"
            f"{'s' * (exit['removed'] != 1)} and left it (x{exit['ratio']:.3f})")
    return text + (", so a finer --step (e.g. --step 1) may find more" if exit["removed"] > 1
                   else "")
