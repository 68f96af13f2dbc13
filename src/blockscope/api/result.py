"""What a command gives back: its tables, its sidecar, its pictures and what the command
line shows of them, and how to save them as the command line does (`Result`)."""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

MAIN = "main"  # the main table's name in `Result.tables`


def table_name(suffix: str) -> str:
    """A table's name in `Result.tables` from the suffix its CSV's name adds ("" -> main)."""
    return suffix.lstrip("-") or MAIN


@dataclass
class Result:
    """One command's results, as the files the command line writes would hold them.

    Attributes:
        command: The command that measured them, e.g. "ablate".
        stem: The files' common name before the settings digest, e.g.
            "ablate-smollm2-135m-alice".
        digest: 8 hex digits naming the settings (every option but the output ones).
        tables: Each CSV's DataFrame by name: "main" for the main one, else what its file
            name adds after the stem ("per-fact" for `<stem>-per-fact-<digest>.csv`).
        meta: The JSON sidecar: the settings, the model, how the sweep ran, the versions.
        pictures: Each picture's file name (digest not yet added) and a function drawing it.
        shown: What the command line prints of them, in order: (a Rich renderable or a
            string, the console's print options) pairs; `show()` prints them.
    """

    command: str
    stem: str
    digest: str
    tables: dict[str, pd.DataFrame]
    meta: dict
    pictures: dict[str, Callable] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # other files (name: content)
    shown: list[tuple] = field(default_factory=list, repr=False)
    html: bool = True  # whether `files` and `save` include the page (`--no-html`: not)
    _drawn: dict = field(default_factory=dict, repr=False)

    @property
    def table(self) -> pd.DataFrame:
        """The main table: what the main CSV holds."""
        return self.tables.get(MAIN, next(iter(self.tables.values())))

    def csv_name(self, table: str) -> str:
        """The CSV file `tables[table]` is saved as (digest included)."""
        return digested(f"{self.stem}{'' if table == MAIN else '-' + table}.csv", self.digest)

    def figure(self, name: str | None = None):
        """The picture the command draws (its first, or the one whose file name starts with
        `name`), as a matplotlib Figure, drawn on the first call; None if it draws none."""
        names = [n for n in self.pictures if name is None or n.startswith(name)]
        if not names:
            return None
        if names[0] not in self._drawn:
            self._drawn[names[0]] = self.pictures[names[0]]()
        return self._drawn[names[0]]

    def files(self) -> dict[str, object]:
        """Every file the command line writes for these results, by its name (digest
        included): DataFrames (CSV), the sidecar (JSON), Figures (PNG) and texts."""
        files: dict[str, object] = {self.csv_name(name): df for name, df in self.tables.items()}
        files[digested(f"{self.stem}.json", self.digest)] = {
            **self.meta, "settings_digest": self.digest,
            **({"summary": self.headline} if self.headline else {})}  # for `report`'s index
        for name in self.pictures:
            files[digested(name, self.digest)] = self.figure(name)
        files.update({digested(n, self.digest): text for n, text in self.texts.items()})
        if self.html:  # the page, linking every other file
            from blockscope.results.page import page

            links = {_label(self.stem, self.digest, name): name for name in files}
            files[digested(f"{self.stem}.html", self.digest)] = page(self, links)
        return files

    def save(self, out_dir: str | Path = "results") -> list[Path]:
        """Write the files the command line writes, with the same names and digest, into
        `out_dir` (made if missing), each written whole or not at all. Returns their
        paths."""
        from blockscope.results.files import write_outputs

        out = Path(out_dir).expanduser()
        paths = write_outputs(out, self.files())
        if self.html:  # the pages' shared script, written once into the folder
            from blockscope.results.page import ensure_script

            paths += ensure_script(out)
        return paths

    def show(self, console=None) -> None:
        """Print what the command line prints of these results (its tables and lines) on
        `console` (a Rich Console; default: a new one on stdout)."""
        if console is None:
            from rich.console import Console

            console = Console()
        for thing, options in self.shown:
            console.print(thing, **options)

    @property
    def headline(self) -> str:
        """The one line that says what the run found: the sidecar's `headline` where it is
        a line, else the first thing the command prints, a line or a table's title (the
        notes printed under a table are not it)."""
        said = self.meta.get("headline")
        if isinstance(said, str):
            return said
        for thing, _ in self.shown:
            text = thing if isinstance(thing, str) else getattr(thing, "title", None)
            if text:
                return str(text)
        return ""

    def _repr_html_(self) -> str:
        """In a notebook: the headline, the page's interactive charts and the table."""
        from blockscope.results.page import notebook

        head = f"<b>blockscope {html.escape(self.command)}</b>: {html.escape(self.stem)}"
        line = f"<p>{html.escape(self.headline)}</p>" if self.headline else ""
        return (f"<div><p>{head}</p>{line}{notebook(self)}"
                f"{self.table.to_html(max_rows=40)}</div>")

    def __repr__(self) -> str:
        shape = "x".join(str(n) for n in self.table.shape)
        return (f"Result(command={self.command!r}, stem={self.stem!r}, table={shape}, "
                f"pictures={list(self.pictures)})")


def _label(stem: str, digest: str, name: str) -> str:
    """A file's link text on the page: its kind, and what its name adds to the stem ("CSV",
    "CSV per-fact", "PNG", "JSON")."""
    base, _, ext = name.rpartition(".")
    base = base.removesuffix(f"-{digest}")
    extra = base[len(stem):].strip("-") if base.startswith(stem) else base
    return ext.upper() + (f" {extra}" if extra else "")


def digested(name: str, digest: str) -> str:
    """`name` with the settings digest before its extension: a-b.csv -> a-b-1f2e3d4c.csv."""
    stem, dot, ext = name.rpartition(".")
    return f"{stem}-{digest}.{ext}" if dot else f"{name}-{digest}"
