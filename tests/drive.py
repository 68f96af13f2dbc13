"""Driving the engine below the experiments, for tests that hand it raw entry points: the
baseline-and-variants table `sweeps.engine.engine_nlls` gives, and a perplexity row."""

import math

import pandas as pd
import torch

from blockscope.sweeps import stats
from blockscope.sweeps.engine import engine_nlls


def engine_sweep(model, tokens: torch.Tensor, variants, *, wins, **kw) -> pd.DataFrame:
    """Baseline row, then one row per variant (`engine_nlls` as a table); `attrs["engine"]`
    says how it ran."""
    nlls, how = engine_nlls(model, tokens, variants, wins=wins, **kw)
    labels = [{"variant": "baseline"}] + [{"variant": "ablated", **v.label} for v in variants]
    sums, counts = stats.unit_sums(torch.stack(nlls), "document")  # (1, V, 2): one unit
    df = stats.frame(labels, {"nll": sums[..., 0], "kl": sums[..., 1]}, counts, None,
                     "document")
    df.attrs["engine"] = how
    return df


def perplexity_row(nll: torch.Tensor) -> dict:
    mean = float(nll.mean())
    return {"n_scored": int(nll.numel()), "nll": mean, "perplexity": math.exp(mean)}
