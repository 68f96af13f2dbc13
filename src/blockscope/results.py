"""Outputs: CSV + JSON sidecar written atomically under the results directory."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd

from blockscope.errors import BlockscopeError


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an --out-dir that cannot be written, without creating anything yet."""
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise BlockscopeError(f"--out-dir {path}: exists and is not a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise BlockscopeError(f"--out-dir {path}: not writable")
    return path


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("blockscope", "torch", "transformer-lens", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


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
        raise BlockscopeError(f"--out-dir {out_dir}: cannot create it ({exc.strerror})")
    staged: list[tuple[str, Path]] = []
    try:
        for name, content in files.items():
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
            staged.append((tmp, out_dir / name))
            if hasattr(content, "savefig"):  # a matplotlib Figure
                with os.fdopen(fd, "wb") as fh:
                    content.savefig(fh, format="png")
                continue
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                if isinstance(content, pd.DataFrame):
                    content.to_csv(fh, index=False)
                elif isinstance(content, str):
                    fh.write(content)
                else:
                    json.dump(content, fh, indent=2, default=str)
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
