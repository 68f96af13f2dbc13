"""The picture of `ablate --decompose`: each removal's logit change, split."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from blockscope.results.plots import _finish, _subplots


def decompose_plot(df: pd.DataFrame, title: str) -> Figure:
    """A stacked bar per removed component: its own write, later blocks' reactions and the
    final norm, each above or below zero, with the total marked."""
    fig, ax = _subplots(figsize=(8, 4.5))
    x = np.arange(len(df))
    parts = [("direct", "own write", "tab:red"), ("downstream", "later blocks", "tab:blue"),
             ("final_norm", "final norm", "tab:grey")]
    up, down = np.zeros(len(df)), np.zeros(len(df))
    for col, label, colour in parts:
        v = df[col].to_numpy(dtype=float)
        base = np.where(v >= 0, up, down)
        ax.bar(x, v, bottom=base, color=colour, label=label, width=0.7)
        up, down = up + np.clip(v, 0, None), down + np.clip(v, None, 0)
    ax.scatter(x, df["total"], marker="_", s=400, color="black", zorder=3, label="total")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, [str(int(v)) for v in df["layer"]])
    if len(df) > 16:
        for i, tick in enumerate(ax.get_xticklabels()):
            tick.set_visible(i % 2 == 0)
    return _finish(fig, ax, "removed component's block (from 0)",
                   "change in the correct token's centred logit", title)
