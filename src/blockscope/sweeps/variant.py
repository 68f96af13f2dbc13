"""What a sweep scores: a variant is a value, a label (its row's columns) and the edits
that make it, each an intervention with one `apply(base, source)`; and the progress
callback every sweep takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from blockscope.interventions import Intervention
from blockscope.interventions.value import Value

Progress = Callable[..., None]  # cb() advances one step; cb(total=n) sets the total


@dataclass(frozen=True, eq=False)
class Variant(Value):
    """One variant to score, a value: its label and its edits."""

    label: dict  # columns this variant contributes to its row (e.g. {"layer": 3})
    edits: tuple[Intervention, ...] = field(default_factory=tuple)  # what it changes
