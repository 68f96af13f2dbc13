"""The pictures of `norm-placement`: gradient norms at initialization, and the final loss
against the learning rate."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from blockscope.results.plots import _finish, _log_y, _subplots


def norm_init_plot(summary: pd.DataFrame, title: str) -> Figure:
    """Gradient norm per block at initialization (log axis), one line per layout x init."""
    fig, ax = _subplots(figsize=(8, 4.5))
    for (layout, scaled), rows in summary.groupby(["layout", "scaled_init"], sort=False):
        ax.plot(rows["layer"], rows["grad_norm"], marker="o",
                linestyle="-" if layout == "pre" else "--",
                label=f"{layout}-norm, {'scaled' if scaled else 'unscaled'} init")
    _log_y(ax)
    ax.xaxis.get_major_locator().set_params(integer=True)  # blocks are whole numbers
    return _finish(fig, ax, "block (from 0)", "gradient norm of its six matrices (log scale)",
                   title)


def norm_train_plot(trained: pd.DataFrame, title: str, plateau: float | None = None,
                    margin: float = 0.0) -> Figure:
    """Final loss against the learning rate (log axis), one line per layout x warm-up, with
    the unigram plateau and the line a run must pass to count as trained (the standard
    figure for the warm-up claim: Xiong et al.; Liu et al. 2020). A diverged run is an x."""
    fig, ax = _subplots(figsize=(8, 4.5))
    plateau = trained.attrs.get("plateau") if plateau is None else plateau
    margin = margin or trained.attrs.get("margin", 0.0)
    finals = trained[trained["kind"] == "final"]
    top = float(np.nanmax(finals["loss"])) if finals["loss"].notna().any() else 1.0
    for (layout, warmup), rows in finals.groupby(["layout", "warmup_steps"], sort=False):
        style = dict(linestyle="-" if layout == "pre" else "--",
                     marker="o" if warmup else "s")
        line, = ax.plot(rows["peak_lr"], rows["loss"], **style,
                        label=f"{layout}-norm, warm-up {int(warmup)}")
        gone = rows[rows["loss"].isna()]
        if len(gone):
            ax.plot(gone["peak_lr"], [top] * len(gone), "x", color=line.get_color(),
                    markersize=9)
    if plateau is not None:
        ax.axhline(plateau, color="grey", linewidth=0.8, label=f"unigram plateau {plateau:.2f}")
        ax.axhline(plateau - margin, color="grey", linewidth=0.8, linestyle=":",
                   label=f"trained: below {plateau - margin:.2f}")
    ax.set_xscale("log")
    lrs = sorted(finals["peak_lr"].unique())
    ax.set_xticks(lrs, [f"{v:g}" for v in lrs])
    ax.minorticks_off()
    return _finish(fig, ax, "peak learning rate (log scale; x: diverged)",
                   "final loss (nats per token)", title)
