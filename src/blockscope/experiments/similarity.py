"""Cheap block-importance metrics from the clean pass, as in the layer-pruning literature.

For block k with input x (its `hook_resid_pre`) and output y (its `hook_resid_post`), per
token t: cos_t = x_t . y_t / (|x_t| |y_t|). For one half (`part` attn or mlp), x is what
that half reads from the stream and y = x + the half's write: `hook_resid_pre` and
`hook_resid_mid` for attention, `hook_resid_mid` and `hook_resid_post` for the MLP of a
sequential block; the block's input and input + `hook_attn_out` (or `hook_mlp_out`) for a
parallel block's.
- Block Influence (ShortGPT, Men et al. 2024): 1 - mean_t cos_t.
- Angular distance (Gromov et al. 2024): mean_t arccos(cos_t) / pi.
Both are averaged over every token of the passage except the first (BOS when prepended,
whose residual is an outlier), each token once across sliding windows.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from blockscope.sweeps.clean import Clean


class BlockSimilarity:
    """Accumulates the per-token cosines of each block's input and output over windows,
    per document (`add(index, clean)`), so that processes join their sums in corpus
    order (`joined`)."""

    def __init__(self, n_layers: int, part: str = "block"):
        self.part = part
        self.n_layers = n_layers
        self.parts: dict[int, dict[str, torch.Tensor]] = {}  # document -> its sums
        self.cos_sum = self.angle_sum = None  # the totals, once `joined`
        self.count = 0

    def add(self, index: int, clean: Clean) -> None:
        lo = clean.window.offset  # positions newly scored here
        sums = self.parts.setdefault(index, {
            "cos": torch.zeros(self.n_layers, dtype=torch.float64),
            "angle": torch.zeros(self.n_layers, dtype=torch.float64),
            "count": torch.zeros((), dtype=torch.float64)})
        for k in range(self.n_layers):
            x, y = (v[0, lo:].double() for v in self.pair(clean, k))
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1).clamp(-1, 1)  # (n,)
            sums["cos"][k] += cos.sum().cpu()
            sums["angle"][k] += (torch.arccos(cos) / math.pi).sum().cpu()
        sums["count"] += clean.pre[0].shape[1] - lo

    def pair(self, clean: Clean, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the removed part reads, what the stream holds after its write), (1, T, d)."""
        if self.part == "block":
            return clean.pre[k], clean.pre[k + 1]
        mid = clean.acts.get(f"blocks.{k}.hook_resid_mid")
        if mid is not None:  # sequential: the mid point between the halves
            return (clean.pre[k], mid) if self.part == "attn" else (mid, clean.pre[k + 1])
        write = clean.act("hook_attn_out" if self.part == "attn" else "hook_mlp_out", k)
        return clean.pre[k], clean.pre[k] + write  # parallel: both halves read the input

    def joined(self, comm) -> BlockSimilarity:
        """The sums of every document of every process (`parallel.Comm`), added in corpus
        order."""
        from blockscope.inputs.parallel import total

        parts = total(comm, sorted(self.parts.items()))
        out = BlockSimilarity(self.n_layers, self.part)
        out.cos_sum, out.angle_sum, out.count = parts["cos"], parts["angle"], float(parts["count"])
        return out

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "layer": range(len(self.cos_sum)),
            "block_influence": (1 - self.cos_sum / self.count).tolist(),
            "angular_distance": (self.angle_sum / self.count).tolist(),
        })


def spearman(a: pd.Series, b: pd.Series) -> float:
    """Spearman rank correlation (average ranks for ties), without scipy."""
    return float(a.rank().corr(b.rank()))
