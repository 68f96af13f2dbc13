"""Pictures of the experiments' DataFrames (matplotlib, headless).

Each function takes a DataFrame an experiment returned and gives back a Figure; the CLI
writes it beside the CSV. Nothing here measures anything. Figures are made directly, not
through pyplot: no global figure registry to close, no GUI backend to choose, and pyplot's
import (about 0.5 s here) stays out of every command; `Figure.savefig` renders with Agg.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FuncFormatter,
    Locator,
    LogFormatter,
    LogLocator,
    MaxNLocator,
    NullLocator,
)

DPI = 120


def _subplots(*layout: int, figsize: tuple[float, float], squeeze: bool = True,
              constrained: bool = False, **kwargs):
    """(fig, axes) as `pyplot.subplots(*layout, ...)` gives them, at DPI, without pyplot;
    `constrained`: matplotlib's constrained layout places titles, labels and colour bars
    (the grids of panels, whose labels would otherwise overlap the next panel)."""
    fig = Figure(figsize=figsize, dpi=DPI,  # 8 x 4.5 in: 960 x 540 pixels
                 layout="constrained" if constrained else None)
    return fig, fig.subplots(*layout, squeeze=squeeze, **kwargs)


def _grid_ticks(ax, n_rows: int, n_cols: int) -> None:
    """Whole-number ticks on a layers x heads heatmap: every one up to 16, else every 2nd,
    4th, 5th... (at most 10 ticks), all inside the grid."""
    for axis, n in ((ax.yaxis, n_rows), (ax.xaxis, n_cols)):
        step = 1 if n <= 16 else next(s for s in (2, 4, 5, 8, 10, 16, 20, 25, 50, 100, n)
                                      if n / s <= 10)
        axis.set_ticks(range(0, n, step))


def _drawable(text: str) -> str:
    """A token's text as the tables show it, whitespace visible (`\u2423` for a space: the
    plot font has it)."""
    from blockscope.inputs.text import visible

    return visible(text)


class _PlainLog(LogFormatter):
    """LogFormatter's choice of which ticks to label, written as plain numbers: 1.4, not
    1.4 x 10^0, and 0.998, not the 1e+00 LogFormatter writes for it."""

    def _num_to_string(self, x, vmin, vmax):
        return _plain(x)


class _ReadableLog(Locator):
    """Ticks a reader can read off a log axis: where the axis spans under a factor of 3,
    evenly spaced round numbers (0.9, 1, 1.1, ...: matplotlib's log ticks labelled only 0.9
    and 1 on an axis from 0.85 to 1.75); up to 1.5 decades, 1, 1.5, 2, 3, 5 and 7 times each
    power of ten; wider, 1, 2 and 5 times."""

    def __call__(self):
        lo, hi = self.axis.get_view_interval()
        return self.tick_values(lo, hi)

    def tick_values(self, vmin, vmax):
        lo, hi = sorted((vmin, vmax))
        lo = max(lo, 1e-300)
        if hi / lo < 3:
            return MaxNLocator(nbins=10, steps=[1, 2, 5, 10]).tick_values(lo, hi)
        subs = (1, 1.5, 2, 3, 5, 7) if hi / lo < 30 else (1, 2, 5)
        return LogLocator(base=10, subs=subs).tick_values(lo, hi)


def _log_y(ax) -> None:
    """A log y axis with round, readable ticks (`_ReadableLog`) in plain numbers (every log
    axis here)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(_ReadableLog())
    ax.yaxis.set_major_formatter(FuncFormatter(_plain))
    ax.yaxis.set_minor_locator(NullLocator())


def _plain(x: float, _pos=None) -> str:
    """1.4, not 1.4 x 10^0; 80,000, not 8e+04."""
    return f"{x:,.0f}" if abs(x) >= 1e3 else f"{x:.4g}"


def ablation_plot(df: pd.DataFrame, title: str, labels: list[str] | None = None,
                  xlabel: str | None = None) -> Figure:
    """Perplexity of each removal (or other variant: `labels`, `xlabel`) against the
    baseline: bars of perplexity / baseline on a log axis, starting at 1 (the baseline), so
    a 5% change stays a short bar."""
    fig, ax = _subplots(figsize=(8, 4.5))
    rows = df.iloc[1:]
    base = df.loc[0, "perplexity"]
    part = str(rows["part"].iloc[0]) if len(rows) and "part" in rows else "block"
    rotate = labels is not None and max(map(len, labels), default=0) > 3
    labels = labels or [str(int(v)) for v in rows["layer"]]
    ratio = rows["perplexity"].to_numpy() / base
    colors = ["tab:red" if r >= 1 else "tab:green" for r in ratio]
    ax.bar(labels, ratio - 1, bottom=1, color=colors)
    if "delta_ci_low" in rows and rows["delta_ci_low"].notna().all():
        # the paired interval of each change, as a ratio: 1 + delta / baseline
        lo = 1 + rows["delta_ci_low"].to_numpy() / base
        hi = 1 + rows["delta_ci_high"].to_numpy() / base
        ax.errorbar(labels, ratio, yerr=[(ratio - lo).clip(0), (hi - ratio).clip(0)],
                    fmt="none", ecolor="black", elinewidth=1, capsize=3,
                    label="95% interval (paired bootstrap)")
    ax.axhline(1, color="black", linewidth=0.8, label=f"baseline {base:,.1f}")
    _log_y(ax)
    low, high = ax.get_ylim()  # room below the baseline line, where every bar rises from 1
    if low >= 1 / (high / low) ** 0.04:
        ax.set_ylim(min(low, 1) / (high / min(low, 1)) ** 0.05, high)
    if rotate:
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
    what = "block" if part == "block" else f"{part} of the block"
    fig = _finish(fig, ax, xlabel or f"{what} removed (counted from 0)",
                  "perplexity / baseline (log scale)", title)
    if rotate:  # room for the slanted labels
        fig.subplots_adjust(bottom=0.26)
    return fig


