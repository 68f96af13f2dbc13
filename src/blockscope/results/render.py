"""Rich rendering: DataFrames to tables (the progress bars are in `results.progress`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import pandas as pd
from rich.table import Table
from rich.text import Text


def fmt(value, spec: str = ",.2f") -> str:
    """Format a number with `spec` ("s" for as-is, "sig3" for `sig3`); missing as "-"."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return "-"
    if spec == "sig3":
        return sig3(float(value))
    if spec != "s" and isinstance(value, numbers.Number) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def with_intervals(value: float, lo: float, hi: float, spec: str = "+,.2f") -> str:
    """`+1.20 [0.80, 1.60]`; the value alone where there is no interval."""
    if lo != lo or hi != hi:  # NaN: no interval
        return format(value, spec)
    bound = spec.lstrip("+")
    return f"{value:{spec}} [{lo:{bound}}, {hi:{bound}}]"


def sig3(x: float) -> str:
    """Three significant figures, trailing zeros kept so a column reads alike (24.0 beside
    32.4, not 24), plain below 1,000 and with thousands commas above: never 1.2e+03."""
    if x != x:
        return "-"
    if abs(float(format(x, ".3g"))) >= 1000:
        return f"{x:,.0f}"
    return format(x, "#.3g").rstrip(".")


def table(
    df: pd.DataFrame,
    columns: dict[str, tuple[str, str]],
    *,
    title: str | None = None,
    styles: dict[int, str] | None = None,
    caption: str | None = None,
    width: int | None = None,
) -> Fitted:
    """A Rich table of `df[columns]`; `columns` maps column -> (header, format spec).

    Laid out when printed, for the console's width (or `width`): no number or word is cut,
    each column being at least as wide as its longest word (cells wrap only at spaces);
    where the columns cannot all fit, the last ones are left out and the caption says
    which. Only a single column narrower than one of its words is folded."""
    cells = {c: [fmt(v, spec) for v in df[c]] for c, (_, spec) in columns.items()}
    return Fitted(lambda w: _laid_out(cells, columns, w, title, styles or {}, caption), width,
                  title)


class Fitted:
    """A renderable built for the width it is printed at (`title`: its table's)."""

    def __init__(self, build: Callable[[int], Table], width: int | None = None,
                 title: str | None = None):
        self.build, self.width, self.title = build, width, title

    def __rich_console__(self, console, options):
        yield self.build(self.width or options.max_width)


def _laid_out(cells: dict, columns: dict, width: int, title, styles, caption) -> Table:
    def need(c: str) -> int:
        words = [w for text in [*cells[c], columns[c][0]] for w in text.split()]
        return max(map(len, words), default=1)

    kept = list(columns)
    while len(kept) > 1 and sum(need(c) + 3 for c in kept) + 1 > width:
        kept.pop()
    left_out = [columns[c][0] for c in columns if c not in kept]
    if left_out:
        caption = ((caption + " ") if caption else "") + (
            f"Left out at {width} columns: {', '.join(left_out)} (in the CSV; a wider "
            "terminal or COLUMNS=120 shows them).")
    longest = {c: max(map(len, [*cells[c], columns[c][0]]), default=1) for c in kept}
    room = width - 3 * len(kept) - 1 - sum(need(c) for c in kept)
    widths = None
    if room >= 0 and sum(longest[c] + 3 for c in kept) + 1 > width:  # fit it here: Rich
        want = {c: longest[c] - need(c) for c in kept}  # alone overshoots by a column or two
        total = sum(want.values()) or 1
        widths = {c: need(c) + want[c] * room // total for c in kept}
    t = Table(title=title, caption=caption)
    for c in kept:
        header, spec = columns[c]
        t.add_column(header, justify="left" if spec == "s" else "right", overflow="fold",
                     min_width=need(c) if room >= 0 else None,
                     width=widths[c] if widths else None)
    n_rows = len(next(iter(cells.values()), []))
    for i in range(n_rows):
        t.add_row(*(cells[c][i] for c in kept), style=styles.get(i))
    return t


def heat_grid(values, *, title: str, row_label: str = "layer", spec: str = "+.1%") -> Fitted:
    """A layers x heads grid: each cell formatted with `spec` and shaded by its size. Laid
    out for the width it is printed at: where every head does not fit on one line, the
    heads are split over several grids (heads 0-5, then 6-11), so no number is folded."""
    import torch

    v = torch.as_tensor(values, dtype=torch.float64)  # (n_rows, n_cols), NaN = not measured
    finite = v[torch.isfinite(v)]
    top = float(finite.abs().max()) if finite.numel() else 0.0

    def cell(x: float) -> Text:
        if x != x:
            return Text("-")
        level = 0 if top == 0 else min(4, int(5 * abs(x) / top))
        colour = ("grey50", "yellow", "orange1", "red", "bold red")[level] if x >= 0 else "blue"
        return Text(format(x, spec), style=colour)

    cells = [[cell(x) for x in row] for row in v.tolist()]
    n_rows, n_cols = v.shape
    wide = max([len(c.plain) for row in cells for c in row] + [len(str(n_cols - 1))])
    label = max(len(row_label), len(str(n_rows - 1)))
    caption = "darker red: removing the head hurts more; blue: it helps"

    def build(width: int):
        from rich.console import Group

        fit = max(1, min(n_cols, (width - label - 4) // (wide + 3)))
        per = -(-n_cols // -(-n_cols // fit))  # as even a split as fits: 6 + 6, not 11 + 1
        grids = []
        for first in range(0, n_cols, per):
            cols = range(first, min(n_cols, first + per))
            split = per < n_cols
            t = Table(title=title + (f" (heads {cols[0]}-{cols[-1]})" if split else ""),
                      caption=caption if first + per >= n_cols else None)
            t.add_column(row_label, justify="right", no_wrap=True)
            for col in cols:
                t.add_column(str(col), justify="right", no_wrap=True, min_width=wide)
            for row in range(n_rows):
                t.add_row(str(row), *(cells[row][col] for col in cols))
            grids.append(t)
        return Group(*grids)

    return Fitted(build)


def claims_table(claims, title: str = "the article's claims, measured here"):
    """The article's claims, what was measured, the test, and whether it shows."""
    shown = claims.assign(shown=claims["shown"].map({True: "yes", False: "NOT shown here"}))
    return table(shown, {c: (c, "s") for c in ("claim", "measured", "test", "shown")},
                 title=title)


def strongest(df, column: str):
    """(the rows of largest |column| of each site, how many of each): so that one kind
    (resid-pre, which carries everything) cannot fill a table, 10 rows in all, shared
    between the sites, each named as the tables name a cell (␣ for a token's space)."""
    import pandas as pd

    from blockscope.experiments.patch import HEADS
    from blockscope.inputs.text import visible

    sites = list(dict.fromkeys(df["site"]))
    each = max(3, 10 // len(sites))
    top = pd.concat([part.reindex(part[column].abs().sort_values(ascending=False).index)
                     .head(each) for _, part in df.groupby("site", sort=False)])
    return top.assign(where=[f"{r.site} L{r.layer} " + (f"head {r.head}" if r.site in HEADS else
                                                         f"@{r.position} {visible(r.token)}")
                             for r in top.itertuples()]), each


def interval(lo: float, hi: float) -> str:
    """A bootstrap interval as the tables show it: [+12%, +40%], or - where undefined."""
    if math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo:+.0%}, {hi:+.0%}]"
