"""What a sweep measures of each run: a metric is a class, read off the runs' final
residuals (`from_final(model, x)`, x (B, T, d_model): one value, or one row, per batch row)
by the cached engines, and off the model's own logits by the naive loops.

- `NllKl`: per scored token of a window, the NLL and the KL from the clean distribution
  (the removal sweeps: ablate, prune-heads, prune-blocks, rearrange), its rows named by
  `columns`; the naive loop reads it with `of_logits`;
- `TargetLogProb`: log P(target) at the last position, the patching metric without a
  contrast;
- `TargetProb`: P(target), ROME's and Geva et al.'s;
- `LogitDiff`: logit(target) - logit(contrast), the IOI-style patching metric.

The last three are read from the last position's logits (`__call__(logits)`), which the
naive loop takes from the model's own forward. A new metric is one class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockscope.sweeps import unembed
from blockscope.sweeps.clean import Clean
from blockscope.sweeps.naive import CleanDistribution, logsumexp64, nll_of


def log_prob(logits: torch.Tensor, target: int) -> torch.Tensor:
    """log P(target) (B,) float64: the target's logit minus the logsumexp, its exponentials
    summed in float64 from one pass over the float32 logits (no float64 copy of them)."""
    top = logits.amax(-1, keepdim=True)  # (B, 1)
    lse = (logits - top).exp().sum(-1, dtype=torch.float64).log() + top[:, 0].double()
    return logits[:, target].double() - lse


@dataclass(frozen=True, eq=False)
class NllKl:
    """Per scored token of the clean pass's window, the NLL and the KL divergence from the
    clean distribution (NaN where the unembedding is hooked), through the final norm and
    the blocked unembedding (`unembed.final_nll`): (B, 2, n_scored) float64 on the CPU.
    `clean`: the cached engine's clean pass of the window (the naive loop needs none)."""

    clean: Clean | None = None
    softcap: float | None = None
    name = "nll_kl"
    columns = ("nll", "kl")  # the rows of what it reads, in order

    def of_logits(self, logits: torch.Tensor, targets: torch.Tensor,
                  reference: CleanDistribution | None) -> torch.Tensor:
        """The naive loop's read, (2, n) float64 on the CPU: from the model's own logits
        (n, d_vocab) at a window's scored positions, the NLL of `targets` (n,) and the KL
        from `reference`, the clean distribution there (None: NaN). One logsumexp serves
        both, its exponentials summed in float64 as the blocked unembedding sums them."""
        lse = logsumexp64(logits)  # (n,)
        nll = nll_of(logits, targets, lse).cpu()
        kl = (reference.kl(logits, lse).cpu() if reference is not None
              else torch.full_like(nll, math.nan))
        return torch.stack([nll, kl])

    def from_final(self, model, x: torch.Tensor) -> torch.Tensor:
        ref = self.clean.reference(model, self.softcap)
        nll = unembed.final_nll(model, x, self.clean.chunk, self.clean.window, self.softcap,
                                ref)
        nll, kl = nll if ref is not None else (nll, torch.full_like(nll, float("nan")))
        return torch.stack([nll, kl], 1).double().cpu()


class LastLogits:
    """A metric of the last position's logits: read off final residuals through the final
    norm and unembedding."""

    def from_final(self, model, x: torch.Tensor) -> torch.Tensor:
        return self(model.unembed(model.ln_final(x[:, -1:]))[:, 0].float())


@dataclass(frozen=True)
class TargetLogProb(LastLogits):
    """log P(target) at the last position (column `log_prob`): `target` a token id."""

    target: int
    name = "log_prob"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """log P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target)


@dataclass(frozen=True)
class TargetProb(LastLogits):
    """P(target) at the last position (column `p_target`): `target` a token id."""

    target: int
    name = "p_target"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target).exp()


@dataclass(frozen=True)
class LogitDiff(LastLogits):
    """logit(target) - logit(contrast) at the last position (column `logit_diff`): two
    token ids."""

    target: int
    contrast: int
    name = "logit_diff"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(target) - logit(contrast) (B,) from logits (B, d_vocab)."""
        logits = logits.double()
        return logits[:, self.target] - logits[:, self.contrast]
