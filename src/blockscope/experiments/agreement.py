"""How far an estimate holds against exact patching: which cells a run checks (`picked`:
per site the largest estimates and a seeded draw from the rest, never an inert cell) and how
well the estimates agree with the exact changes there (`agreement`: correlations, the
largest miss, the largest exact effect among the drawn cells), for `attribute` and
`circuit`."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from blockscope.experiments.patch import HEADS


def picked(df: pd.DataFrame, check: int | None, seed: int, inert: np.ndarray,
           rank: str = "estimate") -> list[str]:
    """Per row, why it is checked: per site, the `check` largest |rank| ("top") and
    `check` of the rest drawn with numpy's `default_rng(seed)` ("random"), never an inert
    cell (one whose patch writes the values already there: its change is 0, estimated and
    exact); every row "all" where `check` is None; "" where not checked."""
    if check is None:
        return ["all"] * len(df)
    out = [""] * len(df)
    rng = np.random.default_rng(seed)
    live = df[~inert]
    for _, part in live.groupby("site", sort=False):
        order = part[rank].abs().sort_values(ascending=False, kind="stable").index
        top, rest = list(order[:check]), np.array(sorted(order[check:]), dtype=int)
        for i in top:
            out[i] = "top"
        for i in rng.choice(rest, size=min(check, len(rest)), replace=False):
            out[int(i)] = "random"
    return out


def agreement(df: pd.DataFrame, metric: str, corrupted: float, inert: np.ndarray) -> dict:
    """Per site, over its checked rows that are not inert (see `picked`: their exact change
    is float32 rounding, and ranking it would measure nothing): how many, the Pearson and
    Spearman correlations of estimate and exact change, the largest miss |estimate -
    exact| (normalized, and where), and the largest exact |effect| among the random rows;
    and how many inert cells were left out."""
    out = {}
    checked = df["checked"] != ""
    for site in dict.fromkeys(df.loc[checked, "site"]):
        part = df[checked & ~inert & (df["site"] == site)]
        exact = part[f"exact_{metric}"] - corrupted
        record = {"checked": len(part),
                  "inert": int((checked & inert & (df["site"] == site)).sum()),
                  "pearson": _corr(part["estimate"], exact, "pearson"),
                  "spearman": _corr(part["estimate"], exact, "spearman")}
        miss = (part["normalized"] - part["exact_normalized"]).abs()
        if miss.notna().any():
            i = miss.idxmax()
            record["largest_miss"] = {"where": where(df.loc[i]),
                                      "normalized": float(df.loc[i, "normalized"]),
                                      "exact_normalized": float(df.loc[i, "exact_normalized"])}
        rand = part[part["checked"] == "random"]
        if len(rand):
            i = rand["exact_normalized"].abs().idxmax()
            record["largest_random_exact"] = {
                "where": where(df.loc[i]),
                "exact_normalized": float(df.loc[i, "exact_normalized"])}
        out[site] = record
    return out


def _corr(a: pd.Series, b: pd.Series, kind: str) -> float:
    """The correlation, or NaN where it is undefined (fewer than 3 cells, or one constant)."""
    if len(a) < 3 or a.nunique() < 2 or b.nunique() < 2:
        return math.nan
    return float(a.corr(b, method=kind))


def where(row) -> str:
    """A cell as the tables name it: `z L2 head 1`, `q L0 head 3`, `resid-pre L0 @3`, or an
    edge `a0.2 -> q1.3`."""
    if "writer" in row:
        return f"{row['writer']} -> {row['reader']}"
    if row["site"] in HEADS:
        return f"{row['site']} L{row['layer']} head {row['head']}"
    return f"{row['site']} L{row['layer']} @{row['position']}"
