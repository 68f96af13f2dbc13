"""Rich rendering: DataFrames to tables, and a progress bar for sweeps."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


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
        t.add_column(header, justify="left" if spec == "s" else "right")
    styles = styles or {}
    for i, row in enumerate(df.itertuples(index=False)):
        rec = row._asdict()
        t.add_row(*(fmt(rec[c], spec) for c, (_, spec) in columns.items()), style=styles.get(i))
    return t


@contextmanager
def progress_bar(
    console: Console, total: int, description: str, enabled: bool = True
) -> Iterator[Callable[[], None]]:
    """Yield a callback that advances a Rich progress bar by one step."""
    if not enabled:
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)
