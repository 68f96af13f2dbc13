"""The article's figures and settings, kept as data (the package's data/article.toml): what
`reproduce` sets its measurements beside. Nothing here is ever shown as measured."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from blockscope.errors import BadValue

UNITS = {"": 1.0, "thousand": 1e3, "million": 1e6, "billion": 1e9}

@dataclass(frozen=True)
class Figure:
    """One number the article prints."""

    experiment: str  # the blockscope command that measures it
    name: str  # what it is
    article: str  # as printed, with thousands commas and the decimals given
    measure: str  # key of the measured value
    unit: str = ""  # "", "thousand", "million" or "billion"
    cut: bool = False  # the article truncates this figure instead of rounding it

    @property
    def value(self) -> float:
        return float(self.article.replace(",", "")) * UNITS[self.unit]

    @property
    def tolerance(self) -> float:
        """Half a unit in the last printed digit (a whole unit when the figure is cut)."""
        digits = self.article.split(".")[1] if "." in self.article else ""
        step = 10.0 ** -len(digits) * UNITS[self.unit]
        return step if self.cut else step / 2

    @property
    def digits(self) -> int:
        """Decimals the article prints."""
        return len(self.article.split(".")[1]) if "." in self.article else 0

    def show(self, x: float | None, sign: bool = False, digits: int | None = None) -> str:
        """`x` in the figure's unit, two digits finer than the article prints it (or than
        `digits`: `compare` gives one experiment's figures in a unit the same decimals)."""
        if x is None:
            return ""
        digits = self.digits if digits is None else digits
        v = x / UNITS[self.unit]
        spec = f"{'+' if sign else ''},.{digits + 2 if v != int(v) else 0}f"
        return format(v, spec) + (f" {self.unit}" if self.unit else "")

    def within(self, measured: float) -> bool:
        if self.cut:  # the printed figure is the measured one with its later digits dropped
            return self.value <= measured < self.value + self.tolerance
        return abs(measured - self.value) <= self.tolerance * (1 + 1e-9)


def packaged_reference() -> Path:
    """The article's settings and figures as shipped in the package (data/article.toml)."""
    from importlib.resources import files

    return Path(str(files("blockscope") / "data" / "article.toml"))


def load_reference(path: str | Path | None = None) -> tuple[dict, list[Figure]]:
    """(settings, figures) from a TOML reference file, by default the packaged
    `packaged_reference()`. A relative text path inside it resolves from the file's own tree
    (data/alice.txt beside data/article.toml's parent) when it is not found as given."""
    p = packaged_reference() if path is None else Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadValue(f"`reference` {p}: no such file")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadValue(f"`reference` {p}: cannot read it ({exc})")
    try:
        figures = [Figure(**f) for f in data.pop("figure", [])]
        for f in figures:
            f.value, f.tolerance  # noqa: B018  (validates the number and the unit)
    except (TypeError, ValueError, KeyError) as exc:
        raise BadValue(f"`reference` {p}: a [[figure]] is malformed ({exc})")
    for section in data.values():
        if isinstance(section, dict) and "text" in section:
            text = Path(section["text"])
            if not text.is_absolute() and not text.exists():
                if (p.resolve().parent.parent / text).exists():
                    section["text"] = str(p.resolve().parent.parent / text)
    return data, figures
