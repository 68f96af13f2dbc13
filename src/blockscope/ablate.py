"""Block ablation: perplexity with each block (or one half of it) removed in turn.

Skipping block i sets its output to its input, as the article does; `part="attn"`/`"mlp"`
removes only that half's write to the residual stream. `method="mean"` writes the removed
part's mean over positions from the clean run instead of nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.errors import BlockscopeError
from blockscope.interventions import PART_HOOKS, remove_part
from blockscope.sweep import Progress, Variant, clean_means, model_windows, sweep, token_nll

PARTS = ("block", "attn", "mlp")
METHODS = ("zero", "mean")


def _mean_hook_names(layer: int, part: str) -> list[str]:
    if part == "block":
        return [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"]
    return [f"blocks.{layer}.{PART_HOOKS[part]}"]


def block_ablation(
    model,
    tokens: torch.Tensor,
    *,
    part: str = "block",
    method: str = "zero",
    stride: int | None = None,
    layers: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per removed layer: perplexity, change and ratio.

    Args:
        tokens: `(1, pos)` token ids, BOS already decided by the caller.
        part: "block" (the whole block skipped), "attn" or "mlp".
        method: "zero" (remove) or "mean" (replace by the clean mean over positions).
        stride: sliding-window stride for text longer than the context (default n_ctx/2).
        layers: which blocks to remove (default all).
    """
    if part not in PARTS:
        raise BlockscopeError(f"--part must be one of {', '.join(PARTS)}")
    if method not in METHODS:
        raise BlockscopeError(f"--method must be one of {', '.join(METHODS)}")
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    if any(not 0 <= i < n_layers for i in layers):
        raise BlockscopeError(f"layers must be between 0 and {n_layers - 1}")
    wins = model_windows(model, tokens, stride)
    if method == "mean":
        names = [n for i in layers for n in _mean_hook_names(i, part)]
        baseline, means = clean_means(model, tokens, wins, names)
    else:
        baseline, means = token_nll(model, tokens, wins), {}
    variants = []
    for i in layers:
        value = None
        if method == "mean":
            value = [means[n] for n in _mean_hook_names(i, part)]
            value = value[1] - value[0] if part == "block" else value[0]  # block: post - pre
        label = {"layer": i, "part": part, "method": method}
        variants.append(Variant(label, remove_part(i, part, value)))
    df = sweep(model, tokens, variants, wins=wins, baseline_nll=baseline, progress=progress)
    df["layer"] = df["layer"].astype("Int64")
    df.loc[0, ["part", "method"]] = "none"
    return df[["variant", "layer", "part", "method", "n_scored", "nll", "perplexity", "delta",
               "ratio"]]
