"""Which heads matter, and how many can go (Michel et al. 2019; Voita et al. 2019).

- `single_head_ablation`: perplexity with each head removed (z zeroed before W_O, or replaced
  by its clean mean over positions).
- `head_importance`: Michel et al.'s |dLoss/dmask| for a head mask multiplying each z, from
  one forward and backward pass with the weights frozen, plus the per-layer L2-normalised
  score their code prunes by.
- `pruning_curve`: remove heads cumulatively, least important first, and score each step.
- `one_head_per_layer`: keep only each layer's most important head in turn.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from blockscope import plan
from blockscope.corpus import as_docs
from blockscope.errors import BlockscopeError
from blockscope.interventions import Edit, applied, head_edits, mask_heads
from blockscope.parallel import total
from blockscope.stats import Bootstrap
from blockscope.sweep import Progress, Variant, model_windows, window_nll

ORDERS = ("gradient", "ablation", "random")
# What each pruning step records of its run (the intervals are paired with step 0).
ROW = ["n_scored", "nll", "perplexity", "delta", "ratio", "ci_low", "ci_high", "delta_ci_low",
       "delta_ci_high"]
ENGINES = plan.ENGINES


def prepare(model, tokens, *, method: str = "zero", stride: int | None = None,
            engine: str = "cached") -> plan.Prepared:
    """The clean passes (or NLL) and, for `method` mean, the clean mean z that every head
    experiment below starts from: computed once, passed to each as `prepared=`."""
    return _prepare(model, as_docs(tokens), stride, method, engine)[0]


def _prepare(model, docs, stride, method: str, engine: str,
             prepared: plan.Prepared | None = None) -> tuple[plan.Prepared, dict | None]:
    """`prepared` (made here if None), and `fill`: None for zero ablation, else each
    layer's clean mean z over positions (n_heads, d_head)."""
    if method not in ("zero", "mean"):
        raise BlockscopeError("--method must be zero or mean")
    names = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    if prepared is None:
        prepared = plan.prepare(model, docs, stride=stride, engine_name=engine, heads=True,
                                mean_names=names if method == "mean" else ())
    elif prepared.engine != engine or (method == "mean" and not set(names) <= set(
            prepared.means)):
        raise ValueError(f"`prepared` was made for another engine or method than "
                         f"{engine}/{method}")
    fill = {i: prepared.means[n] for i, n in enumerate(names)} if method == "mean" else None
    return prepared, fill


def _head_sweep(model, docs, items, *, prepared, fill, **kw):
    """Score `items` = [(label, layer, keep (n_heads,))], each changing one layer's heads."""
    variants = [Variant(label, (Edit("heads", layer, fill[layer] if fill else None, keep),))
                for label, layer, keep in items]
    return plan.run(model, docs, variants, prepared=prepared, **kw)


