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

import functools
from collections.abc import Sequence

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


def _prepare(model, docs, stride, method: str, engine: str) -> tuple[plan.Prepared, dict]:
    """The clean passes (or NLL) every head sweep starts from, and `fill`: None for zero
    ablation, else each layer's clean mean z over positions (n_heads, d_head)."""
    if method not in ("zero", "mean"):
        raise BlockscopeError("--method must be zero or mean")
    names = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    prepared = plan.prepare(model, docs, stride=stride, engine_name=engine, heads=True,
                            mean_names=names if method == "mean" else ())
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
    ci: Bootstrap | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone. `tokens`: a passage
    `(1, pos)` or `corpus.Docs`; `ci`: bootstrap intervals (`stats.frame`)."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine)
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
    model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance, normalised), each (n_layers, n_heads).

    importance = |d(mean NLL)/d mask| with the mask at `keep` (default all ones); with several
    windows, each window's |gradient of its summed NLL| is added, then divided by the tokens
    scored; over documents (`corpus.Docs`, every process), every window of every document.
    normalised divides each layer's scores by their L2 norm (Michel et al.'s code).
    """
    docs = as_docs(tokens)
    cfg = model.cfg
    keep = torch.ones(cfg.n_layers, cfg.n_heads) if keep is None else keep
    mask = keep.detach().clone().float().to(cfg.device).requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen weights: only the mask gets a gradient
    summed, n_scored = torch.zeros_like(mask), 0
    try:
        with torch.enable_grad():
            for ids in docs.ids:
                for w in model_windows(model, ids, stride):
                    with applied(model, mask_heads(mask)):
                        nll = window_nll(model, ids, w)  # (n_scored,)
                    (grad,) = torch.autograd.grad(nll.sum(), mask)
                    summed += grad.abs()
                    n_scored += nll.numel()
    finally:
        for p in params:
            p.requires_grad_(True)
    joined = total(docs.comm, {"grad": summed.detach().double().cpu(),
                               "n": torch.tensor(float(n_scored), dtype=torch.float64)})
    importance = (joined["grad"] / joined["n"]).float()
    normalised = importance / (importance.norm(dim=-1, keepdim=True) + 1e-20)
    return importance, normalised


def check_pruning(order: str, step: float) -> None:
    if order not in ORDERS:
        raise BlockscopeError(f"--order must be one of {', '.join(ORDERS)}")
    if step <= 0 or (step >= 1 and step != int(step)):
        raise BlockscopeError("--step must be a fraction in (0, 1) or a whole number of heads")


def pruning_curve(
    model, tokens, *, order: str = "gradient", step: float = 0.1,
    method: str = "zero", stride: int | None = None, ablation: pd.DataFrame | None = None,
    seed: int = 0, engine: str = "cached", progress: Progress | None = None,
    ci: Bootstrap | None = None,
) -> pd.DataFrame:
    """Remove heads cumulatively, least important first, until none is left.

    order: "gradient" re-computes the normalised importance of the remaining heads after
    every step (as Michel et al. do); "ablation" uses the single-head ablation ranking
    (`ablation`, from `single_head_ablation`), computed once; "random" a seeded permutation.
    step: below 1, that fraction of the remaining heads per step (at least one); else a count.
    """
    cfg = model.cfg
    check_pruning(order, step)
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine)
    run = functools.partial(plan.run, model, docs, prepared=prepared, stride=stride, ci=ci)
    base = run([])  # checked, or naive
    n_total = cfg.n_layers * cfg.n_heads
    keep = torch.ones(cfg.n_layers, cfg.n_heads)
    static = None
    if order == "ablation":
        if ablation is None:
            ablation = single_head_ablation(model, docs, method=method, stride=stride,
                                            engine=engine)
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        static = [(int(r.layer), int(r.head)) for r in rows.itertuples()]
    elif order == "random":
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n_total, generator=g).tolist()
        static = [divmod(i, cfg.n_heads) for i in perm]
    records = [{"step": 0, "heads_removed": 0, **base.iloc[0][ROW].to_dict()}]
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
            _, score = head_importance(model, docs, stride=stride, keep=keep)
            score = score.masked_fill(keep == 0, float("inf")).flatten()
            chosen = [divmod(int(i), cfg.n_heads) for i in score.argsort(stable=True)[:n]]
        for lh in chosen:
            keep[lh] = 0
        removed += len(chosen)
        df = run([Variant({}, tuple(head_edits(keep.clone(), fill)))])
        row, ran = df.iloc[1][ROW].to_dict(), df.attrs["engine"]
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
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    docs = as_docs(tokens)
    prepared, fill = _prepare(model, docs, stride, method, engine)
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