def resid_norm_plot(df: pd.DataFrame, title: str) -> Figure:
    """Residual-stream norm along the stream on a log axis, one line per position."""
    fig, ax = _subplots(figsize=(9, 4.5))
    for pos, group in df.groupby("position", sort=True):
        token = _drawable(group["token"].iloc[0])
        ax.plot(range(len(group)), group["norm"], marker="o", markersize=3,
                label=f"pos {pos} {token!r}")
    points = list(df.groupby("position", sort=True).get_group(df["position"].iloc[0])["after"])
    step = max(1, len(points) // 14)
    ax.set_xticks(range(0, len(points), step), points[::step], rotation=45, ha="right",
                  fontsize=8)
    _log_y(ax)
    ax.set_xlabel("point in the residual stream")
    ax.set_ylabel("L2 norm (log scale)")
    ax.set_title(title, fontsize=10)
    if df["position"].nunique() <= 12:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def resid_norm_band_plot(df: pd.DataFrame, title: str) -> Figure:
    """The median residual norm along the stream over a corpus's tokens, with the band from
    the 10th to the 90th percentile, on a log axis."""
    fig, ax = _subplots(figsize=(8, 4.5))
    x = range(len(df))
    ax.fill_between(x, df["p10"], df["p90"], alpha=0.25, label="10th-90th percentile")
    ax.plot(x, df["median"], marker="o", markersize=3, label="median")
    _log_y(ax)
    step = max(1, len(df) // 16)
    ax.set_xticks(list(x)[::step], [str(a) for a in df["after"]][::step], rotation=45,
                  ha="right", fontsize=7)
    fig = _finish(fig, ax, "point of the residual stream", "L2 norm (log scale)", title)
    fig.subplots_adjust(bottom=0.24)  # room for the slanted labels
    return fig


def prune_heads_plot(per_head: pd.DataFrame, curve: pd.DataFrame, *, n_layers: int,
                     n_heads: int, tolerance: float, title: str) -> Figure:
    """Left: layers x heads heatmap of the single-head effect. Right: the pruning curves."""
    fig, (left, right) = _subplots(1, 2, figsize=(12, 4.8))
    grid = np.full((n_layers, n_heads), np.nan)
    for r in per_head.itertuples():
        grid[int(r.layer), int(r.head)] = 100 * (r.ratio - 1)
    top = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
    im = left.imshow(grid, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
    left.set_xticks(range(n_heads))
    left.set_yticks(range(n_layers))
    left.set_xlabel("head")
    left.set_ylabel("layer")
    left.set_title("perplexity change with one head removed", fontsize=10)
    fig.colorbar(im, ax=left, label="perplexity change (%)")
    base = curve.loc[0, "perplexity"]
    right.axhspan(base, base * (1 + tolerance), color="tab:green", alpha=0.15,
                  label=f"within +{tolerance:.0%}")
    for order, group in curve.groupby("order", sort=False):
        right.plot(100 * group["share_removed"], group["perplexity"], marker=".", label=order)
    _log_y(right)
    right.set_xlabel("heads removed (%)")
    right.set_ylabel("perplexity (log scale)")
    right.set_title("pruning curve", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def prune_blocks_plot(curve: pd.DataFrame, *, n_layers: int, tolerance: float,
                      title: str) -> Figure:
    """Perplexity against blocks removed, one line per order, the tolerance band shaded."""
    fig, ax = _subplots(figsize=(8, 4.5))
    base = curve.loc[0, "perplexity"]
    ax.axhspan(base, base * (1 + tolerance), color="tab:green", alpha=0.15,
               label=f"within +{tolerance:.0%}")
    styles = list(zip(("o", "s", "^", "D", "v"), ("-", "--", "-.", ":", "-"), (7, 6, 5, 4, 3),
                      strict=True))
    for (order, group), (marker, line, size) in zip(curve.groupby("order", sort=False),
                                                    styles, strict=False):  # coinciding
        #   curves stay visible: each order its marker, line style and size
        label = f"{order} (windows)" if order == "angular" else order
        ax.plot(group["n_removed"], group["perplexity"], marker=marker, linestyle=line,
                markersize=size, label=label, alpha=0.9)
    _log_y(ax)
    ax.set_xticks(range(0, n_layers + 1, 1 if n_layers <= 16 else 2))
    ax.set_xlim(-0.3, curve["n_removed"].max() + 0.3)
    return _finish(fig, ax, f"blocks removed (of {n_layers})", "perplexity (log scale)", title)


PARAM_PARTS = {  # stacked-bar segment -> components of the `params` table
    "embeddings": ["token embeddings", "position embeddings", "unembedding (untied)"],
    "attention": ["attention"],
    "MLP": ["MLP"],
    "norms": ["layer norms", "final norm"],
}


def params_plot(df: pd.DataFrame, title: str) -> Figure:
    """Share of each model's parameters in embeddings, attention, MLP and norms."""
    fig, ax = _subplots(figsize=(max(5, 2.2 * df["model"].nunique() + 2), 4.5),
                        constrained=True)
    models = list(dict.fromkeys(df["model"]))
    bottom = np.zeros(len(models))
    for part, components in PARAM_PARTS.items():
        shares = []
        for m in models:
            rows = df[(df["model"] == m) & df["component"].isin(components)]
            n_blocks = int(df[(df["model"] == m) & df["component"].str.startswith("all ")]
                           ["component"].iloc[0].split()[1])
            per_block = rows["scope"] == "per block"
            count = rows.loc[per_block, "parameters"].sum() * n_blocks
            count += rows.loc[~per_block, "parameters"].sum()
            total = df[(df["model"] == m) & (df["component"] == "total")]["parameters"].iloc[0]
            shares.append(100 * count / total)
        ax.bar(models, shares, bottom=bottom, label=part)
        bottom += np.array(shares)
    ax.set_ylabel("share of all parameters (%)")
    ax.set_ylim(0, 100)
    fig.suptitle(title, fontsize=10)  # over the figure, legend included: never cut
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def _finish(fig: Figure, ax, xlabel: str, ylabel: str, title: str) -> Figure:
    """Labels, title, legend; fixed margins for these one-axes 8 x 4.5 figures (tight_layout
    draws the whole figure once more just to measure it: a quarter second per command)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.9)
    return fig


def head_roles_plot(df: pd.DataFrame, roles, n_layers: int, n_heads: int, title: str) -> Figure:
    """One layer x head heatmap per role, on one colour scale (0 to the largest score)."""
    fig, axes = _subplots(1, len(roles), figsize=(4.2 * len(roles), 0.3 * n_layers + 2.4),
                          squeeze=False, sharey=True, constrained=True)
    grids = {r: np.full((n_layers, n_heads), np.nan) for r in roles}
    for row in df.itertuples():
        for r in roles:
            grids[r][row.layer, row.head] = getattr(row, r)
    top = max(float(np.nanmax(g)) for g in grids.values()) or 1.0
    for ax, r in zip(axes[0], roles, strict=True):
        im = ax.imshow(grids[r], vmin=0, vmax=top, cmap="viridis", aspect="auto")
        ax.set_title(r.replace("_", " "), fontsize=10)
        ax.set_xlabel("head")
        _grid_ticks(ax, n_layers, n_heads)
    axes[0][0].set_ylabel("layer")  # the panels share it
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9, label="score (share of attention)")
    fig.suptitle(title, fontsize=10)
    return fig


def attention_plot(df: pd.DataFrame, title: str) -> Figure:
    """A grid of attention heatmaps (query rows, key columns), tokens on both axes."""
    pairs = list(dict.fromkeys(zip(df["layer"], df["head"], strict=True)))
    cols = min(4, len(pairs))
    rows = -(-len(pairs) // cols)
    T = int(df["query_pos"].max()) + 1
    labels = (df[(df["layer"] == pairs[0][0]) & (df["head"] == pairs[0][1])]
              .drop_duplicates("query_pos").sort_values("query_pos")["query_token"]
              .map(_drawable).tolist())
    size = max(3.0, 0.22 * T + 1.5)
    fig, axes = _subplots(rows, cols, figsize=(size * cols + 1, size * rows + 0.4),
                          squeeze=False, constrained=True)
    for ax in axes.flat[len(pairs):]:
        ax.axis("off")
    for ax, (layer, head) in zip(axes.flat, pairs, strict=False):
        one = df[(df["layer"] == layer) & (df["head"] == head)]
        grid = one.pivot(index="query_pos", columns="key_pos", values="weight").to_numpy()
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues")
        ax.set_title(f"layer {layer}, head {head}", fontsize=9)
        if T <= 40:  # tokens on both axes while they stay readable
            ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
            ax.set_yticks(range(T), labels, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=min(0.9, 1.6 / rows),
                 label="attention weight")
    fig.suptitle(title, fontsize=10)
    return fig

