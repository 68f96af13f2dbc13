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
from blockscope.experiments.agreement import agreement, picked
from blockscope.sweeps import edges
from blockscope.sweeps.metrics import LogitDiff, TargetLogProb
from blockscope.sweeps.settings import RunSettings

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
    "ci_low": "over pairs: the 95% bootstrap interval's low end (of normalized, or of "
    "faithfulness)",
    "ci_high": "over pairs: the interval's high end",
}


RULE = ("edges ranked by |estimate|; a circuit of N keeps the top N; faithfulness: the clean "
        "run with every other edge's reader given the corrupted run's writer there (exact, "
        "one forward: sweeps.edges.rewired), (metric - corrupted) / (clean - corrupted); "
        "sizes 1, 2, 5, 10, ... and every edge, then bisection between the last size short "
        "of the threshold and the first to reach it")


PAIRS_RULE = ("; over pairs: edges ranked by their mean estimate, faithfulness the mean "
              "rewired metric less the mean corrupted one over the mean gap, with a 95% "
              "percentile bootstrap interval over pairs (ci_low, ci_high)")


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


def edge_attribution_pairs(model, items: list, *, method: str = "atp", steps: int = 5,
                           check: int | None = 20, seed: int = 0,
                           settings: RunSettings = RunSettings(), comm=None,
                           kept=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`edge_attribution` over many pairs (`experiments.pairs.Tokens`), as
    `attribute.attribute_pairs` averages cells: (one row per edge, its estimate and exact
    effect averaged over pairs with bootstrap intervals; one row per pair). The edges
    checked are picked on the averaged estimates and patched exactly in every pair;
    `settings.progress` is told of each pair done, in each pass."""
    from blockscope.experiments import pairs as px

    progress = settings.progress

    def estimated(t) -> dict:
        es = edges.scores(model, t.clean, t.corrupted, metric_for(t.target, t.contrast),
                          method=method, steps=steps)
        return {"graph": es.graph, "values": es.values, "base": es.base, "clean": es.source,
                "how": es.how}

    ests = px.over(items, estimated, comm, kept, progress)
    g = ests[0]["graph"]
    pairs = g.edges()
    where = tuple(np.array(pairs).T)
    values = np.stack([e["values"][where] for e in ests])  # (pairs, edges)
    lo, hi = np.array([e["base"] for e in ests]), np.array([e["clean"] for e in ests])
    share, ci_lo, ci_hi = px.ratio(values, hi - lo)
    df = edge_frame(edges.EdgeScores(g, ests[0]["values"], 0.0, 0.0, {}, {}))  # the names
    df["estimate"], df["normalized"] = values.mean(0), share
    df["ci_low"], df["ci_high"] = ci_lo, ci_hi
    df["site"] = "edge"
    inert = np.zeros(len(df), dtype=bool)
    df["checked"] = picked(df, check, seed, inert)
    picks = [i for i, c in enumerate(df["checked"]) if c]
    name = metric_for(items[0].target, items[0].contrast).name

    def exact(t) -> dict:
        metric = metric_for(t.target, t.contrast)
        clean = edges.writers(model, t.clean)
        got = []
        for i in picks:
            one = np.zeros_like(g.valid)
            one[pairs[i]] = True
            got.append(edges.rewired(model, t.corrupted, g, one, clean, metric))
        return {"values": np.array(got)}

    exs = px.over(items, exact, comm, kept, progress) if picks else []
    for col in (f"exact_{name}", "exact_normalized", "exact_ci_low", "exact_ci_high"):
        df[col] = math.nan
    if exs:
        got = np.stack([e["values"] for e in exs])
        df.loc[picks, f"exact_{name}"] = got.mean(0)
        df.loc[picks, ["exact_normalized", "exact_ci_low", "exact_ci_high"]] = np.stack(
            px.ratio(got - lo[:, None], hi - lo), axis=1)
    agree = agreement(df, name, float(lo.mean()), inert)
    df = df.drop(columns="site")
    per_pair = px.per_pair(items, name, hi, lo)
    df.attrs.update(clean=float(hi.mean()), corrupted=float(lo.mean()), metric=name,
                    attribution={**ests[0]["how"], "pairs": len(items)}, agreement=agree,
                    check=("all" if check is None else check), seed=seed, n_pairs=len(items))
    return df, per_pair


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
    from blockscope.experiments.pairs import PromptPair, Tokens

    one = Tokens(PromptPair("", "", ""), clean, corrupted, target, contrast)
    return circuit_pairs(model, [one], method=method, steps=steps, threshold=threshold)


def circuit_pairs(model, items: list, *, method: str = "atp", steps: int = 5,
                  threshold: float = 0.8, comm=None, progress=None
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`circuit` over pairs (`experiments.pairs.Tokens`): edges ranked by their estimate
    averaged over pairs; a circuit's faithfulness is the mean metric of the rewired clean
    runs less the mean corrupted one, as a share of the mean gap, with a bootstrap interval
    over pairs (`ci_low`, `ci_high`) where there are several. Under torchrun (`comm`) each
    process estimates and rewires its own pairs, and every size's metrics are gathered."""
    from blockscope.experiments import pairs as px
    from blockscope.inputs.parallel import Comm

    if not 0 < threshold <= 1:
        raise BadValue(f"`faithfulness` must be in (0, 1] (got {threshold})")
    comm = comm or Comm()
    held: dict[int, tuple] = {}  # this process's pairs: k -> (metric, corrupted writers)

    def estimated(kt) -> dict:
        k, t = kt
        metric = metric_for(t.target, t.contrast)
        es = edges.scores(model, t.clean, t.corrupted, metric, method=method, steps=steps)
        held[k] = (metric, es.replacement)
        return {"graph": es.graph, "values": es.values, "base": es.base, "clean": es.source,
                "how": es.how}

    ests = px.over(list(enumerate(items)), estimated, comm, None, progress)
    g = ests[0]["graph"]
    pairs = g.edges()
    where = tuple(np.array(pairs).T)
    values = np.stack([e["values"][where] for e in ests])  # (pairs, edges)
    lo, hi = np.array([e["base"] for e in ests]), np.array([e["clean"] for e in ests])
    gap = float((hi - lo).mean())
    if gap == 0:
        raise BadValue("the clean and corrupted prompts give the same metric: there is no "
                       "gap for a circuit to carry")
    mean = values.mean(0)
    order = np.argsort(-np.abs(mean), kind="stable")
    measured: dict[int, np.ndarray] = {}  # size -> each pair's metric

    def faithfulness(n: int) -> float:
        if n not in measured:
            keep = np.zeros_like(g.valid)
            for i in order[:n]:
                keep[pairs[i]] = True
            mine = [(k, edges.rewired(model, items[k].clean, g, g.valid & ~keep, repl,
                                      metric)) for k, (metric, repl) in held.items()]
            done = sorted(x for part in comm.gather(mine) for x in part)
            measured[n] = np.array([v for _, v in done])
        return (float(measured[n].mean()) - float(lo.mean())) / gap

    grid = sizes(len(pairs))
    for n in grid:
        faithfulness(n)
    smallest = None
    reached = [n for n in grid if faithfulness(n) >= threshold]
    if reached:
        hi_n = reached[0]
        below = [n for n in grid if n < hi_n]
        lo_n = below[-1] if below else 0
        while hi_n - lo_n > 1:  # the smallest n in (lo_n, hi_n] that reaches it
            mid = (lo_n + hi_n) // 2
            lo_n, hi_n = (lo_n, mid) if faithfulness(mid) >= threshold else (mid, hi_n)
        smallest = hi_n
    name = metric_for(items[0].target, items[0].contrast).name
    rows = []
    for n in sorted(measured):
        row = {"n_edges": n, "share": n / len(pairs), name: float(measured[n].mean()),
               "faithfulness": faithfulness(n)}
        if len(items) > 1:
            _, row["ci_low"], row["ci_high"] = (float(x[0]) for x in
                                                px.ratio((measured[n] - lo)[:, None], hi - lo))
        rows.append({**row, "on_grid": n in grid})
    curve = pd.DataFrame(rows)
    ranked = edge_frame(edges.EdgeScores(g, ests[0]["values"], 0.0, 0.0, {}, {}))
    ranked["estimate"], ranked["normalized"] = mean, mean / gap
    ranked = ranked.iloc[order].reset_index(drop=True)
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["in_circuit"] = ranked["rank"] <= (smallest or 0)
    how = ests[0]["how"] if len(items) == 1 else {**ests[0]["how"], "pairs": len(items)}
    for df in (curve, ranked):
        df.attrs.update(clean=float(hi.mean()), corrupted=float(lo.mean()), metric=name,
                        attribution=how, smallest=smallest, threshold=threshold,
                        total_edges=len(pairs))
    return curve, ranked
