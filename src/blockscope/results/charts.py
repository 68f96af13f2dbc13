"""Each command's figures as interactive charts (plotly.js), for its page (`results.page`).

`charts(result)` gives the figures of one Result, by its command: heatmaps of
(layer x position) or (layer x head) cells, lines with their intervals, and the attention
patterns, a head at a time. Every chart shows the exact value under the pointer, as the
CSV holds it to 6 significant digits (`VALUE`). A command with no chart here has a page
with its table and settings alone.

A figure is plotly.js's own JSON, `{"data": [traces], "layout": {...}}`, written here as
plain dicts: what `Plotly.newPlot` reads. plotly's Python figure objects would validate the
same dicts at a second's import per process and add a 6 KB template to each figure.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

VALUE = ".6g"  # how a hover label writes a value: what the browser tests read back
HEIGHT = 360
# ColorBrewer's RdBu, negative blue, 0 white, positive red; and its Blues from white
DIVERGING = [[0.0, "#053061"], [0.1, "#2166ac"], [0.2, "#4393c3"], [0.3, "#92c5de"],
             [0.4, "#d1e5f0"], [0.5, "#f7f7f7"], [0.6, "#fddbc7"], [0.7, "#f4a582"],
             [0.8, "#d6604d"], [0.9, "#b2182b"], [1.0, "#67001f"]]
SEQUENTIAL = [[0.0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"],
              [1.0, "#08306b"]]


def _figure(data: list, title: str, height: int = HEIGHT, **layout) -> dict:
    return {"data": data, "layout": {"title": {"text": title}, "height": height,
                                     "margin": {"t": 50}, **layout}}


def _floats(values) -> list:
    """Numbers as JSON takes them: NaN as null (a gap)."""
    return [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
            for v in values]


def heatmap(df: pd.DataFrame, value: str, title: str, *, rows: str = "layer",
            cols: str = "position", col_labels: dict | None = None, zmid: float | None = 0.0,
            row_order: list | None = None):
    """One heatmap of `df[value]` over (rows, cols): a column per distinct `cols` value,
    labelled by `col_labels` (position -> "3 ␣France"), a row per `rows` value."""
    if df.duplicated([rows, cols]).any():  # a cell is one row: never pick one of several
        raise ValueError(f"{value}: several rows for one ({rows}, {cols}) cell")
    grid = df.pivot_table(index=rows, columns=cols, values=value, aggfunc="first",
                          sort=row_order is None, dropna=False)
    if row_order is not None:
        grid = grid.reindex(row_order)
    x = [str(col_labels.get(c, c)) if col_labels else str(c) for c in grid.columns]
    y = [str(r) for r in grid.index]
    z = grid.to_numpy(dtype=float)
    peak = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
    trace = {"type": "heatmap", "z": [_floats(row) for row in z], "x": x, "y": y,
             "colorscale": DIVERGING if zmid is not None else SEQUENTIAL,
             "hovertemplate": f"{rows} %{{y}}<br>{cols} %{{x}}<br>{value} %{{z:{VALUE}}}"
                              "<extra></extra>", "hoverongaps": False}
    if zmid is not None:
        trace.update(zmid=zmid, zmin=-peak, zmax=peak)
    return _figure([trace], title, max(HEIGHT, 18 * len(y) + 140),
                   xaxis={"title": {"text": cols}, "type": "category"},
                   yaxis={"title": {"text": rows}, "type": "category",
                          "autorange": "reversed"})


def lines(df: pd.DataFrame, x: str, y: str, title: str, *, group: str | None = None,
          low: str = "ci_low", high: str = "ci_high", log_x: bool = False,
          baseline: float | None = None):
    """`y` against `x`, a line per `group` value, each with its interval (`low`, `high`)
    as a band where the frame has one."""
    data = []
    parts = [(None, df)] if group is None else list(df.groupby(group, sort=False))
    for k, (name, part) in enumerate(parts):
        color = _color(k)
        xs = [v if isinstance(v, str) else _floats([v])[0] for v in part[x]]
        if low in part and high in part and part[low].notna().any():
            data.append({"type": "scatter", "x": xs + xs[::-1],
                         "y": _floats(part[high]) + _floats(part[low])[::-1],
                         "fill": "toself", "fillcolor": color.replace("rgb", "rgba")
                         .replace(")", ",0.15)"), "line": {"width": 0},
                         "hoverinfo": "skip", "showlegend": False})
        data.append({"type": "scatter", "x": xs, "y": _floats(part[y]),
                     "mode": "lines+markers", "name": y if name is None else str(name),
                     "line": {"color": color},
                     "hovertemplate": f"{x} %{{x}}<br>{y} %{{y:{VALUE}}}"
                                      f"<extra>{'' if name is None else name}</extra>"})
    steps = [v for v in df[x] if not isinstance(v, str)]
    whole = bool(steps) and all(float(v).is_integer() for v in steps if v == v) and \
        len(set(steps)) <= 40 and not log_x  # blocks, steps: one tick each
    layout = {"xaxis": {"title": {"text": x}, **({"type": "log"} if log_x else {}),
                        **({"dtick": 1} if whole else {})},
              "yaxis": {"title": {"text": y}}}
    if baseline is not None:
        layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": baseline,
                             "y1": baseline, "line": {"color": "grey", "dash": "dot"}}]
    return _figure(data, title, **layout)


def _color(k: int) -> str:
    palette = ["rgb(31,119,180)", "rgb(255,127,14)", "rgb(44,160,44)", "rgb(214,39,40)",
               "rgb(148,103,189)", "rgb(140,86,75)", "rgb(227,119,194)", "rgb(127,127,127)"]
    return palette[k % len(palette)]


def _positions(df: pd.DataFrame) -> dict:
    """position -> "3 ␣France", as the tables name positions."""
    from blockscope.inputs.text import visible

    if "token" not in df:
        return {}
    rows = df.dropna(subset=["position"]).drop_duplicates("position")
    return {p: f"{int(p)} {visible(str(t))}" for p, t in zip(rows["position"], rows["token"],
                                                             strict=True)}


def _cells(df: pd.DataFrame, value: str, what: str) -> list:
    """patch's and attribute's grid: a heatmap per site, (layer x position) or (layer x
    head)."""
    from blockscope.experiments.patch import HEADS

    out = []
    for site, part in df.groupby("site", sort=False):
        if site in HEADS:
            out.append(heatmap(part, value, f"{site}: {what}", cols="head"))
        else:
            out.append(heatmap(part, value, f"{site}: {what}", col_labels=_positions(part)))
    return out


def _patch(r) -> list:
    return _cells(r.table, "normalized", "restored share (0 corrupted, 1 clean)")


def _attribute(r) -> list:
    df = r.table
    if "writer" in df:  # edges: the checked ones, estimate against exact
        return [_scatter(df[df["checked"].fillna("") != ""], "normalized", "exact_normalized",
                         "checked edges: estimate against exact patching")]
    return _cells(df, "normalized", f"{r.meta.get('method', '')} estimate, restored share")


def _scatter(df: pd.DataFrame, x: str, y: str, title: str):
    label = (df["writer"] + " -> " + df["reader"]) if "writer" in df else df.index.astype(str)
    return _figure([{"type": "scatter", "x": _floats(df[x]), "y": _floats(df[y]),
                     "mode": "markers", "text": list(label),
                     "hovertemplate": f"%{{text}}<br>{x} %{{x:{VALUE}}}<br>{y} "
                                      f"%{{y:{VALUE}}}<extra></extra>"}], title,
                   xaxis={"title": {"text": x}}, yaxis={"title": {"text": y}})


def _trace(r) -> list:
    df = r.table
    if "category" in df:  # over facts: a line per category, with its interval
        value = "indirect_effect"
        return [lines(part, "layer", value, f"{kind}: average indirect effect",
                      group="category") for kind, part in df.groupby("kind", sort=False)]
    return [heatmap(part, "indirect_effect", f"{kind}: indirect effect",
                    col_labels=_positions(part))
            for kind, part in df.groupby("kind", sort=False)]


def _knockout(r) -> list:
    df = r.table
    if "from" not in df or "layer_start" not in df:
        return []
    return [heatmap(df, "relative_change", "relative change of P(target) with the edges "
                    "cut", rows="from", cols="layer_start", row_order=list(
                        dict.fromkeys(df["from"])))]


def _logit_lens(r) -> list:
    df = r.table
    if "target_prob" not in df:
        return []
    df = df.assign(point=[p if (isinstance(layer, float) and math.isnan(layer))
                          else f"{p} {int(layer)}" for p, layer in
                          zip(df["point"], df["layer"], strict=True)])
    return [heatmap(df, "target_prob", "P(target) read by the lens", rows="point",
                    col_labels=_positions(df), zmid=None,
                    row_order=list(dict.fromkeys(df["point"])))]


def _head_roles(r) -> list:
    df = r.table
    roles = [c for c in ("previous_token", "duplicate_token", "induction") if c in df]
    return [heatmap(df, role, f"{role.replace('_', ' ')} score", cols="head", zmid=None)
            for role in roles]


def _prune_heads(r) -> list:
    out = []
    df = r.table
    if {"layer", "head", "delta"} <= set(df):
        by = "method" if "method" in df else None
        for method, part in ([(None, df)] if by is None else df.groupby(by, sort=False)):
            said = "" if method is None else f" ({method})"
            out.append(heatmap(part, "delta", f"perplexity change with the head removed"
                               f"{said}", cols="head"))
    curve = r.tables.get("curve")
    if curve is not None:
        out.append(lines(curve, "share_removed", "perplexity", "perplexity as heads go",
                         group="order"))
    return out


def _ablate(r) -> list:
    df = r.table
    if "layer" not in df or "perplexity" not in df:
        return []
    rest = df[df["variant"] != "baseline"] if "variant" in df else df
    base = df.loc[df["variant"] == "baseline", "perplexity"] if "variant" in df else []
    group = "part" if "part" in rest and rest["part"].nunique() > 1 else None
    return [lines(rest, "layer", "perplexity", "perplexity with each block's part skipped",
                  group=group, baseline=float(base.iloc[0]) if len(base) else None)]


def _resid_norm(r) -> list:
    df = r.table.copy()
    df["after"] = [str(a) for a in df["after"]]
    if "norm" in df and "token" in df:  # one prompt: a line per position
        return [lines(df, "after", "norm", "the residual stream's length", group="token")]
    if "median" in df:  # a corpus: the median and its 10-90% band
        return [lines(df, "after", "median", "the residual stream's length (median over "
                      "tokens)", low="p10", high="p90")]
    return []


def _prune_blocks(r) -> list:
    df = r.table
    return [lines(df, "n_removed", "perplexity", "perplexity as blocks go", group="order")]


def _circuit(r) -> list:
    return [lines(r.table, "n_edges", "faithfulness", "faithfulness of the top edges",
                  log_x=True)]


ATTENTION = "attention"  # the chart whose head the page's picker switches


def _attention(r) -> list:
    """The first head's pattern; the page's head picker (`attention_data`) switches it."""
    from blockscope.inputs.text import visible

    df = r.table
    first = df[(df["layer"] == df["layer"].iloc[0]) & (df["head"] == df["head"].iloc[0])]
    fig = heatmap(first, "weight", "", rows="query_pos", cols="key_pos", zmid=None)
    keys = [f"{p} {visible(str(t))}" for p, t in
            first.drop_duplicates("key_pos")[["key_pos", "key_token"]].itertuples(index=False)]
    queries = [f"{p} {visible(str(t))}" for p, t in
               first.drop_duplicates("query_pos")[["query_pos", "query_token"]]
               .itertuples(index=False)]
    trace = fig["data"][0]
    trace.update(x=keys, y=queries,
                 hovertemplate="query %{y}<br>key %{x}<br>weight %{z:" + VALUE +
                 "}<extra></extra>")
    fig["layout"].update(title={"text": f"layer {first['layer'].iloc[0]}, head "
                                f"{first['head'].iloc[0]}: where each query attends"},
                         meta=ATTENTION)
    fig["layout"]["xaxis"]["title"] = {"text": "key"}
    fig["layout"]["yaxis"]["title"] = {"text": "query"}
    return [fig]


def attention_data(df: pd.DataFrame) -> dict:
    """Every head's pattern, for the page's picker: {"L.H": [[weight of key k for query
    q]]}, NaN (above the diagonal) as null."""
    out = {}
    for (layer, head), part in df.groupby(["layer", "head"], sort=True):
        z = part.pivot_table(index="query_pos", columns="key_pos", values="weight",
                             aggfunc="first", dropna=False).to_numpy(dtype=float)
        out[f"{layer}.{head}"] = [[None if math.isnan(v) else float(v) for v in row]
                                  for row in z]
    return out


BY_COMMAND = {"patch": _patch, "attribute": _attribute, "trace": _trace,
              "knockout": _knockout, "logit-lens": _logit_lens, "head-roles": _head_roles,
              "prune-heads": _prune_heads, "ablate": _ablate, "resid-norm": _resid_norm,
              "prune-blocks": _prune_blocks, "circuit": _circuit, "attention": _attention}


def charts(result) -> list:
    """The interactive figures of `result`'s page (none for a command with no chart)."""
    make = BY_COMMAND.get(result.command)
    return [] if make is None else make(result)


__all__ = ["BY_COMMAND", "VALUE", "attention_data", "charts", "heatmap", "lines"]
