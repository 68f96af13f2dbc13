"""Rich rendering: DataFrames to tables, and a progress bar for sweeps."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pandas as pd
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text


def fmt(value, spec: str = ",.2f") -> str:
    """Format a number with `spec` ("s" for as-is); missing values as "-"."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return "-"
    if spec != "s" and isinstance(value, numbers.Number) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def table(
    df: pd.DataFrame,
    columns: dict[str, tuple[str, str]],
    *,
    title: str | None = None,
    styles: dict[int, str] | None = None,
    caption: str | None = None,
) -> Table:
    """A Rich table of `df[columns]`; `columns` maps column -> (header, format spec)."""
    t = Table(title=title, caption=caption)
    for header, spec in columns.values():
        t.add_column(header, justify="left" if spec == "s" else "right", overflow="fold")
    styles = styles or {}
    for i, row in enumerate(df.itertuples(index=False)):
        rec = row._asdict()
        t.add_row(*(fmt(rec[c], spec) for c, (_, spec) in columns.items()), style=styles.get(i))
    return t


@contextmanager
def progress_bar(
    console: Console, total: int, description: str, enabled: bool = True
) -> Iterator[Callable[[], None]]:
    """Yield a callback: `cb()` advances the bar by one step, `cb(total=n)` resets its total.
    With an ETA; where stderr is not a terminal (piped, logged), one plain line per tenth."""
    if not enabled:
        yield lambda total=None: None
        return
    if not console.is_terminal:
        yield _plain_progress(console, total, description)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)

        def step(total: int | None = None) -> None:
            if total is None:
                progress.advance(task)
            else:
                progress.update(task, total=total)

        yield step


def _plain_progress(console: Console, total: int, description: str) -> Callable:
    """Progress as plain lines (`description: 5/13, 12 s, about 19 s left`) each tenth."""
    import time

    state = {"done": 0, "total": max(1, total), "start": time.perf_counter(), "shown": 0}

    def step(total: int | None = None) -> None:
        if total is not None:
            state["total"] = max(1, total)
            return
        state["done"] += 1
        tenth = 10 * state["done"] // state["total"]
        if tenth > state["shown"]:
            state["shown"] = tenth
            spent = time.perf_counter() - state["start"]
            left = spent / state["done"] * (state["total"] - state["done"])
            console.print(f"{description}: {state['done']}/{state['total']}, {spent:.0f} s, "
                          f"about {left:.0f} s left", highlight=False, soft_wrap=True)

    return step


def heat_grid(values, *, title: str, row_label: str = "layer", spec: str = "+.1%") -> Table:
    """A layers x heads grid: each cell formatted with `spec` and shaded by its size."""
    import torch

    v = torch.as_tensor(values, dtype=torch.float64)  # (n_rows, n_cols), NaN = not measured
    finite = v[torch.isfinite(v)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    t = Table(title=title, caption="darker red: removing the head hurts more; blue: it helps")
    t.add_column(row_label, justify="right", overflow="fold")
    for col in range(v.shape[1]):
        t.add_column(str(col), justify="right", overflow="fold")
    for row in range(v.shape[0]):
        cells = []
        for x in v[row].tolist():
            if x != x:
                cells.append("-")
                continue
            level = 0 if top == 0 else min(4, int(5 * abs(x) / top))
            colour = ("grey50", "yellow", "orange1", "red", "bold red")[level] if x >= 0 else (
                "blue")
            cells.append(Text(format(x, spec), style=colour))
        t.add_row(str(row), *cells)
    return t
