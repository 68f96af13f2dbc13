"""The one resume loop: variants' rows carried through the stack from where each enters.

Every cached sweep runs its variants through this loop: the removal sweeps
(`engine.run_group`: whole positions, entering before a block or after its attention half,
sitting later blocks out) and the interchange sweeps (`resume.Resume`: the positions from
the first one changed, edits written as the stream goes by). What differs between them is
how one block runs (`step`) and which rows enter where (`entering`); the loop itself is
this one:

    for j in first..n:  rows entering before block j join the batch
                        rows skipping block j sit it out (their output: the Skip's)
                        block j runs (rows entering after its attention half join there)
                        the rows that sat it out rejoin; `watch` sees the batch
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# entering(j, mid, keys) -> (new keys, rows (k, Tq, d_model)) or None: the rows that enter
#   before block j (mid False; j == n: straight to the unembedding) or after its attention
#   half (mid True); `keys` are the batch's rows so far, in row order.
Entering = Callable[[int, bool, list], "tuple[list, torch.Tensor] | None"]
# step(j, x, keys, mid) -> block j's output for x (B, Tq, d_model) (None: no rows yet), whose
#   rows are `keys`; the rows `mid()` returns join after its attention half (at the end).
Step = Callable[[int, "torch.Tensor | None", list, Callable], "torch.Tensor | None"]


def resume(n: int, first: int, entering: Entering, step: Step, *,
           skipping: Callable | None = None, watch: Callable | None = None):
    """Carry rows from block `first` to the end of an n-block stack: (the final residual
    (B, Tq, d_model), the key of each of its rows, in row order).

    skipping(key, j) -> the Skip a row sits block j out with, or None.
    watch(j, x, keys): called with every block's output (what block j+1 receives)."""
    keys: list = []

    def join(x, j: int, mid: bool):
        got = entering(j, mid, keys)
        if got is None:
            return x
        new_keys, new = got
        keys.extend(new_keys)
        return new if x is None else torch.cat([x, new])  # (B, Tq, d_model)

    x = None
    for j in range(first, n):
        x = join(x, j, False)
        x, held = _hold(x, keys, skipping, j)
        x = step(j, x, keys, lambda j=j: join(None, j, True))
        x = _rejoin(x, keys, held)
        if watch is not None and x is not None:
            watch(j, x, keys)
    return join(x, n, False), keys


def _hold(x, keys: list, skipping, j: int):
    """Take out of the batch x the rows that sit block j out: (the rest, the held rows as
    [(key, its output: the Skip's apply to what it received)]). `keys` follows."""
    if x is None or skipping is None:
        return x, []
    skip = [skipping(k, j) for k in keys]
    if not any(s is not None for s in skip):
        return x, []
    held = [(k, s.apply(x[r : r + 1], x[r : r + 1]))
            for r, (k, s) in enumerate(zip(keys, skip, strict=True)) if s is not None]
    rest = [r for r, s in enumerate(skip) if s is None]
    keys[:] = [keys[r] for r in rest]
    return (x[rest] if rest else None), held


def _rejoin(x, keys: list, held: list):
    """The batch after block j with the rows that sat it out put back (at the end)."""
    if not held:
        return x
    keys.extend(k for k, _ in held)
    return torch.cat(([] if x is None else [x]) + [h for _, h in held])