def _check(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    values = list(range(n)) if values is None else list(values)
    if not values or any(not 0 <= v < n for v in values):
        raise BlockscopeError(f"--{what} must be between 0 and {n - 1}")
    return values


def single_head_ablation(
    model, tokens, *, method: str = "zero", stride: int | None = None,
    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
    engine: str = "cached", batch_size: int | None = None, progress: Progress | None = None,
    ci: Bootstrap | None = None, prepared: plan.Prepared | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone. `tokens`: a passage
    `(1, pos)` or `corpus.Docs`; `ci`: bootstrap intervals (`stats.frame`); `prepared`:
    from `prepare` with the same method and engine, if at hand."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine, prepared)
    items = []
    for layer in layers:
        for head in heads:
            keep = torch.ones(cfg.n_heads)
            keep[head] = 0
            items.append(({"layer": layer, "head": head, "method": method}, layer, keep))
    df = _head_sweep(model, docs, items, prepared=prepared, fill=fill, stride=stride,
                     batch_size=batch_size, progress=progress, ci=ci)
    df[["layer", "head"]] = df[["layer", "head"]].astype("Int64")
    df.loc[0, "method"] = "none"
    return df


def head_importance(
    model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
    prepared: plan.Prepared | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance, normalised), each (n_layers, n_heads).

    importance = |d(mean NLL)/d mask| with the mask at `keep` (default all ones), and 0 for
    a head `keep` removes (sets to 0: it is gone, and the plain replay leaves it out); with
    several windows, each window's |gradient of its summed NLL| is added, then divided by
    the tokens scored; over documents (`corpus.Docs`, every process), every window of every
    document. normalised divides each layer's scores by their L2 norm (Michel et al.'s code).
    With the cached clean passes in `prepared`, the pass runs as `gradient_pass` says.
    """
    importance, normalised, _ = gradient_pass(model, tokens, stride=stride, keep=keep,
                                              prepared=prepared)
    return importance, normalised


def gradient_pass(model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
                  prepared: plan.Prepared | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, plan.Scores]:
    """`head_importance`, and the NLL of the same forward passes as `plan.Scores` (one
    column: the model with heads scaled by `keep`, the hooked forward the gradient needs).

    Given the cached clean passes of the one document (`prepared`), the forward and backward
    run as the plain replay (fused attention) with the mask applied to each head's z, once
    `selfcheck.gradient_replay` has held that to the hooked model on each window; otherwise,
    and on any mismatch (said in `how["fallback"]`), through the hooked bridge."""
    from blockscope import arch, replay, selfcheck
    from blockscope.engine import fused_gelu

    docs = as_docs(tokens)
    cfg = model.cfg
    keep = torch.ones(cfg.n_layers, cfg.n_heads) if keep is None else keep
    mask = keep.detach().clone().float().to(cfg.device).requires_grad_(True)
    cleans = prepared.cleans if prepared is not None and len(docs.ids) == 1 else None
    lay = arch.layout(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen weights: only the mask gets a gradient
    summed, n_scored, units = torch.zeros_like(mask), 0, []
    how = {"replay": set(), "batch_size": 1}
    try:
        with torch.enable_grad():
            for index, ids in zip(docs.index, docs.ids, strict=True):
                nlls = []
                for wi, w in enumerate(model_windows(model, ids, stride)):
                    plain = None
                    if cleans is not None:
                        plain, why = selfcheck.gradient_replay(model, lay, cleans[wi], mask)
                        if why:
                            how["fallback"] = why
                    if plain is not None:
                        with fused_gelu(model):
                            nll = replay.masked_nll(model, plain, cleans[wi], mask, lay.softcap)
                    else:
                        with applied(model, mask_heads(mask)):
                            nll = window_nll(model, ids, w)  # (n_scored,)
                    how["replay"].add("plain" if plain is not None else "bridge")
                    (grad,) = torch.autograd.grad(nll.sum(), mask)
                    summed += grad.abs() * (mask.detach() != 0)  # a removed head: 0
                    n_scored += nll.numel()
                    nlls.append(nll.detach().double().cpu())
                units += plan.doc_units(index, torch.cat(nlls)[None], docs.unit)
    finally:
        for p in params:
            p.requires_grad_(True)
    joined = total(docs.comm, {"grad": summed.detach().double().cpu(),
                               "n": torch.tensor(float(n_scored), dtype=torch.float64)})
    importance = (joined["grad"] / joined["n"]).float()
    normalised = importance / (importance.norm(dim=-1, keepdim=True) + 1e-20)
    how["replay"] = "+".join(sorted(how["replay"], reverse=True))
    scored = plan.gather_units(docs, units, [how] if units else [], [{"variant": "ablated"}])
    return importance, normalised, scored


def check_pruning(order: str, step: float) -> None:
    if order not in ORDERS:
        raise BlockscopeError(f"--order must be one of {', '.join(ORDERS)}")
    if step <= 0 or (step >= 1 and step != int(step)):
        raise BlockscopeError("--step must be a fraction in (0, 1) or a whole number of heads")


def pruning_curve(
    model, tokens, *, order: str = "gradient", step: float = 0.1,
    method: str = "zero", stride: int | None = None, ablation: pd.DataFrame | None = None,
    seed: int = 0, engine: str = "cached", progress: Progress | None = None,
    ci: Bootstrap | None = None, importance: torch.Tensor | None = None,
    prepared: plan.Prepared | None = None,
) -> pd.DataFrame:
    """Remove heads cumulatively, least important first, until none is left.

    order: "gradient" re-computes the normalised importance of the remaining heads after
    every step (as Michel et al. do); "ablation" uses the single-head ablation ranking
    (`ablation`, from `single_head_ablation`), computed once; "random" a seeded permutation.
    step: below 1, that fraction of the remaining heads per step (at least one); else a count.
    importance: the normalised importance of the whole model (`head_importance`), if at hand;
    prepared: from `prepare` with the same method and engine, if at hand.

    With the gradient order, zero ablation and the cached engine, a step's perplexity is
    read off the forward pass of the next step's gradient (the hooked model with the step's
    mask: the naive loop's own computation), not from a second forward: one pass per step.
    """
    cfg = model.cfg
    check_pruning(order, step)
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine, prepared)
    run = functools.partial(plan.run, model, docs, prepared=prepared, stride=stride, ci=ci)
    base = plan.scores(model, docs, [], prepared=prepared, stride=stride)  # checked, or naive
    fused = order == "gradient" and engine == "cached" and fill is None
    n_total = cfg.n_layers * cfg.n_heads
    keep = torch.ones(cfg.n_layers, cfg.n_heads)
    static = None
    if order == "ablation":
        if ablation is None:
            ablation = single_head_ablation(model, docs, method=method, stride=stride,
                                            engine=engine, prepared=prepared)
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        static = [(int(r.layer), int(r.head)) for r in rows.itertuples()]
    elif order == "random":
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n_total, generator=g).tolist()
        static = [divmod(i, cfg.n_heads) for i in perm]
    records = [{"step": 0, "heads_removed": 0, **base.frame(ci).iloc[0][ROW].to_dict()}]
    score = importance
    if progress:
        progress(total=n_total + 1)  # at most one step per head
        progress()
    removed, how = 0, {}
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
        for lh in chosen:
            keep[lh] = 0
        removed += len(chosen)
        if fused and removed < n_total:  # this step's NLL and the next step's gradient
            _, score, scored = gradient_pass(model, docs, stride=stride, keep=keep,
                                             prepared=prepared)
            df = dataclasses.replace(
                base, labels=base.labels + scored.labels,
                sums=np.concatenate([base.sums, scored.sums], axis=1)).frame(ci)
            ran = scored.how
        else:
            df = run([Variant({}, tuple(head_edits(keep.clone(), fill)))])
            ran = df.attrs["engine"]
        row = df.iloc[1][ROW].to_dict()
        how = ran if "fallback" in ran or not how else how
        records.append({"step": len(records), "heads_removed": removed, **row})
        if progress:
            progress(total=len(records) + _steps_left(n_total - removed, step))
            progress()
    df = pd.DataFrame(records)
    df.insert(0, "order", order)
    df.insert(3, "share_removed", df["heads_removed"] / n_total)
    df.attrs["engine"] = how  # how the steps ran (a fallback, if any step had one)
    return df


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


def one_head_per_layer(
    model, tokens, importance: torch.Tensor, *, method: str = "zero",
    stride: int | None = None, engine: str = "cached", batch_size: int | None = None,
    progress: Progress | None = None, ci: Bootstrap | None = None,
    prepared: plan.Prepared | None = None,
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine, prepared)
    items = []
    for layer in range(cfg.n_layers):
        kept = int(importance[layer].argmax())
        keep = torch.zeros(cfg.n_heads)
        keep[kept] = 1
        items.append(({"layer": layer, "kept_head": kept}, layer, keep))
    df = _head_sweep(model, docs, items, prepared=prepared, fill=fill, stride=stride,
                     batch_size=batch_size, progress=progress, ci=ci)
    df[["layer", "kept_head"]] = df[["layer", "kept_head"]].astype("Int64")
    return df
