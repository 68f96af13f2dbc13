"""A sweep's scores per unit (a document, or a passage's 128-token chunk): each unit's
summed per-token metric, named by the metric's columns, gathered from every process in
corpus order (`Scores`, `gather_units`, `doc_units`), and how the units ran, as one record
(`merged_how`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from blockscope.sweeps import stats
from blockscope.sweeps.how import How
from blockscope.sweeps.metrics import NllKl


@dataclass
class Scores:
    """Per-unit sums of a sweep's per-token metric, gathered from every process, in corpus
    order: its columns named by the metric (`NllKl.columns`: nll, kl)."""

    labels: list[dict]  # one per variant column: the baseline's, then each variant's
    sums: np.ndarray  # (U, V, k) summed per unit (a document, or a passage's chunk)
    counts: np.ndarray  # (U,) tokens scored per unit
    unit: str  # "document" or "chunk"
    how: dict  # how the engine ran (replay, batch size, any fallback)
    columns: tuple[str, ...] = NllKl.columns  # the metric's k columns, in order

    def of(self, column: str) -> np.ndarray:
        """(U, V): the sums of the metric's column `column`."""
        return self.sums[..., self.columns.index(column)]

    def frame(self, ci: stats.Bootstrap | None = None) -> pd.DataFrame:
        """Baseline row, then one row per variant (`stats.frame`); attrs["engine"] = how."""
        df = stats.frame(self.labels, {c: self.of(c) for c in self.columns}, self.counts, ci,
                         self.unit)
        df.attrs["engine"] = self.how
        return df


def gather_units(docs, units: list, hows: list[dict], labels: list[dict],
                 columns: tuple[str, ...] = NllKl.columns) -> Scores:
    """`units` = [(doc index, chunk, sums (V, k), count)] of this process, and how each
    document ran, joined with every other process's, in corpus order; `columns` names the
    k."""
    gathered = docs.comm.gather((units, hows))
    units = sorted((u for part, _ in gathered for u in part), key=lambda u: u[:2])
    sums = np.stack([u[2] for u in units])  # (U, V, k)
    return Scores(labels, sums, np.array([u[3] for u in units]), docs.unit,
                  merged_how([h for _, part in gathered for h in part]), columns)


def doc_units(index: int, scores: torch.Tensor, unit: str) -> list:
    """One document's per-token scores (V, k, n) as units [(index, chunk, sums (V, k),
    count)]."""
    sums, counts = stats.unit_sums(scores, unit)  # (u, V, 2), (u,)
    return [(index, j, s, c) for j, (s, c) in enumerate(zip(sums, counts, strict=True))]


def merged_how(hows: list[dict]) -> dict:
    """How the documents (or windows) ran, as one record: every engine and replay, the
    largest batch, any fallback and any reason the cached engine was not tried."""
    def joined(key):
        return "+".join(sorted({part for h in hows for part in engine_of(h, key).split("+")},
                               reverse=True))

    def engine_of(h, key):  # a unit kept by an earlier version has no `engine`
        return h.get(key) or ("naive" if h["replay"] == "naive" else "cached")

    def said(key):
        return "; ".join(sorted({h[key] for h in hows if key in h})) or None

    return How(joined("engine"), joined("replay"), max(h["batch_size"] for h in hows),
               fallback=said("fallback"), why_naive=said("why_naive")).record()
