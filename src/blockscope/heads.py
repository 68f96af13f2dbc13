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
)

ORDERS = ("gradient", "ablation", "random")


def _fill(model, tokens, wins, method: str) -> tuple[torch.Tensor, dict | None]:
    """Clean NLL, and each layer's mean z over positions when `method` is "mean"."""
    if method == "zero":
        return token_nll(model, tokens, wins), None
    if method != "mean":
        raise BlockscopeError("--method must be zero or mean")
    names = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    nll, means = clean_means(model, tokens, wins, names)
    return nll, {i: means[n] for i, n in enumerate(names)}  # (n_heads, d_head) each


def _check(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    values = list(range(n)) if values is None else list(values)
    if not values or any(not 0 <= v < n for v in values):
        raise BlockscopeError(f"--{what} must be between 0 and {n - 1}")
    return values


def single_head_ablation(
    model, tokens: torch.Tensor, *, method: str = "zero", stride: int | None = None,
    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    wins = model_windows(model, tokens, stride)
    baseline, fill = _fill(model, tokens, wins, method)
    variants = []
    for layer in layers:
        for head in heads:
            keep = torch.ones(cfg.n_layers, cfg.n_heads)
            keep[layer, head] = 0
            label = {"layer": layer, "head": head, "method": method}
            variants.append(Variant(label, mask_heads(keep, fill)))
    df = sweep(model, tokens, variants, wins=wins, baseline_nll=baseline, progress=progress)
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
    seed: int = 0, progress: Progress | None = None,
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
    baseline, fill = _fill(model, tokens, wins, method)
    n_total = cfg.n_layers * cfg.n_heads
    keep = torch.ones(cfg.n_layers, cfg.n_heads)
    static = None
    if order == "ablation":
        if ablation is None:
            ablation = single_head_ablation(model, tokens, method=method, stride=stride)
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        static = [(int(r.layer), int(r.head)) for r in rows.itertuples()]
    elif order == "random":
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n_total, generator=g).tolist()
        static = [divmod(i, cfg.n_heads) for i in perm]
    records = [{"step": 0, "heads_removed": 0, **perplexity_row(baseline)}]
    if progress:
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
        with applied(model, mask_heads(keep, fill)):
            nll = token_nll(model, tokens, wins)
        records.append({"step": len(records), "heads_removed": removed, **perplexity_row(nll)})
        if progress:
            progress()
    df = pd.DataFrame(records)
    df.insert(0, "order", order)
    df.insert(3, "share_removed", df["heads_removed"] / n_total)
    base = df.loc[0, "perplexity"]
    df["delta"] = df["perplexity"] - base
    df["ratio"] = df["perplexity"] / base
    return df


def prunable(curve: pd.DataFrame, tolerance: float) -> pd.Series:
    """The curve's row with the most heads removed while perplexity <= baseline*(1+tol)."""
    ok = curve[curve["ratio"] <= 1 + tolerance]
    return ok.loc[ok["heads_removed"].idxmax()]


def one_head_per_layer(
    model, tokens: torch.Tensor, importance: torch.Tensor, *, method: str = "zero",
    stride: int | None = None, progress: Progress | None = None,
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    wins = model_windows(model, tokens, stride)
    baseline, fill = _fill(model, tokens, wins, method)
    variants = []
    for layer in range(cfg.n_layers):
        kept = int(importance[layer].argmax())
        keep = torch.ones(cfg.n_layers, cfg.n_heads)
        keep[layer] = 0
        keep[layer, kept] = 1
        variants.append(Variant({"layer": layer, "kept_head": kept}, mask_heads(keep, fill)))
    df = sweep(model, tokens, variants, wins=wins, baseline_nll=baseline, progress=progress)
    df[["layer", "kept_head"]] = df[["layer", "kept_head"]].astype("Int64")
    return df
