"""Pictures of the interchange experiments: patching and causal-tracing heatmaps, and the
knockout curves. Layers are counted from 0 here, as in the CSVs."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from blockscope.experiments.patch import HEADS
from blockscope.results.plots import _drawable, _grid_ticks, _subplots

CMAP = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}


def _token_labels(tokens: list[str], span: tuple[int, int] | None = None) -> list[str]:
    """Each position's token, numbered, the subject's marked with * (as ROME's plots)."""
    lo, hi = span or (0, 0)
    return [f"{i} {_drawable(t)}{'*' * (lo <= i < hi)}" for i, t in enumerate(tokens)]


def patch_plot(df: pd.DataFrame, metric: str, title: str) -> Figure:
    """One heatmap per patched site of the normalised metric: positions x layers, or heads x
    layers for z; 1 (red) is the clean run, 0 (white) the corrupted one, as on the page
    (`charts.DIVERGING`) and the other diverging heatmaps."""
    sites = list(dict.fromkeys(df["site"]))
    width = 4.2 * len(sites) + 1
    fig, axes = _subplots(1, len(sites), figsize=(width, 4.6), squeeze=False,
                          constrained=True)
    for ax, site in zip(axes[0], sites, strict=True):
        part = df[df["site"] == site]
        col = "head" if site in HEADS else "position"
        grid = part.pivot(index=col, columns="layer", values="normalized")
        span = float(np.nanmax(np.abs(grid.to_numpy()))) or 1.0
        im = ax.imshow(grid.to_numpy(), cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
        _grid_ticks(ax, *grid.shape)
        if site not in HEADS:
            words = part.drop_duplicates("position").sort_values("position")["token"].tolist()
            ax.set_yticks(range(len(words)), _token_labels(words))
        ax.set_xlabel("layer (from 0)")
        ax.set_ylabel(col)
        ax.set_title(site)
        fig.colorbar(im, ax=ax, shrink=0.8, label="restored (0 corrupted, 1 clean)")
    # the title's default 12 points: about 9 characters an inch
    fig.suptitle(f"{textwrap.fill(title, int(9 * width))}\nmetric: {metric}")
    return fig


def trace_plot(df: pd.DataFrame, span: tuple[int, int], title: str, word: str) -> Figure:
    """ROME's heatmaps, one per kind: P(target) with each (position, layer) restored."""
    kinds = list(dict.fromkeys(df["kind"]))
    fig, axes = _subplots(1, len(kinds), figsize=(4.0 * len(kinds) + 1, 4.2), squeeze=False,
                          constrained=True)
    low = df.attrs.get("p_corrupted", 0.0)
    words = df.drop_duplicates("position").sort_values("position")["token"].tolist()
    for ax, kind in zip(axes[0], kinds, strict=True):
        grid = df[df["kind"] == kind].pivot(index="position", columns="layer", values="p_target")
        im = ax.imshow(grid.to_numpy(), cmap=CMAP.get(kind.split("-")[0], "Purples"),
                       vmin=low, aspect="auto")
        _grid_ticks(ax, *grid.shape)
        ax.set_yticks(range(len(words)), _token_labels(words, span))
        ax.set_xlabel("restored layer (from 0)" if kind.startswith("resid")
                      else "centre of the restored window (from 0)")
        ax.set_title({"resid": "state after the block", "mlp": "MLP outputs",
                      "attn": "attention outputs"}.get(kind, kind.replace("-", " ")))
        fig.colorbar(im, ax=ax, shrink=0.8, label=f"P({_drawable(word)})")
    fig.suptitle(f"{title}\n* the subject's tokens, noised in the corrupted run", fontsize=10)
    return fig


def knockout_plot(df: pd.DataFrame, title: str, word: str) -> Figure:
    """P(target)'s relative change against the window's first block, one line per edge set."""
    fig, ax = _subplots(figsize=(8, 4.5), constrained=True)
    names = {"subject": "from the subject", "non_subject": "from other positions",
             "last": "from the last position itself"}
    for edge, part in df.groupby("from", sort=False):
        ax.plot(part["layer_start"], 100 * part["relative_change"], marker="o",
                label=names.get(edge, edge))
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel(f"first block of the window of {df.attrs.get('window', '?')} (from 0)")
    ax.set_ylabel(f"change in P({_drawable(word)}), %")
    ax.legend()
    ax.set_title(title)
    return fig


def facts_trace_plot(avg: pd.DataFrame, title: str) -> Figure:
    """ROME's averaged heatmaps: mean indirect effect per position category and layer."""
    from blockscope.experiments.facts import CATEGORIES

    kinds = list(dict.fromkeys(avg["kind"]))
    fig, axes = _subplots(1, len(kinds), figsize=(4.0 * len(kinds) + 1.5, 4.2), squeeze=False,
                          constrained=True)
    for ax, kind in zip(axes[0], kinds, strict=True):
        grid = avg[avg["kind"] == kind].pivot(index="category", columns="layer",
                                              values="indirect_effect")
        grid = grid.reindex([c for c in CATEGORIES if c in grid.index])
        im = ax.imshow(grid.to_numpy(), cmap=CMAP.get(kind.split("-")[0], "Purples"),
                       aspect="auto")
        _grid_ticks(ax, *grid.shape)
        ax.set_yticks(range(len(grid.index)), list(grid.index))
        ax.set_xlabel("layer (from 0)")
        ax.set_title(kind)
        fig.colorbar(im, ax=ax, shrink=0.8, label="mean indirect effect")
    fig.suptitle(title)
    return fig


def attribute_plot(df: pd.DataFrame, title: str) -> Figure:
    """One scatter per site of the checked cells: the estimate against exact patching, both
    normalised (0 corrupted, 1 clean), on the diagonal where they agree; the largest
    estimates filled, the random ones hollow; inert cells (`attrs["inert"]`) left out, as
    the statistics leave them."""
    inert = np.asarray(df.attrs.get("inert", np.zeros(len(df), bool)), dtype=bool)
    checked = df[(df["checked"] != "").to_numpy() & ~inert]  # as the statistics count them
    sites = list(dict.fromkeys(checked["site"])) or list(dict.fromkeys(df["site"]))
    fig, axes = _subplots(1, len(sites), figsize=(3.6 * len(sites) + 0.6, 4.2), squeeze=False,
                          constrained=True)
    agree = df.attrs.get("agreement", {})
    for ax, site in zip(axes[0], sites, strict=True):
        part = checked[checked["site"] == site]
        x, y = part["normalized"].to_numpy(), part["exact_normalized"].to_numpy()
        both = np.concatenate([x, y, [0.0, 1.0]])
        both = both[np.isfinite(both)]
        lo, hi = float(both.min()), float(both.max())
        pad = 0.05 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", lw=0.8, zorder=0)
        for kind, label, style in (
                ("top", "largest estimates", dict(color="C0")),
                ("all", "every cell", dict(color="C0")),
                ("random", "drawn at random", dict(facecolors="none", edgecolors="C1"))):
            sel = (part["checked"] == kind).to_numpy()
            if sel.any():
                ax.scatter(x[sel], y[sel], s=18, label=label, **style)
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel("estimate (normalised)")
        ax.set_ylabel("exact patching (normalised)")
        rec = agree.get(site, {})
        ax.set_title(f"{site}: Pearson {rec.get('pearson', float('nan')):.2f}, "
                     f"Spearman {rec.get('spearman', float('nan')):.2f}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    width = 3.6 * len(sites) + 0.6
    fig.suptitle(textwrap.fill(title, int(11 * width)), fontsize=10)  # ~11 characters an inch
    return fig


def circuit_plot(curve: pd.DataFrame, title: str) -> Figure:
    """Faithfulness against the circuit's size (edges kept, log scale), the threshold and
    the smallest circuit that reaches it marked."""
    a = curve.attrs
    fig, ax = _subplots(figsize=(7.5, 4.2), constrained=True)
    ax.plot(curve["n_edges"], curve["faithfulness"], marker="o", ms=3)
    if "ci_low" in curve:  # over pairs
        ax.fill_between(curve["n_edges"], curve["ci_low"], curve["ci_high"], alpha=0.2,
                        color="C0", lw=0, label="95% CI over pairs")
    ax.axhline(a["threshold"], color="C1", lw=0.8, ls="--",
               label=f"threshold {a['threshold']:.0%}")
    ax.axhline(1, color="grey", lw=0.6)
    ax.axhline(0, color="grey", lw=0.6)
    if a.get("smallest"):
        ax.axvline(a["smallest"], color="C2", lw=0.8,
                   label=f"smallest: {a['smallest']:,} of {a['total_edges']:,} edges")
    ax.set_xscale("log")
    ax.set_xlabel("edges kept (the top by |estimate|)")
    ax.set_ylabel("faithfulness (0 corrupted, 1 clean)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig
