"""What a sweep measures of each run: a metric is a class read from the final position's
logits, one value per batch row (float64).

- `TargetLogProb`: log P(target), the patching metric without a contrast;
- `TargetProb`: P(target), ROME's and Geva et al.'s;
- `LogitDiff`: logit(target) - logit(contrast), the IOI-style patching metric.

A new metric is one class with `name` and `__call__(logits)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def log_prob(logits: torch.Tensor, target: int) -> torch.Tensor:
    """log P(target) (B,) float64: the target's logit minus the logsumexp, its exponentials
    summed in float64 from one pass over the float32 logits (no float64 copy of them)."""
    top = logits.amax(-1, keepdim=True)  # (B, 1)
    lse = (logits - top).exp().sum(-1, dtype=torch.float64).log() + top[:, 0].double()
    return logits[:, target].double() - lse


@dataclass(frozen=True)
class TargetLogProb:
    target: int
    name = "log_prob"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """log P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target)


@dataclass(frozen=True)
class TargetProb:
    target: int
    name = "p_target"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """P(target) (B,) from logits (B, d_vocab)."""
        return log_prob(logits, self.target).exp()


@dataclass(frozen=True)
class LogitDiff:
    target: int
    contrast: int
    name = "logit_diff"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(target) - logit(contrast) (B,) from logits (B, d_vocab)."""
        logits = logits.double()
        return logits[:, self.target] - logits[:, self.contrast]
