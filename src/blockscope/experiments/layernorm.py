"""Layer normalization worked step by step, checked against torch's own layer_norm."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError

EPS = 1e-5  # GPT-2's layer_norm_epsilon


def _broadcast(values: Sequence[float] | None, n: int, name: str, default: float) -> torch.Tensor:
    if not values:
        return torch.full((n,), default, dtype=torch.float64)
    if len(values) not in (1, n):
        raise BadValue(f"`{name}` takes one value or {n} (one per input), not {len(values)}")
    return torch.tensor(list(values) * (n if len(values) == 1 else 1), dtype=torch.float64)


def layer_norm_steps(
    x: Sequence[float], *, gain: Sequence[float] | None = None,
    bias: Sequence[float] | None = None, eps: float = EPS,
) -> pd.DataFrame:
    """Long table (step, index, value): mean, centred, variance, std, normalized, output.

    Variance is the population variance (divide by n), as layer norm uses; std = sqrt(var + eps).
    The last rows are torch.nn.functional.layer_norm on the same input and the largest
    absolute difference from the hand-worked output.
    """
    if len(x) < 2:
        raise BlockscopeError("layer norm needs at least 2 numbers")
    if not eps > 0 or eps == float("inf"):
        raise BadValue(f"`eps` must be a positive number (got {eps:g})")
    v = torch.tensor(list(x), dtype=torch.float64)  # (n,)
    g, b = _broadcast(gain, len(v), "gain", 1.0), _broadcast(bias, len(v), "bias", 0.0)
    for name, t in (("input", v), ("`gain`", g), ("`bias`", b)):
        if not torch.isfinite(t).all():
            raise BadValue(f"the {name} holds nan or inf: layer norm needs finite numbers")
    scale = v.abs().max().clamp_min(1e-300)  # worked in units of the largest magnitude,
    mean = (v / scale).mean() * scale  # so nothing overflows on the way
    centred = v - mean
    var = ((centred / scale) ** 2).mean() * scale**2
    std = torch.sqrt(var + eps)
    if not torch.isfinite(std):
        raise BlockscopeError(f"the variance of these numbers (about {float(scale):.0e} "
                              "squared) is beyond float64's range: scale them down")
    normalized = centred / std
    output = normalized * g + b
    reference = torch.nn.functional.layer_norm(v, (len(v),), weight=g, bias=b, eps=eps)
    steps = [("input", v), ("mean", mean), ("centred", centred), ("variance", var),
             ("std", std), ("normalized", normalized), ("gain", g), ("bias", b),
             ("output", output), ("torch layer_norm", reference),
             ("max abs difference", (output - reference).abs().max())]
    rows = [{"step": step, "index": i if t.dim() else None, "value": float(val)}
            for step, t in steps for i, val in enumerate(t.reshape(-1).tolist())]
    df = pd.DataFrame(rows)
    df["index"] = df["index"].astype("Int64")
    return df
