"""What a sweep scores: a variant is a value, a label (its row's columns), the edits that
make it (each an intervention with one `apply(base, source)` at a site) and optionally a
block order; and the progress callback every sweep takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from blockscope.interventions import Edit, Hook, Rearrange, hooks
from blockscope.interventions.value import Value

Progress = Callable[..., None]  # cb() advances one step; cb(total=n) sets the total


@dataclass(frozen=True, eq=False)
class Variant(Value):
    """One variant to score, a value: its label, its edits and its block order (None: the
    model's own)."""

    label: dict  # columns this variant contributes to its row (e.g. {"layer": 3})
    edits: tuple[Edit, ...] = field(default_factory=tuple)  # what it changes
    order: Rearrange | None = None  # blocks run in another arrangement

    def hooks(self, samples: int | None = None, sources: dict | None = None) -> list[Hook]:
        """The hooks that run this variant on the model (the naive loop's): its edits', then
        its block order's."""
        return hooks(self.edits, samples, sources) + (self.order.hooks() if self.order else [])
