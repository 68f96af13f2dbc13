"""Finished units of a long run, kept as they finish, so that an interrupted run resumes.

A command whose work comes in units (the facts of `trace --facts` and `knockout --facts`,
the documents of every sweep over a corpus, each sweep of a prune curve) keeps each unit's
result in its own file under `<out-dir>/.partial/<command>-<digest>/`, written to a temp
name and renamed, as the unit finishes. The same command with the same settings has the
same digest, finds them and computes only the rest; a kept unit is the very value the
interrupted run computed (pickled), so the final files are the same as an uninterrupted
run's. Different settings have another digest and never mix. `--fresh` starts over; the
folder goes once the final files are written.

Units are named by the order of the passes that make them (`scope`: the first sweep over
the corpus, the second, ...), which the settings fix, and by their place in the corpus,
not by the process: under torchrun each rank keeps its own units in the same folder, and
a rerun with another number of processes still finds them.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

FOLDER = ".partial"  # under --out-dir
FORMAT = 1  # in every unit file: a unit of another layout is computed again, not misread


@dataclass
class Partial:
    """The kept units of one run (command and settings): `scope` names each pass over
    units; `computed` and `reused` count this process's units."""

    folder: Path  # <out-dir>/.partial/<command>-<digest>
    computed: int = 0  # units computed by this run
    reused: int = 0  # units found kept by an earlier run
    passes: int = 0  # scopes opened so far
    current: Scope | None = field(default=None, repr=False)  # the pass under way

    def scope(self, noun: str, total: int) -> Scope:
        """The next pass over `total` units (`noun`: "facts", "documents"), in the order the
        run makes them."""
        self.passes += 1
        self.current = Scope(self, self.passes, noun, total)
        return self.current

    def start_over(self) -> None:
        """Drop every kept unit (`--fresh`)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def discard(self) -> None:
        """The final files are written: the kept units are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()  # .partial, when no other run keeps units there
        except OSError:
            pass

    def record(self) -> dict:
        """What the sidecar says of it (this process's units)."""
        return {"computed": self.computed, "reused": self.reused,
                "rule": "units (facts, documents) that an interrupted run of these settings "
                "finished were read back from --out-dir/.partial, not computed again"}

    def interrupted(self) -> str:
        """The line said on Ctrl-C."""
        again = "run the same command again to continue"
        c = self.current
        if c is None:
            return f"interrupted: nothing was kept; {again}" if self.computed + self.reused \
                else "interrupted: nothing was written"
        where = f" of pass {c.number} (the {c.number - 1} before it kept whole)" \
            if c.number > 1 else ""
        return f"interrupted: {c.kept} of {c.total} {c.noun}{where} kept; {again}"


@dataclass
class Scope:
    """One pass over units: `unit(index, compute)` reads unit `index` back when an earlier
    run kept it (then calls `reused()`, for what computing it would also have done), else
    computes and keeps it."""

    partial: Partial
    number: int
    noun: str
    total: int
    kept: int = 0  # units of this pass done, read back or computed

    def unit(self, index: int, compute: Callable[[], T],
             reused: Callable[[], None] | None = None) -> T:
        path = self.partial.folder / f"{self.number:04d}-{index:08d}.pkl"
        value = _read(path)
        if value is None:
            value = (compute(),)
            _write(path, value)
            self.partial.computed += 1
        else:
            self.partial.reused += 1
            if reused is not None:
                reused()
        self.kept += 1
        return value[0]


def _read(path: Path) -> tuple | None:
    """The kept value as `(value,)`, or None where there is none (or one of another format,
    or cut short: a unit file is renamed whole, so that is only another version's)."""
    try:
        with open(path, "rb") as f:
            fmt, value = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError,
            ImportError):  # none, cut short, or written by another version of the code
        return None
    return value if fmt == FORMAT else None


def _write(path: Path, value: tuple) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump((FORMAT, value), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def for_run(out_dir: Path, command: str, digest: str, fresh: bool) -> Partial:
    """The kept units of `command` with settings `digest` under `out_dir` (started over
    with `fresh`). Nothing is created until a unit finishes."""
    partial = Partial(Path(out_dir).expanduser() / FOLDER / f"{command}-{digest}")
    if fresh:
        partial.start_over()
    return partial
