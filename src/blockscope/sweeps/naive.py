"""Score a passage under interventions: windows, NLL, and the naive reference sweep.

`naive_nlls(model, tokens, variants)` scores the clean model and each variant (a label plus
its interventions, run as their hooks) with one hooked forward per variant over the
same sliding windows, and returns each one's per-token NLL. The cached engine (engine.py)
must give the same numbers; `scoring.scores` turns either into per-document sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from blockscope.inputs.text import Window, windows
from blockscope.interventions import applied
from blockscope.sweeps.variant import Progress, Variant


def default_stride(n_ctx: int) -> int:
    """The sliding-window stride when none is given: half the context."""
    return max(1, n_ctx // 2)


def model_windows(model, tokens: torch.Tensor, stride: int | None) -> list[Window]:
    """Windows of the model's context length; default stride half of it."""
    n_ctx = model.cfg.n_ctx
    return windows(tokens.shape[-1], n_ctx, stride or default_stride(n_ctx))


def window_nll(model, tokens: torch.Tensor, w: Window) -> torch.Tensor:
    """NLL of the tokens window `w` scores, `(n_scored,)` float32; differentiable."""
    chunk = tokens[:, w.begin : w.end].to(model.cfg.device)  # (1, pos)
    return nll_from_logits(model(chunk, return_type="logits")[0], chunk, w)


def nll_from_logits(logits: torch.Tensor, chunk: torch.Tensor, w: Window) -> torch.Tensor:
    """NLL of window `w`'s scored tokens from its logits `(pos, d_vocab)`."""
    lo = w.offset  # first scored position within the window
    return nll_of(logits[lo - 1 : -1], chunk[0, lo:])


