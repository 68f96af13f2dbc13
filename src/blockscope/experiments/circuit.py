"""Edges and circuits: every edge of the residual stream's graph estimated from gradients
(EAP, EAP-IG: `sweeps.edges`), checked against exact edge patching, and circuits of the
top edges whose faithfulness is measured by patching, not estimated.

- `edge_attribution`: one row per edge (writer -> reader), the estimate of writing the
  clean run's writer into the corrupted run at that reader alone, normalised as `patch`
  normalises (0 the corrupted run, 1 the clean run); the `check` largest and `check` drawn
  at random patched exactly (one forward each), with the same statistics `attribute`
  reports.
- `circuit`: the top N edges by |estimate| for N on a grid; each circuit's faithfulness is
  the clean run with every edge outside it given the corrupted run's writer, as a share of
  the clean - corrupted gap (1: the circuit alone carries the gap; 0: nothing). The
  smallest N that reaches the threshold is found by bisection between the grid's points
  (which assumes faithfulness rises with N there; the curve shows where it does not).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.experiments.attribute import agreement, picked
from blockscope.sweeps import edges
from blockscope.sweeps.metrics import LogitDiff, TargetLogProb

MEANING = {
    "writer": "what writes to the stream: embed, aL.H (head H of block L), mL (block L's MLP)",
    "reader": "what reads it: qL.H / kL.H / vL.H (a head's query, key or value input; k and v "
    "per key/value head), mL (block L's MLP input), logits",
    "estimate": "the estimated change of the metric when the clean run's writer is written "
    "into the corrupted run at this reader alone, summed over positions (EAP / EAP-IG)",
    "normalized": "estimate / (clean - corrupted), as patch normalises",
    "exact_normalized": "the same patch done exactly, one forward (checked edges only)",
    "faithfulness": "the clean run with every edge outside the circuit given the corrupted "
    "run's writer: (metric - corrupted) / (clean - corrupted)",
}


RULE = ("edges ranked by |estimate|; a circuit of N keeps the top N; faithfulness: the clean "
        "run with every other edge's reader given the corrupted run's writer there (exact, "
        "one forward: sweeps.edges.rewired), (metric - corrupted) / (clean - corrupted); "
        "sizes 1, 2, 5, 10, ... and every edge, then bisection between the last size short "
        "of the threshold and the first to reach it")


def metric_for(target: int, contrast: int | None):
    return TargetLogProb(target) if contrast is None else LogitDiff(target, contrast)


def edge_frame(es: edges.EdgeScores) -> pd.DataFrame:
    """One row per edge of the graph: writer, reader, their blocks, estimate, normalized."""
    g, gap = es.graph, es.source - es.base
    rows = [{"writer": g.writers[u].name, "reader": g.readers[v].name,
             "writer_layer": g.writers[u].layer, "reader_layer": g.readers[v].layer,
             "estimate": float(es.values[v, u]),
             "normalized": float(es.values[v, u]) / gap if gap else math.nan}
            for v, u in g.edges()]
    df = pd.DataFrame(rows)
    for col in ("writer_layer", "reader_layer"):
        df[col] = df[col].astype("Int64")
    return df


def edge_attribution(model, clean: torch.Tensor, corrupted: torch.Tensor, *, target: int,
                     contrast: int | None = None, method: str = "atp", steps: int = 5,
                     check: int | None = 20, seed: int = 0) -> pd.DataFrame:
    """`edge_frame` of the estimates, `checked`, and the checked edges' exact effect
    (`exact_<metric>`, `exact_normalized`); attrs as `attribute` gives them."""
    metric = metric_for(target, contrast)
    es = edges.scores(model, clean, corrupted, metric, method=method, steps=steps)
    df = edge_frame(es)
    df["site"] = "edge"  # one kind of cell: the statistics are per kind
    inert = np.zeros(len(df), dtype=bool)  # an edge from a writer that differs anywhere
    chosen = picked(df, check, seed, inert)
    df["checked"] = chosen
    pairs = es.graph.edges()
    exact = np.full(len(df), math.nan)
    for i in [i for i, c in enumerate(chosen) if c]:
        one = np.zeros_like(es.graph.valid)
        one[pairs[i]] = True
        exact[i] = edges.rewired(model, corrupted, es.graph, one, es.clean_writers, metric)
    gap = es.source - es.base
    df[f"exact_{metric.name}"] = exact
    df["exact_normalized"] = (exact - es.base) / gap if gap else math.nan
    agree = agreement(df, metric.name, es.base, inert)
    df = df.drop(columns="site")
    df.attrs.update(clean=es.source, corrupted=es.base, metric=metric.name,
                    attribution=es.how, agreement=agree,
                    check=("all" if check is None else check), seed=seed)
    return df


def sizes(n_edges: int) -> list[int]:
    """The circuit sizes tried: 1, 2, 5, 10, 20, 50, ... below n_edges, then every edge."""
    out, k = [], 0
    while True:
        n = (1, 2, 5)[k % 3] * 10 ** (k // 3)
        if n >= n_edges:
            return out + [n_edges]
        out.append(n)
        k += 1


def circuit(model, clean: torch.Tensor, corrupted: torch.Tensor, *, target: int,
            contrast: int | None = None, method: str = "atp", steps: int = 5,
            threshold: float = 0.8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the curve: one row per size tried, `n_edges, share, <metric>, faithfulness`; the
    edges ranked by |estimate|, `rank, writer, reader, estimate, normalized, in_circuit`
    for the smallest circuit reaching `threshold`). attrs: the runs' values, the smallest
    size (None where even every edge falls short), how the edges were estimated."""
    if not 0 < threshold <= 1:
        raise BadValue(f"`faithfulness` must be in (0, 1] (got {threshold})")
    metric = metric_for(target, contrast)
    es = edges.scores(model, clean, corrupted, metric, method=method, steps=steps)
    g, gap = es.graph, es.source - es.base
    if gap == 0:
        raise BadValue("the clean and corrupted prompts give the same metric: there is no "
                       "gap for a circuit to carry")
    pairs = g.edges()
    order = np.argsort(-np.abs([es.values[p] for p in pairs]), kind="stable")
    measured: dict[int, float] = {}

    def faithfulness(n: int) -> float:
        if n not in measured:
            keep = np.zeros_like(g.valid)
            for i in order[:n]:
                keep[pairs[i]] = True
            value = edges.rewired(model, clean, g, g.valid & ~keep, es.replacement, metric)
            measured[n] = value
        return (measured[n] - es.base) / gap

    grid = sizes(len(pairs))
    for n in grid:
        faithfulness(n)
    smallest = None
    reached = [n for n in grid if faithfulness(n) >= threshold]
    if reached:
        hi = reached[0]
        below = [n for n in grid if n < hi]
        lo = below[-1] if below else 0
        while hi - lo > 1:  # the smallest n in (lo, hi] that reaches it
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if faithfulness(mid) >= threshold else (mid, hi)
        smallest = hi
    curve = pd.DataFrame([{"n_edges": n, "share": n / len(pairs), metric.name: measured[n],
                           "faithfulness": (measured[n] - es.base) / gap,
                           "on_grid": n in grid} for n in sorted(measured)])
    ranked = edge_frame(es).iloc[order].reset_index(drop=True)
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["in_circuit"] = ranked["rank"] <= (smallest or 0)
    for df in (curve, ranked):
        df.attrs.update(clean=es.source, corrupted=es.base, metric=metric.name,
                        attribution=es.how, smallest=smallest, threshold=threshold,
                        total_edges=len(pairs))
    return curve, ranked
