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

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.engine import Start, cached_means, clean_pass, engine_sweep, heads_removed
from blockscope.errors import BlockscopeError
from blockscope.interventions import applied, mask_heads
from blockscope.sweep import (
    Progress,
    Variant,
    clean_means,
    model_windows,
    perplexity_row,
    sweep,
    token_nll,
    window_nll,
    with_change,
)

ORDERS = ("gradient", "ablation", "random")
ENGINES = ("cached", "naive")


def _prepare(model, tokens, wins, method: str, engine: str, keep_z: bool):
    """(clean passes or None, clean NLL or None, fill): what every head sweep starts from.

    fill is None for zero ablation, else each layer's clean mean z over positions
    (n_heads, d_head). The cached engine keeps every window's clean pass (z too if asked).
    """
    if method not in ("zero", "mean"):
        raise BlockscopeError("--method must be zero or mean")
    if engine not in ENGINES:
        raise BlockscopeError(f"--engine must be one of {', '.join(ENGINES)}")
    names = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    cleans = nll = None
    if engine == "cached":
        cleans = [clean_pass(model, tokens, w, keep_z=keep_z or method == "mean") for w in wins]
        if method == "mean":
            means = (cached_means(cleans[0]) if len(wins) == 1
                     else clean_means(model, tokens, wins, names)[1])
    elif method == "mean":
        nll, means = clean_means(model, tokens, wins, names)
    else:
        nll = token_nll(model, tokens, wins)
    fill = None if method == "zero" else {i: means[n] for i, n in enumerate(names)}
    return cleans, nll, fill


def _head_sweep(model, tokens, wins, items, *, cleans, nll, fill, batch_size, progress):
    """Score `items` = [(label, layer, keep (n_heads,))], each changing one layer's heads."""
    n_heads = model.cfg.n_heads
    if cleans is not None:
        starts = [Start(label, layer, heads_removed(model, layer, keep,
                                                    fill[layer] if fill else None), mid=True)
                  for label, layer, keep in items]
        return engine_sweep(model, tokens, starts, wins=wins, cleans=cleans,
                            batch_size=batch_size, progress=progress)
    variants = []
    for label, layer, keep in items:
        full = torch.ones(model.cfg.n_layers, n_heads)
        full[layer] = keep
        variants.append(Variant(label, mask_heads(full, fill)))
    return sweep(model, tokens, variants, wins=wins, baseline_nll=nll, progress=progress)


