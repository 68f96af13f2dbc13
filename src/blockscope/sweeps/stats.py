"""Corpus perplexity from per-unit sums, bootstrap intervals, and rank stability.

A sweep keeps, per unit (a document of a corpus, or a 128-token chunk of one passage) and
per variant, the summed next-token NLL and the number of tokens scored, never per-token
logits. Corpus perplexity = exp(total NLL / total tokens), as lm-evaluation-harness weights
it. The bootstrap resamples units with replacement: each variant's interval, and the paired
interval of its change against the baseline (the same resampled units for both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

CHUNK = 128  # tokens per resampled unit when there is one passage, not a corpus
KL_MEANING = ("mean over the scored tokens of KL(p_clean || p_variant) in nats: the reference "
              "distribution is the clean model's next-token distribution at the same position, "
              "given the same context (0 for the baseline)")


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are drawn."""

    n: int = 1000  # resamples; 0 gives no intervals
    seed: int = 0  # numpy seed of the resampling indices and of the two random halves
    level: float = 0.95  # central interval, by percentiles of the resamples


def unit_sums(nll: torch.Tensor, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(sums (U, V, ...), counts (U,)) from per-token scores (V, ..., n) of one document (the
    NLL (V, n), or NLL and KL (V, 2, n)): one unit for a document, consecutive CHUNK-token
    chunks for a passage (the last one shorter)."""
    nll = nll.double().cpu()
    if unit == "document":
        return nll.sum(-1)[None].numpy(), np.array([nll.shape[-1]])
    parts = torch.split(nll, CHUNK, dim=-1)
    return (torch.stack([p.sum(-1) for p in parts]).numpy(),
            np.array([p.shape[-1] for p in parts]))


def resample(n_units: int, b: Bootstrap) -> np.ndarray:
    """(b.n, n_units) unit indices drawn with replacement: the resampling every interval of
    one table uses, so changes are paired."""
    return np.random.default_rng(b.seed).integers(0, n_units, size=(b.n, n_units))


def _perplexities(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(B, V) perplexity of each resample: exp(sum of its units' NLL / their tokens)."""
    weights = np.stack([np.bincount(row, minlength=len(counts)) for row in idx])  # (B, U)
    return np.exp((weights @ sums) / (weights @ counts)[:, None])


def frame(labels: list[dict], sums: dict[str, np.ndarray], counts: np.ndarray,
          b: Bootstrap | None, unit: str) -> pd.DataFrame:
    """One row per variant (the baseline first): n_scored, nll, perplexity, delta, ratio,
    then each other column's mean per scored token (kl: NaN where not given), and with `b`,
    ci_low/ci_high and the paired delta_ci_low/delta_ci_high of the perplexity.

    sums: the metric's columns by name, each (U, V) summed per unit and variant: "nll", the
    NLL, and any others ("kl": the KL divergence from the clean distribution); counts: (U,)
    tokens scored per unit."""
    nll_sums = sums["nll"]
    n = int(counts.sum())
    nll = nll_sums.sum(0) / n  # (V,)
    df = pd.DataFrame([{**label, "n_scored": n, "nll": float(v), "perplexity": math.exp(v)}
                       for label, v in zip(labels, nll, strict=True)])
    df["delta"] = df["perplexity"] - df.loc[0, "perplexity"]
    df["ratio"] = df["perplexity"] / df.loc[0, "perplexity"]
    for name, s in {"kl": None, **sums}.items():  # kl's column is there, NaN if not given
        if name != "nll":
            df[name] = s.sum(0) / n if s is not None else float("nan")
    record = {"unit": unit, "n_units": len(counts)}
    if b is not None and b.n > 0 and len(counts) >= 2:
        lo, hi = 50 * (1 - b.level), 50 * (1 + b.level)
        ppl = _perplexities(nll_sums, counts, resample(len(counts), b))  # (B, V)
        df["ci_low"], df["ci_high"] = np.percentile(ppl, [lo, hi], axis=0)
        delta = ppl - ppl[:, :1]
        df["delta_ci_low"], df["delta_ci_high"] = np.percentile(delta, [lo, hi], axis=0)
        df.loc[0, ["delta_ci_low", "delta_ci_high"]] = 0.0
        record.update(bootstrap=b.n, seed=b.seed, level=b.level, method="percentile")
        if len(counts) >= 4 and len(labels) >= 4:
            record["rank_stability"] = rank_stability(nll_sums, counts, b.seed)
    else:
        for c in ("ci_low", "ci_high", "delta_ci_low", "delta_ci_high"):
            df[c] = float("nan")
        record["bootstrap"] = ("off" if b is None or b.n == 0
                               else f"needs 2 or more {unit}s, got {len(counts)}")
    df.attrs["uncertainty"] = record
    return df


def rank_stability(sums: np.ndarray, counts: np.ndarray, seed: int) -> float:
    """Spearman correlation of the variants' perplexity changes (baseline excluded) between
    two random halves of the units: near 1, the ranking does not hang on which units."""
    perm = np.random.default_rng(seed).permutation(len(counts))
    halves = perm[: len(perm) // 2], perm[len(perm) // 2:]
    deltas = []
    for h in halves:
        ppl = np.exp(sums[h].sum(0) / counts[h].sum())
        deltas.append(pd.Series(ppl[1:] - ppl[0]))
    return float(deltas[0].rank().corr(deltas[1].rank()))
