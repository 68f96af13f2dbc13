"""Blocks rearranged (Lad et al. 2024; Sun et al. 2024, "Transformer Layers as Painters"):
two blocks swapped, a run of blocks reversed, a block repeated, or a run of blocks made
parallel (each reads the run's input; their writes are summed). Each arrangement is one
`interventions.Rearrange`, scored like any variant: perplexity and the KL divergence from
the clean model's next-token distribution, by the naive loop or the engine (which enters
at the window's end with the window run by `apply`).

Blocks count from 0; a run `i:j` holds blocks i to j, both included.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from blockscope.errors import BadValue
from blockscope.inputs.corpus import as_docs
from blockscope.interventions import Rearrange
from blockscope.sweeps import scoring
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

KINDS = ("swap", "reverse", "repeat", "parallel")
COLUMNS = ["variant", "arrangement", "kind", "first", "last", "order", "n_scored", "nll",
           "perplexity", "delta", "ratio", "kl", "ci_low", "ci_high", "delta_ci_low",
           "delta_ci_high"]
MEANINGS = {
    "arrangement": "as given: swap i,j; reverse i:j; repeat iXN; parallel i:j (runs include "
    "both ends, blocks count from 0)",
    "order": "the blocks as they run after the change; (a+b) = run side by side on the same "
    "input, their writes (output - input) summed",
    "parallel": "x -> x + sum over the run's blocks of (block(x) - x)",
}


def _ints(text: str, sep: str, what: str) -> list[int]:
    try:
        return [int(p) for p in text.split(sep)]
    except ValueError:
        raise BadValue(f"`{what}` takes blocks as {_FORMS[what]} (got {text})")


_FORMS = {"swap": "i,j", "reverse": "i:j", "repeat": "i or iXN", "parallel": "i:j"}


def arrangement(kind: str, text: str, n_layers: int) -> Rearrange:
    """The Rearrange a user's `--swap 3,4`, `--reverse 2:5`, `--repeat 6x3` or
    `--parallel 4:7` means (BadValue if it is malformed or out of range)."""
    if kind not in KINDS:
        raise BadValue(f"`kind` must be one of {', '.join(KINDS)} (got {kind})")
    text = text.strip().lower()
    if kind == "repeat":
        block, _, times = text.partition("x")
        (i,), n = _ints(block, ",", kind), _ints(times or "2", ",", kind)[0]
        parts = [i]
        if n < 2:
            raise BadValue(f"`repeat` runs a block 2 or more times in all (got {text})")
    else:
        parts = _ints(text, "," if kind == "swap" else ":", kind)
        if len(parts) != 2:
            raise BadValue(f"`{kind}` takes blocks as {_FORMS[kind]} (got {text})")
    if any(not 0 <= p < n_layers for p in parts):
        raise BadValue(f"`{kind}` {text}: blocks run from 0 to {n_layers - 1}")
    if kind == "repeat":
        return Rearrange(i, i, ((i,),) * n, f"repeat {i}x{n}")
    i, j = parts
    if not i < j:
        raise BadValue(f"`{kind}` {text}: the first block must come before the second")
    steps = {"swap": [(j,), *[(k,) for k in range(i + 1, j)], (i,)],
             "reverse": [(k,) for k in range(j, i - 1, -1)],
             "parallel": [tuple(range(i, j + 1))]}[kind]
    return Rearrange(i, j, tuple(steps), f"{kind} {text}")


def adjacent_swaps(n_layers: int) -> list[Rearrange]:
    """Every adjacent pair of blocks swapped, one pair at a time."""
    return [arrangement("swap", f"{i},{i + 1}", n_layers) for i in range(n_layers - 1)]


def rearranged(
    model, tokens, arrangements: Sequence[Rearrange], *,
    settings: RunSettings = RunSettings(),
) -> pd.DataFrame:
    """Baseline row, then one row per arrangement: perplexity, change, ratio, KL from the
    clean distribution (and with `settings.ci`, bootstrap intervals).

    tokens: a passage `(1, pos)` or `corpus.Docs`."""
    if not arrangements:
        raise BadValue("give at least one arrangement")
    n_layers = model.cfg.n_layers
    for a in arrangements:
        if a.last >= n_layers:
            raise BadValue(f"`{a.name}`: the model has {n_layers} blocks")
    docs = as_docs(tokens)
    prepared = scoring.prepare(model, docs, settings)
    variants = [Variant({"arrangement": a.name, "kind": a.name.split()[0], "first": a.first,
                         "last": a.last, "order": a.order(n_layers)}, order=a)
                for a in arrangements]
    df = scoring.run(model, docs, variants, settings, prepared=prepared)
    df.loc[0, ["arrangement", "kind", "order"]] = ["none", "none",
                                                  " ".join(map(str, range(n_layers)))]
    attrs = df.attrs
    df[["first", "last"]] = df[["first", "last"]].astype("Int64")
    df = df[COLUMNS]
    df.attrs = attrs
    return df
