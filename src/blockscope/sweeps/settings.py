"""How a sweep runs, as one value: built once by the command line (or a notebook), checked
when it is made, and passed down unchanged by every experiment.

These choose how the numbers are computed and drawn, never which variants are measured:
the engine gives the same numbers either way, and the stride, intervals and seed are
recorded in every sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from blockscope.choices import EngineName, one_of
from blockscope.errors import BadValue
from blockscope.inputs.partial import Partial
from blockscope.sweeps.stats import Bootstrap
from blockscope.sweeps.variant import Progress


@dataclass(frozen=True)
class RunSettings:
    """How every sweep of one experiment runs."""

    stride: int | None = None  # sliding-window stride for text longer than the context
    #   (None: half the context)
    engine: EngineName = EngineName.cached  # cached: each variant from where it departs from the
    #   base run, batched; naive: one hooked forward per variant (the reference)
    batch_size: int | None = None  # variants per batch of the cached engine (None: by memory)
    ci: Bootstrap | None = None  # bootstrap intervals over documents or chunks (None: none)
    seed: int = 0  # every random draw: resample partners, a random order, a trace's noise
    progress: Progress | None = field(default=None, compare=False)  # cb() per step done
    kept: Partial | None = field(default=None, compare=False)  # where an interrupted run's
    #   finished units are kept and read back (`inputs.partial`; None: nothing kept)

    def __post_init__(self):
        object.__setattr__(self, "engine", one_of(EngineName, self.engine, "engine"))
        for name in ("stride", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadValue(f"`{name}` must be at least 1")

    def quiet(self) -> RunSettings:
        """The same settings without the progress callback (for a sweep inside another)."""
        return replace(self, progress=None)

    def reporting(self, progress: Progress | None) -> RunSettings:
        """The same settings reporting to `progress`."""
        return replace(self, progress=progress)
