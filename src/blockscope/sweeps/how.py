"""How a sweep ran, one record for every sweep (removal, decompose, interchange, the head-mask
gradient): which engine computed the numbers, how, and why it fell back if it did. The
sidecar's engine fields and each table's `attrs` are its `record()`. And the one
orchestrator (`Engine.run`): the cached path with its self-check, else the naive loop,
saying why; or the naive loop alone, where it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

T = TypeVar("T")

NAIVE_LOOP = "every variant was run by the naive loop"


@dataclass
class How:
    """How one sweep ran."""

    engine: str = "cached"  # what computed the numbers: "cached", or "naive" (asked for, or
    #   fallen back to)
    replay: str | None = None  # the removal engine's blocks: "plain", "bridge",
    #   "plain+bridge", or "naive"
    batch_size: int | None = None  # variants per batch
    block_positions: int | None = None  # block-positions the cached engine computed
    naive_block_positions: int | None = None  # ... and the naive loop would have
    fallback: str | None = None  # why the cached engine's self-check failed (`fell_back`)
    why_naive: str | None = None  # why the cached engine was not tried

    def record(self) -> dict:
        """The fields that are set, as the sidecar and `attrs` hold them."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def fell_back(why: str, instead: str = NAIVE_LOOP) -> str:
    """The one fallback message: the self-check that failed, and what ran instead."""
    return f"the cached engine's self-check failed: {why}; {instead}"


def not_tried(why: str, instead: str = NAIVE_LOOP) -> str:
    """Why the cached engine was not tried, and what ran instead."""
    return f"the cached engine cannot run {why}; {instead}"


class Fallback(Exception):
    """The cached path cannot give these numbers; `how` says why (its `fallback` or
    `why_naive`)."""

    def __init__(self, how: How):
        super().__init__(how.fallback or how.why_naive)
        self.how = how


@dataclass(frozen=True)
class Engine:
    """The one orchestrator of every sweep (removal, decompose, interchange, the head-mask
    gradient's windows): `name` the engine asked for, "cached" or "naive"; `naive_how` how
    the naive loop runs, as its record says."""

    name: str = "cached"
    naive_how: How = field(default_factory=lambda: How("naive"))

    def __post_init__(self):
        if self.name not in ("cached", "naive"):
            raise ValueError(f"the engine is 'cached' or 'naive', not {self.name!r}")

    def run(self, cached: Callable[[], tuple[T, dict]], naive: Callable[[How], T]
            ) -> tuple[T, dict]:
        """A sweep's numbers and how they ran (`How.record()`): `cached()` (the cached path,
        its self-check inside: it raises `Fallback`, or the replay's `steps.ReplayMismatch`,
        where the check fails or it cannot run), else `naive(how)`, `how` saying why (its
        `fallback`, or `why_naive`); with the naive engine asked for, `naive(naive_how)`
        alone."""
        from blockscope.sweeps.steps import ReplayMismatch

        if self.name == "naive":
            return naive(self.naive_how), self.naive_how.record()
        try:
            return cached()
        except ReplayMismatch as exc:
            how = replace(self.naive_how, fallback=fell_back(str(exc)))
        except Fallback as exc:
            how = replace(self.naive_how, fallback=exc.how.fallback,
                          why_naive=exc.how.why_naive)
        return naive(how), how.record()
