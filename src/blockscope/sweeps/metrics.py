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

The last three are read from one position's logits (`__call__(logits)`): `position`, the
last (-1) unless the metric says otherwise; the naive loop takes them from the model's own
forward. A new metric is one class.
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


def position_of(metric, T: int) -> int:
    """The position 0..T-1 whose logits `metric` reads: its `position` (negative counts from
    the end, as Python's indices do), the last where it names none."""
    p = getattr(metric, "position", -1)
    if isinstance(p, bool) or not isinstance(p, int) or not -T <= p < T:
        raise ValueError(f"the metric's position {p!r} is outside the run's {T} tokens "
                         f"(0..{T - 1}, or -{T}..-1 from the end)")
    return p % T


class AtPosition:
    """A metric of one position's logits (`position`, the last by default): read off final
    residuals through the final norm and unembedding."""

    def from_final(self, model, x: torch.Tensor) -> torch.Tensor:
        p = position_of(self, x.shape[1])
        return self(model.unembed(model.ln_final(x[:, p : p + 1]))[:, 0].float())


@dataclass(frozen=True)
class TargetLogProb(AtPosition):
    """log P(target) at `position` (column `log_prob`): `target` a token id."""

    target: int
    position: int = -1
    name = "log_prob"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """log P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target)


@dataclass(frozen=True)
class TargetProb(AtPosition):
    """P(target) at `position` (column `p_target`): `target` a token id."""

    target: int
    position: int = -1
    name = "p_target"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target).exp()


@dataclass(frozen=True)
class LogitDiff(AtPosition):
    """logit(target) - logit(contrast) at `position` (column `logit_diff`): two token
    ids."""

    target: int
    contrast: int
    position: int = -1
    name = "logit_diff"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(target) - logit(contrast) (B,) from logits (B, d_vocab)."""
        logits = logits.double()
        return logits[:, self.target] - logits[:, self.contrast]