def _check(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    values = list(range(n)) if values is None else list(values)
    if not values or any(not 0 <= v < n for v in values):
        raise BlockscopeError(f"--{what} must be between 0 and {n - 1}")
    return values


def single_head_ablation(
    model, tokens: torch.Tensor, *, method: str = "zero", stride: int | None = None,
    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
    engine: str = "cached", batch_size: int | None = None, progress: Progress | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    wins = model_windows(model, tokens, stride)
    cleans, nll, fill = _prepare(model, tokens, wins, method, engine, keep_z=True)
    items = []
    for layer in layers:
        for head in heads:
            keep = torch.ones(cfg.n_heads)
            keep[head] = 0
            items.append(({"layer": layer, "head": head, "method": method}, layer, keep))
    df = _head_sweep(model, tokens, wins, items, cleans=cleans, nll=nll, fill=fill,
                     batch_size=batch_size, progress=progress)
    df[["layer", "head"]] = df[["layer", "head"]].astype("Int64")
    df.loc[0, "method"] = "none"
    return df


def head_importance(
    model, tokens: torch.Tensor, *, stride: int | None = None, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance, normalised), each (n_layers, n_heads).

    importance = |d(mean NLL)/d mask| with the mask at `keep` (default all ones); with several
    windows, each window's |gradient of its summed NLL| is added, then divided by the tokens
    scored. normalised divides each layer's scores by their L2 norm (Michel et al.'s code).
    """
    cfg = model.cfg
    keep = torch.ones(cfg.n_layers, cfg.n_heads) if keep is None else keep
    mask = keep.detach().clone().float().to(cfg.device).requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen weights: only the mask gets a gradient
    total, n_scored = torch.zeros_like(mask), 0
    try:
        with torch.enable_grad():
            for w in model_windows(model, tokens, stride):
                with applied(model, mask_heads(mask)):
                    nll = window_nll(model, tokens, w)  # (n_scored,)
                (grad,) = torch.autograd.grad(nll.sum(), mask)
                total += grad.abs()
                n_scored += nll.numel()
    finally:
        for p in params:
            p.requires_grad_(True)
    importance = (total / n_scored).detach().cpu()
    normalised = importance / (importance.norm(dim=-1, keepdim=True) + 1e-20)
    return importance, normalised


def check_pruning(order: str, step: float) -> None:
    if order not in ORDERS:
        raise BlockscopeError(f"--order must be one of {', '.join(ORDERS)}")
    if step <= 0 or (step >= 1 and step != int(step)):
        raise BlockscopeError("--step must be a fraction in (0, 1) or a whole number of heads")


def pruning_curve(
    model, tokens: torch.Tensor, *, order: str = "gradient", step: float = 0.1,
    method: str = "zero", stride: int | None = None, ablation: pd.DataFrame | None = None,
    seed: int = 0, engine: str = "cached", progress: Progress | None = None,
) -> pd.DataFrame:
    """Remove heads cumulatively, least important first, until none is left.

    order: "gradient" re-computes the normalised importance of the remaining heads after
    every step (as Michel et al. do); "ablation" uses the single-head ablation ranking
    (`ablation`, from `single_head_ablation`), computed once; "random" a seeded permutation.
    step: below 1, that fraction of the remaining heads per step (at least one); else a count.
    """
    cfg = model.cfg
    check_pruning(order, step)
    wins = model_windows(model, tokens, stride)
    cleans, baseline, fill = _prepare(model, tokens, wins, method, engine, keep_z=False)
    if cleans is not None:
        baseline = torch.cat([c.nll for c in cleans]).double().cpu()
    n_total = cfg.n_layers * cfg.n_heads
    keep = torch.ones(cfg.n_layers, cfg.n_heads)
    static = None
    if order == "ablation":
        if ablation is None:
            ablation = single_head_ablation(model, tokens, method=method, stride=stride,
                                            engine=engine)
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        static = [(int(r.layer), int(r.head)) for r in rows.itertuples()]
    elif order == "random":
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n_total, generator=g).tolist()
        static = [divmod(i, cfg.n_heads) for i in perm]
    records = [{"step": 0, "heads_removed": 0, **perplexity_row(baseline)}]
    if progress:
        progress(total=n_total + 1)  # at most one step per head
        progress()
    removed = 0
    while removed < n_total:
        remaining = n_total - removed
        n = max(1, int(step * remaining)) if step < 1 else min(int(step), remaining)
        if static is not None:
            chosen = [lh for lh in static if keep[lh] == 1][:n]
        else:
            _, score = head_importance(model, tokens, stride=stride, keep=keep)
            score = score.masked_fill(keep == 0, float("inf")).flatten()
            chosen = [divmod(int(i), cfg.n_heads) for i in score.argsort(stable=True)[:n]]
        for lh in chosen:
            keep[lh] = 0
        removed += len(chosen)
        row = _score_mask(model, tokens, wins, keep.clone(), fill, cleans)
        records.append({"step": len(records), "heads_removed": removed, **row})
        if progress:
            progress(total=len(records) + _steps_left(n_total - removed, step))
            progress()
    df = with_change(records)
    df.insert(0, "order", order)
    df.insert(3, "share_removed", df["heads_removed"] / n_total)
    return df


def _steps_left(remaining: int, step: float) -> int:
    n = 0
    while remaining > 0:
        remaining -= max(1, int(step * remaining)) if step < 1 else min(int(step), remaining)
        n += 1
    return n


def _score_mask(model, tokens, wins, keep: torch.Tensor, fill, cleans) -> dict:
    """Perplexity with heads scaled by `keep` (n_layers, n_heads), from the first changed
    layer on when the clean passes are cached."""
    hooks = mask_heads(keep, fill)
    if cleans is None:
        with applied(model, hooks):
            return perplexity_row(token_nll(model, tokens, wins))
    first = int((keep != 1).any(dim=1).nonzero()[0])
    start = Start({}, first, lambda c: c.pre[first], hooks=hooks)
    df = engine_sweep(model, tokens, [start], wins=wins, cleans=cleans)
    return df.iloc[1][["n_scored", "nll", "perplexity"]].to_dict()


def prunable(curve: pd.DataFrame, tolerance: float) -> pd.Series:
    """The curve's row with the most heads removed while perplexity <= baseline*(1+tol)."""
    ok = curve[curve["ratio"] <= 1 + tolerance]
    return ok.loc[ok["heads_removed"].idxmax()]


def one_head_per_layer(
    model, tokens: torch.Tensor, importance: torch.Tensor, *, method: str = "zero",
    stride: int | None = None, engine: str = "cached", batch_size: int | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    wins = model_windows(model, tokens, stride)
    cleans, nll, fill = _prepare(model, tokens, wins, method, engine, keep_z=True)
    items = []
    for layer in range(cfg.n_layers):
        kept = int(importance[layer].argmax())
        keep = torch.zeros(cfg.n_heads)
        keep[kept] = 1
        items.append(({"layer": layer, "kept_head": kept}, layer, keep))
    df = _head_sweep(model, tokens, wins, items, cleans=cleans, nll=nll, fill=fill,
                     batch_size=batch_size, progress=progress)
    df[["layer", "kept_head"]] = df[["layer", "kept_head"]].astype("Int64")
    return df
