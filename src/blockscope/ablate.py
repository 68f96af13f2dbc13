"""Block ablation: perplexity with each block (or one half of it) removed in turn.

Skipping block i sets its output to its input, as the article does; `part="attn"`/`"mlp"`
removes only that half's write to the residual stream. `method="mean"` writes the removed
part's mean over positions from the clean run instead of nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.engine import Start, cached_means, clean_pass, engine_sweep
from blockscope.errors import BlockscopeError
from blockscope.interventions import PART_HOOKS, remove_part
from blockscope.similarity import BlockSimilarity, spearman
from blockscope.sweep import Progress, Variant, clean_means, model_windows, sweep, token_nll

PARTS = ("block", "attn", "mlp")
METHODS = ("zero", "mean")
ENGINES = ("cached", "naive")


def _mean_hook_names(layer: int, part: str) -> list[str]:
    if part == "block":
        return [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"]
    return [f"blocks.{layer}.{PART_HOOKS[part]}"]


def _fill(means: dict, layer: int, part: str) -> torch.Tensor | None:
    """What the removed part writes instead: None (zero) or its clean mean."""
    if not means:
        return None
    value = [means[n] for n in _mean_hook_names(layer, part)]
    return value[1] - value[0] if part == "block" else value[0]  # block: post - pre


def _start(k: int, part: str, fill: torch.Tensor | None, label: dict) -> Start:
    """Where the engine enters the stack when block k's `part` is removed."""
    add = (lambda t: t) if fill is None else (lambda t: t + fill.to(t))
    if part == "block":  # block k's output := its input (+ mean contribution): run k+1..
        return Start(label, k + 1, lambda c: add(c.pre[k]))
    if part == "attn":  # block k's mid := its input: run k's MLP half, then k+1..
        return Start(label, k, lambda c: add(c.pre[k]), mid=True)
    return Start(label, k + 1, lambda c: add(c.mid[k]))  # mlp: block k's output := its mid


def block_ablation(
    model,
    tokens: torch.Tensor,
    *,
    part: str = "block",
    method: str = "zero",
    stride: int | None = None,
    layers: Sequence[int] | None = None,
    engine: str = "cached",
    batch_size: int | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per removed layer: perplexity, change and ratio.

    Args:
        tokens: `(1, pos)` token ids, BOS already decided by the caller.
        part: "block" (the whole block skipped), "attn" or "mlp".
        method: "zero" (remove) or "mean" (replace by the clean mean over positions).
        stride: sliding-window stride for text longer than the context (default n_ctx/2).
        layers: which blocks to remove (default all).
        engine: "cached" (run each variant from the block it changes, batched) or "naive"
            (one hooked forward per variant: the reference). Same numbers either way.
        batch_size: variants per batch for the cached engine (default: by memory).
    """
    if part not in PARTS:
        raise BlockscopeError(f"--part must be one of {', '.join(PARTS)}")
    if method not in METHODS:
        raise BlockscopeError(f"--method must be one of {', '.join(METHODS)}")
    if engine not in ENGINES:
        raise BlockscopeError(f"--engine must be one of {', '.join(ENGINES)}")
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    if any(not 0 <= i < n_layers for i in layers):
        raise BlockscopeError(f"layers must be between 0 and {n_layers - 1}")
    wins = model_windows(model, tokens, stride)
    names = [n for i in layers for n in _mean_hook_names(i, part)] if method == "mean" else []
    similarity = BlockSimilarity(n_layers)
    if engine == "cached":
        # one window: its clean pass gives the means too; several: a pass over all first
        cleans = [clean_pass(model, tokens, wins[0], keep_z=False)] if len(wins) == 1 else None
        means = {}
        if names:
            means = cached_means(cleans[0]) if cleans else clean_means(model, tokens, wins,
                                                                        names)[1]
        starts = [_start(i, part, _fill(means, i, part),
                         {"layer": i, "part": part, "method": method}) for i in layers]
        df = engine_sweep(model, tokens, starts, wins=wins, cleans=cleans,
                          batch_size=batch_size, progress=progress, on_clean=similarity.add)
    else:
        baseline, means = (clean_means(model, tokens, wins, names) if names
                           else (token_nll(model, tokens, wins), {}))
        variants = [Variant({"layer": i, "part": part, "method": method},
                            remove_part(i, part, _fill(means, i, part))) for i in layers]
        df = sweep(model, tokens, variants, wins=wins, baseline_nll=baseline, progress=progress)
        for w in wins:  # the reference path pays one more clean pass for the metrics
            similarity.add(clean_pass(model, tokens, w, keep_z=False))
    df["layer"] = df["layer"].astype("Int64")
    df.loc[0, ["part", "method"]] = "none"
    attrs = df.attrs
    df = df.merge(similarity.frame(), on="layer", how="left")[COLUMNS]
    df.attrs = attrs  # how the engine ran (merge drops it)
    return df


COLUMNS = ["variant", "layer", "part", "method", "n_scored", "nll", "perplexity", "delta",
           "ratio", "block_influence", "angular_distance"]


def metric_correlations(df: pd.DataFrame) -> dict[str, float]:
    """Spearman correlation of each cheap metric with the perplexity increase, over blocks."""
    rows = df.iloc[1:]
    return {m: spearman(rows[m], rows["delta"]) for m in ("block_influence", "angular_distance")}
