"""Outputs: CSV + JSON sidecar written atomically under the results directory."""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from blockscope.errors import BadValue, BlockscopeError
from blockscope.versions import versions


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an --out-dir that cannot be written, without creating anything yet."""
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise BadValue(f"`out_dir` {path}: exists and is not a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise BadValue(f"`out_dir` {path}: not writable")
    try:  # access() says yes to root everywhere (/proc too): create a file to be sure
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise BadValue(f"`out_dir` {path}: not writable ({exc.strerror or exc})")
    return path


def sidecar(**settings) -> dict:
    """The JSON sidecar: every setting given, plus versions and the date."""
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return {**settings, "versions": versions(), "date": now}


def write_outputs(out_dir: Path, files: dict) -> list[Path]:
    """Write `{filename: DataFrame (CSV), dict (JSON), str (text) or Figure (PNG)}` into
    `out_dir`: all to temp files, then rename.

    No file is ever half-written; the CSVs are renamed last, so a CSV implies its sidecar.
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadValue(f"`out_dir` {out_dir}: cannot create it ({exc.strerror})")
    _sweep_stale(out_dir)
    mode = 0o666 & ~_umask()  # what open() would give: mkstemp makes 0600 files
    staged: list[tuple[str, Path]] = []
    try:
        for name, content in files.items():
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
            staged.append((tmp, out_dir / name))
            os.chmod(tmp, mode)
            if hasattr(content, "savefig"):  # a matplotlib Figure
                with os.fdopen(fd, "wb") as fh:
                    content.savefig(fh, format="png")
                continue
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                if isinstance(content, pd.DataFrame):
                    content.to_csv(fh, index=False)
                elif isinstance(content, str):
                    fh.write(content)
                else:  # standard JSON only: NaN and infinities become null
                    json.dump(_finite(content), fh, indent=2, default=str, allow_nan=False)
                    fh.write("\n")
        for tmp, final in sorted(staged, key=lambda s: s[1].suffix == ".csv"):
            os.replace(tmp, final)
    except OSError as exc:
        raise BlockscopeError(f"cannot write results in {out_dir}: {exc.strerror or exc}")
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return [final for _, final in staged]


def _finite(value):
    """`value` with every float NaN or infinity (also numpy's) replaced by None, so the
    sidecar is standard JSON that any parser reads."""
    import math

    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalar
        return _finite(value.item())
    return value


STALE_S = 600  # a staged file this old was left by a write that was killed


def _sweep_stale(out_dir: Path) -> None:
    """Remove staged files of our own pattern (.<name>.<8 random>.tmp) that a killed write
    left behind; recent ones may belong to a run writing now, and stay."""
    import re
    import time

    ours = re.compile(r"\..+\.(csv|json|png|md)\.[a-z0-9_]{8}\.tmp")
    for p in out_dir.glob(".*.tmp"):
        try:
            if ours.fullmatch(p.name) and time.time() - p.stat().st_mtime > STALE_S:
                p.unlink()
        except OSError:
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
