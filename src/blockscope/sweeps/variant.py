"""What a sweep scores: a variant is a value, a label (its row's columns) and the edits
that make it, each an intervention with one `apply(base, source)`; and the progress
callback every sweep takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from blockscope.interventions import Intervention

Progress = Callable[..., None]  # cb() advances one step; cb(total=n) sets the total


@dataclass
class Variant:
    """One intervention to score."""

    label: dict  # columns this variant contributes to its row (e.g. {"layer": 3})
    edits: tuple[Intervention, ...] = field(default_factory=tuple)  # what it changes
