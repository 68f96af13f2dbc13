"""The one resume loop, on a toy stack whose blocks are arithmetic: each row's result is
held to the same stack run for that row alone, by hand."""

from dataclasses import dataclass

import torch

from blockscope.sweeps import loop

N = 4


def attn(j, x):  # the toy block's first half, then its second
    return x + (j + 1)


def mlp(j, x):
    return x * (j + 2)


@dataclass(frozen=True)
class Skip:  # a toy skipped block: the block's output is its input plus 100
    def apply(self, base, source):
        return source + 100


# (key, block it enters, after the attention half?, start value, blocks it sits out)
ROWS = [("a", 0, False, 1.0, ()), ("b", 2, True, 3.0, ()), ("c", 1, False, 5.0, (2,)),
        ("d", 1, True, 7.0, ()), ("e", N, False, 9.0, ()), ("f", 0, False, 2.0, (0, 3))]


def by_hand(first, mid, x, skips):
    for j in range(first, N):
        if j in skips:
            x = x + 100
            continue
        if not (mid and j == first):
            x = attn(j, x)
        x = mlp(j, x)
    return x


def test_rows_enter_where_they_say_sit_blocks_out_and_are_watched():
    def entering(j, mid, keys):
        new = [r for r in ROWS if (r[1], r[2]) == (j, mid)]
        if not new:
            return None
        return [r[0] for r in new], torch.tensor([[[r[3]]] for r in new])  # (k, 1, 1)

    def step(j, x, keys, mid):
        x = None if x is None else attn(j, x)
        m = mid()
        x = m if x is None else x if m is None else torch.cat([x, m])
        return None if x is None else mlp(j, x)

    seen = []
    skips = {r[0]: r[4] for r in ROWS}
    x, keys = loop.resume(N, 0, entering, step,
                          skipping=lambda k, j: Skip() if j in skips[k] else None,
                          watch=lambda j, x, keys: seen.append((j, sorted(keys))))
    got = dict(zip(keys, x.flatten().tolist(), strict=True))
    assert sorted(got) == sorted(r[0] for r in ROWS)
    for key, first, mid, start, sits_out in ROWS:
        assert got[key] == by_hand(first, mid, start, sits_out), key
    assert seen[0] == (0, ["a", "f"]) and seen[-1] == (N - 1, ["a", "b", "c", "d", "f"])
