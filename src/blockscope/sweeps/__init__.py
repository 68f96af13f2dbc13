"""Sweeps of variants, run as one `RunSettings` says: `prepare` the clean passes once,
`run` or `scores` the variants (the naive loop, or the cached engine from where each
departs, self-checked), and the head mask's `gradient`. The engine's parts (clean, engine,
loop, steps, replay, replay_rotary, selfcheck, unembed, streams) are private to this package."""

from blockscope.sweeps.scoring import Prepared, prepare, run, scores
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.units import Scores
from blockscope.sweeps.variant import Variant

__all__ = ["Prepared", "RunSettings", "Scores", "Variant", "prepare", "run", "scores"]
