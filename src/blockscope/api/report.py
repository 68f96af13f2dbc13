"""`blockscope report`: the index of a results folder, a page linking every run's page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, out
from blockscope.api.options import Options
from blockscope.errors import BadValue


@dataclass
class ReportOptions(Options):
    name: ClassVar[str] = "report"
    folder: Annotated[Path, typer.Argument(
        metavar="DIR", help="The results folder (every run under it, subfolders included).")
    ] = Path("results")

    def check(self) -> None:
        if not self.folder.expanduser().is_dir():
            raise BadValue(f"DIR {self.folder}: no such folder")


@command
def report(o: ReportOptions) -> None:
    """Index a results folder: write DIR/index.html, one row per run (command, model, date,
    headline) with a link to its page, filters by command and model; print the runs.

    Example: blockscope report results/ && open results/index.html
    """
    from blockscope.results.files import write_outputs
    from blockscope.results.index import NAME, index, runs
    from blockscope.results.render import table

    folder = o.folder.expanduser()
    df = runs(folder)
    if df.empty:
        raise BadValue(f"DIR {o.folder}: no run's sidecar in it (the JSON beside each CSV)")
    path = write_outputs(folder, {NAME: index(df, f"blockscope runs in {folder.resolve()}")})[0]
    out.print(table(df.head(20), {"command": ("command", "s"), "model": ("model", "s"),
                                 "date": ("date", "s"), "headline": ("headline", "s")},
                    title=f"{len(df)} runs in {o.folder}",
                    caption="the 20 newest" if len(df) > 20 else None))
    out.print(f"wrote {path}", highlight=False, soft_wrap=True)