def nll_of(logits: torch.Tensor, targets: torch.Tensor,
           lse: torch.Tensor | None = None) -> torch.Tensor:
    """NLL (k,) float64 of `targets` (k,) from the float32 logits (k, d_vocab) predicting
    them: logsumexp with the exponentials summed in float64, as the engine's blocked
    unembedding sums them. (float32 `log_softmax` over 49,152 logits is biased by about
    -9e-6 nats per token on the CPU, the whole margin the engines are held to.) `lse`: the
    logits' logsumexp (`logsumexp64`), if already at hand."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    lse = logsumexp64(logits) if lse is None else lse
    return lse - logits.gather(-1, targets[:, None])[:, 0].double()


class CleanDistribution:
    """The clean next-token distribution at k positions, from its full logits (k, d_vocab),
    for the naive loop's KL: KL(p_c || p) = sum_v p_c log p_c - sum_v p_c z + lse(z), the
    first term once per window, the others from each variant's full logits z (sums in
    float64)."""

    def __init__(self, logits: torch.Tensor):
        lse = logsumexp64(logits)  # (k,)
        logits = logits.float()
        self.p = (logits - lse.float()[:, None]).exp_()  # (k, d_vocab)
        self.own = (self.p * logits).sum(-1, dtype=torch.float64) - lse  # sum p log p

    def kl(self, logits: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
        """KL(p_clean || softmax(logits)) (k,) float64 (`lse`: the logits' own, if known)."""
        cross = (self.p * logits.float()).sum(-1, dtype=torch.float64)
        return self.own - cross + (logsumexp64(logits) if lse is None else lse)


def logsumexp64(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp (k,) float64 of logits (k, d_vocab) (float32 unless float64): a max, then
    the exponentials summed in float64, as the engine's blocked unembedding sums them."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    top = logits.detach().amax(-1, keepdim=True)  # (k, 1)
    return (logits - top).exp().sum(-1, dtype=torch.float64).log() + top[:, 0].double()


def token_nll(model, tokens: torch.Tensor, wins: Sequence[Window]) -> torch.Tensor:
    """Next-token negative log-likelihood of tokens 1..n-1, in order, `(n-1,)` float64."""
    with torch.inference_mode():
        return torch.cat([window_nll(model, tokens, w) for w in wins]).double().cpu()


def clean_sums(
    model, tokens: torch.Tensor, wins: Sequence[Window], hook_names: Iterable[str]
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The clean NLL, each hook's activation summed over every position of every window
    (float64), and the number of positions summed."""
    sums: dict[str, torch.Tensor] = {}

    def accumulator(name: str) -> Callable:
        def accumulate(act: torch.Tensor, hook=None) -> None:  # act: (1, pos, ...)
            total = per_position(act, name).sum(0)
            sums[name] = sums[name] + total if name in sums else total

        return accumulate

    with applied(model, [(name, accumulator(name)) for name in sorted(set(hook_names))]):
        nll = token_nll(model, tokens, wins)
    return nll, {k: v.cpu() for k, v in sums.items()}, sum(w.end - w.begin for w in wins)


def activations(model, tokens: torch.Tensor, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Each hook point's activation at every position of one forward of `tokens` (1, T):
    name -> (T, *unit) (`per_position`), float32."""
    acts: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable:
        def hook(act: torch.Tensor, hook=None) -> None:
            acts[name] = per_position(act, name).float()

        return hook

    with torch.inference_mode(), applied(model, [(n, keep(n)) for n in sorted(set(names))]):
        model(tokens.to(model.cfg.device), return_type="logits")
    return acts


def partners(n: int, seed: int) -> list[int]:
    """Each of n >= 2 documents' partner, another document: one seeded random cycle through
    all of them (a derangement, so no document is its own)."""
    import numpy as np

    perm = np.random.default_rng(seed).permutation(n).tolist()
    out = [0] * n
    for i, d in enumerate(perm):
        out[d] = perm[(i + 1) % n]
    return out


def per_position(act: torch.Tensor, name: str) -> torch.Tensor:
    """An activation as (batch x pos, *unit) float64: z keeps (n_heads, d_head), the rest
    their last axis. Some models (OPT's MLP) flatten batch and position inside the block."""
    unit = 2 if name.endswith("hook_z") else 1
    return act.detach().double().reshape(-1, *act.shape[-unit:])


def naive_nlls(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Variant],
    *,
    wins: Sequence[Window],
    reference: Sequence | None = None,
    baseline_nll: torch.Tensor | None = None,
    metric,
    progress: Progress | None = None,
) -> list[torch.Tensor]:
    """Per-token scores `(2, n_scored)` float64 of the clean model, then of each variant
    (its edits run as their hooks): row 0 the NLL, row 1 the KL divergence of the variant's
    next-token distribution from the clean model's (from both full logits,
    `CleanDistribution`; 0 for the baseline). One hooked forward per variant and window, the
    reference.

    `reference`: the baseline's passes per window (`clean.Clean` with `logits`), reused;
    `baseline_nll`: the baseline NLL, when only the NLL is wanted (the KL row is then NaN).
    `metric`: what each variant's logits are read as (`metrics.NllKl()`: its `of_logits`)."""
    if progress:
        progress(total=len(variants) * len(wins) + 1)
    kl = baseline_nll is None
    rows: list[list[torch.Tensor]] = [[] for _ in range(len(variants) + 1)]
    start = 0
    for wi, w in enumerate(wins):
        chunk = tokens[:, w.begin : w.end].to(model.cfg.device)  # (1, pos)
        lo = w.offset
        with torch.inference_mode():
            if not kl:
                n = w.end - w.first_target
                base = baseline_nll[start : start + n].double().cpu()
                start += n
                rows[0].append(torch.stack([base, torch.full_like(base, math.nan)]))
            else:
                clean = (reference[wi].logits if reference is not None else
                         model(chunk, return_type="logits")[0, lo - 1 : -1])  # (n, d_vocab)
                base = nll_of(clean, chunk[0, lo:]).cpu()
                rows[0].append(torch.stack([base, torch.zeros_like(base)]))
                clean = CleanDistribution(clean)
            for i, v in enumerate(variants, 1):
                with applied(model, v.hooks()):
                    logits = model(chunk, return_type="logits")[0, lo - 1 : -1]
                rows[i].append(metric.of_logits(logits, chunk[0, lo:], clean if kl else None))
                if progress:
                    progress()
    if progress:
        progress()
    return [torch.cat(r, dim=1) for r in rows]
