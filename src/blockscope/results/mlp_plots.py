"""Pictures of the MLP section: the logit lens along the stream, its points x positions
grid, and mlp-memory's neuron cards (matplotlib, headless, as `plots`)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from blockscope.results.plots import _drawable, _PlainLog, _subplots


def lens_plot(df: pd.DataFrame, attrs: pd.DataFrame | None, title: str) -> Figure:
    """Left: the target's rank (log axis) and probability under the lens at every point.
    Right: each block's direct contribution to the target's logit, attention and MLP."""
    fig, axes = _subplots(1, 2 if attrs is not None else 1, figsize=(13, 4.8),
                          squeeze=False, constrained=True)
    left = axes[0][0]
    x = range(len(df))
    left.plot(x, df["target_rank"], marker=".", color="tab:blue")
    left.set_yscale("log")
    left.invert_yaxis()  # rank 1 at the top
    left.yaxis.set_major_formatter(_PlainLog(labelOnlyBase=False))
    left.set_ylabel(f"rank of {_drawable(df['target'].iloc[-1])!r} (log scale)",
                    color="tab:blue")
    prob = left.twinx()
    prob.plot(x, df["target_prob"], marker=".", color="tab:orange")
    prob.set_ylim(0, 1)
    prob.set_ylabel("its probability", color="tab:orange")
    step = max(1, len(df) // 16)
    left.set_xticks(list(x)[::step], df["point"].tolist()[::step], rotation=45, ha="right",
                    fontsize=8)
    left.set_xlabel("point in the residual stream (the lens reads it as if the model ended)")
    left.set_title("the logit lens", fontsize=10)
    if attrs is not None:
        right = axes[0][1]
        blocks = attrs[(attrs["level"] == "block") & attrs["layer"].notna()]
        layers = sorted(int(v) for v in blocks["layer"].unique())
        width = 0.4
        for offset, half, colour in ((-width / 2, "attn", "tab:purple"),
                                     (width / 2, "mlp", "tab:green")):
            part = blocks[blocks["half"] == half].set_index("layer")["contribution"]
            right.bar([la + 1 + offset for la in layers], [part.get(la, 0.0) for la in layers],
                      width=width, color=colour, label="attention" if half == "attn" else "MLP")
        right.axhline(0, color="black", linewidth=0.8)
        right.set_xlabel("block (counted from 0)")
        right.set_ylabel("direct contribution to the logit")
        right.set_title("direct logit attribution (final norm's scale frozen)", fontsize=10)
        right.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def lens_grid_plot(df: pd.DataFrame, title: str) -> Figure:
    """Points x positions: the lens's top-1 token written in each cell, shaded by its
    probability (the picture the logit lens is known by)."""
    points = list(dict.fromkeys(df["point"]))
    positions = sorted(df["position"].unique())
    prob = df.pivot(index="point", columns="position", values="p1").reindex(points)
    word = df.pivot(index="point", columns="position", values="top1").reindex(points)
    fig, ax = _subplots(figsize=(max(6.0, 1.1 * len(positions) + 2.5),
                                 max(4.0, 0.28 * len(points) + 1.5)), constrained=True)
    im = ax.imshow(prob.to_numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=1)
    for i in range(len(points)):
        for j in range(len(positions)):
            p = prob.iat[i, j]
            ax.text(j, i, _drawable(str(word.iat[i, j]))[:10], ha="center", va="center",
                    fontsize=7, color="white" if p > 0.6 else "black")
    tokens = df.drop_duplicates("position").sort_values("position")["token"]
    ax.set_xticks(range(len(positions)), [_drawable(t) for t in tokens], rotation=45,
                  ha="right", fontsize=8)
    ax.set_yticks(range(len(points)), points, fontsize=7)
    ax.set_xlabel("input token (the lens predicts the next one)")
    fig.colorbar(im, ax=ax, label="top-1 probability", shrink=0.8)
    fig.suptitle(title + ": the logit lens, top-1 token", fontsize=10)
    return fig


def memory_plot(neurons: pd.DataFrame, keys: pd.DataFrame | None, title: str) -> Figure:
    """One card per neuron, to paste into notes: block and neuron, activation and direct
    logit, the tokens its write promotes, and (with a corpus) the contexts firing it most."""
    n = len(neurons)
    cols = min(3, n)
    rows = -(-n // cols)
    per = 1.2 + (0.32 * min(3, int(keys["rank"].max())) if keys is not None and len(keys)
                 else 0)
    fig, axes = _subplots(rows, cols, figsize=(5.2 * cols, per * rows + 0.6), squeeze=False,
                          constrained=True)
    for ax in axes.flat:
        ax.axis("off")
    from matplotlib.patches import Rectangle

    for ax, r in zip(axes.flat, neurons.itertuples(), strict=False):
        ax.add_patch(Rectangle((-0.02, -0.05), 1.02, 1.08, transform=ax.transAxes,
                               fill=False, edgecolor="0.8", clip_on=False))  # the card
        lines = [(f"block {r.layer}, neuron {r.neuron}", "bold"),
                 (f"activation {r.activation:+.2f}, direct logit {r.contribution:+.3f}", None),
                 ("promotes: " + " ".join(_drawable(t) for t in r.promotes.split("|")), None)]
        if keys is not None:
            mine = keys[(keys["layer"] == r.layer) & (keys["neuron"] == r.neuron)]
            for k in mine.sort_values("rank").head(3).itertuples():
                context = " ".join(str(k.context).split())[-46:]
                lines.append((f"{k.activation:+.1f}: ...{context}", "italic"))
        for i, (line, style) in enumerate(lines):
            ax.text(0, 1 - i / max(4, len(lines)), line, transform=ax.transAxes, va="top",
                    fontsize=8, fontweight="bold" if style == "bold" else "normal",
                    fontstyle="italic" if style == "italic" else "normal", wrap=False)
    fig.suptitle(title, fontsize=10)
    return fig
