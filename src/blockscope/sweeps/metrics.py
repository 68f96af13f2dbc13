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


@dataclass(frozen=True)
class TargetLogProb:
    target: int
    name = "log_prob"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """log P(target) (B,) from logits (B, d_vocab)."""
        return torch.log_softmax(logits.double(), dim=-1)[:, self.target]


@dataclass(frozen=True)
class TargetProb:
    target: int
    name = "p_target"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """P(target) (B,) from logits (B, d_vocab)."""
        return torch.softmax(logits.double(), dim=-1)[:, self.target]


@dataclass(frozen=True)
class LogitDiff:
    target: int
    contrast: int
    name = "logit_diff"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(target) - logit(contrast) (B,) from logits (B, d_vocab)."""
        logits = logits.double()
        return logits[:, self.target] - logits[:, self.contrast]
