"""How a sweep ran, one record for every sweep (removal, decompose, interchange, the head-mask
gradient): which engine computed the numbers, how, and why it fell back if it did. The
sidecar's engine fields and each table's `attrs` are its `record()`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
