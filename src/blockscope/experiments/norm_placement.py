"""Pre-norm against post-norm: gradients at initialization, and training with and without
a learning-rate warm-up (Xiong et al. 2020, "On Layer Normalization in the Transformer
Architecture"). No pretrained weights: every model here is built from a seed.

`at_init` and `train` return DataFrames; `verdicts` sets the article's claims beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd
import torch

from blockscope.errors import BlockscopeError
from blockscope.experiments.norm_stack import LAYOUTS, WEIGHTS, Stack, StackConfig, init_weights
from blockscope.experiments.norm_training import (  # noqa: F401  (the public face)
    MARGIN,
    TrainConfig,
    batches,
    check_sizes,
    final_losses,
    largest_trainable,
    plateau,
    train,
    training_claims,
    trains,
)


def byte_ids(text: str) -> torch.Tensor:
    """The text as UTF-8 bytes: (N,) ids in 0..255, the default tokenizer here."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def run_all(init_cfg: StackConfig, train_cfg: StackConfig, data: torch.Tensor, tc: TrainConfig,
            *, max_tokens: int, seeds: int, progress=(None, None)):
    """Both halves on `data` (N,) ids: (init rows, training rows, per-layer summary,
    claims). The init loss is on the first `max_tokens` (+1) ids."""
    ids = data[: min(max_tokens, init_cfg.n_ctx) + 1][None]  # (1, T + 1)
    if ids.shape[-1] < 2:
        raise BlockscopeError("the text gives fewer than 2 tokens")
    init = at_init(init_cfg, ids, seeds=range(tc.seed, tc.seed + seeds), progress=progress[0])
    trained = train(train_cfg, data, tc, progress=progress[1])
    summary = layer_summary(init)
    finals = final_losses(trained) if tc.steps else None
    return init, trained, summary, verdicts(summary, finals, tc.warmup_steps,
                                            plateau(data))


def at_init(cfg: StackConfig, ids: torch.Tensor, *, seeds: Sequence[int],
            progress: Callable | None = None) -> pd.DataFrame:
    """Per layout x init x seed x layer x matrix: the gradient norm of the next-token loss
    on `ids` (1, T) at initialization, and the residual norm after that layer's block
    (mean over tokens of |x_t|)."""
    check_sizes(cfg, "norm-placement")
    if ids.shape[-1] - 1 > cfg.n_ctx:
        raise BlockscopeError(f"{ids.shape[-1]} tokens, but the stack has {cfg.n_ctx} positions")
    rows = []
    for layout in LAYOUTS:
        for scaled in (False, True):
            for seed in seeds:
                stack = init_weights(Stack(cfg, layout), scaled=scaled, seed=seed)
                resid: list[torch.Tensor] = []
                stack.loss(ids, resid).backward()
                for layer in range(cfg.n_layers):
                    norm = float(resid[layer].norm(dim=-1).mean())  # (B, T) -> mean
                    grads = stack.weight_grads(layer)
                    rows += [{"layout": layout, "scaled_init": scaled, "seed": seed,
                              "layer": layer, "sublayer": sub, "weight": w,
                              "grad_norm": float(grads[(sub, w)].norm()), "resid_norm": norm}
                             for sub, w in WEIGHTS]
                if progress:
                    progress()
    return pd.DataFrame(rows)


def layer_summary(init: pd.DataFrame) -> pd.DataFrame:
    """Per layout x init x layer, means over seeds: each block's gradient norm (all six
    matrices together: sqrt of the sum of their squares) and residual norm; plus the
    ratio of the last block's gradient norm to the first's."""
    per = (init.assign(sq=init["grad_norm"] ** 2)
           .groupby(["layout", "scaled_init", "seed", "layer"], sort=False)
           .agg(sq=("sq", "sum"), resid_norm=("resid_norm", "first")).reset_index())
    per["grad_norm"] = per["sq"] ** 0.5
    out = (per.groupby(["layout", "scaled_init", "layer"], sort=False)
           [["grad_norm", "resid_norm"]].mean().reset_index())
    first = out.groupby(["layout", "scaled_init"], sort=False)["grad_norm"].transform("first")
    out["grad_vs_first"] = out["grad_norm"] / first
    return out


def verdicts(summary: pd.DataFrame, finals: dict | None, warmup: int,
             plateau_nats: float | None = None) -> pd.DataFrame:
    """Each of the article's claims, what was measured, and whether it shows (each test
    written out in the `test` column). `summary` is `layer_summary(at_init(...))`;
    `finals` is `final_losses(train(...))` or None when training was skipped; a run trains
    when its final loss is MARGIN below `plateau_nats` (`plateau`)."""
    def last(layout, scaled, col):
        rows = summary[(summary["layout"] == layout) & (summary["scaled_init"] == scaled)]
        return float(rows[col].iloc[-1]), float(rows[col].iloc[0])

    ratio = {(lay, s): last(lay, s, "grad_vs_first")[0] for lay in LAYOUTS for s in (False, True)}
    growth = {s: (lambda a: a[0] / a[1])(last("pre", s, "resid_norm")) for s in (False, True)}
    out = [
        dict(claim="post-norm: gradients near the output are large at initialization",
             measured=f"last/first block gradient norm, post-norm {ratio[('post', False)]:.2f} "
                      f"(unscaled init), {ratio[('post', True)]:.2f} (GPT-2 init); pre-norm "
                      f"{ratio[('pre', False)]:.2f}, {ratio[('pre', True)]:.2f}",
             test="post-norm's ratio > 1 and > pre-norm's, under both inits",
             shown=all(ratio[("post", s)] > max(1.0, ratio[("pre", s)]) for s in (False, True))),
        dict(claim="pre-norm: gradients are well-behaved at initialization",
             measured=f"last/first block gradient norm, pre-norm {ratio[('pre', False)]:.2f} "
                      f"(unscaled init), {ratio[('pre', True)]:.2f} (GPT-2 init)",
             test="pre-norm's ratio between 0.5 and 2 under both inits",
             shown=all(0.5 <= ratio[("pre", s)] <= 2 for s in (False, True))),
        dict(claim="GPT-2's 1/sqrt(N) init of the stream writes accounts for the "
                   "accumulation on the residual path",
             measured=f"pre-norm residual norm, last block / first block: {growth[False]:.2f} "
                      f"unscaled, {growth[True]:.2f} scaled",
             test="the growth is smaller with the scaled init",
             shown=growth[True] < growth[False]),
    ]
    if finals:
        out += training_claims(finals, warmup, plateau_nats)
    return pd.DataFrame(out)


def sidecar_record(init_cfg: StackConfig, train_cfg: StackConfig, tc: TrainConfig) -> dict:
    """What the stacks were and how each figure is measured, for the sidecar."""
    return dict(
        init_stack=vars(init_cfg), train_stack=vars(train_cfg),
        train={**vars(tc), "betas": list(tc.betas), "lrs": list(tc.lrs)},
        blocks="GPT-2's (LayerNorm, learned positions, tanh GELU MLP, tied unembedding); "
               "pre-norm x = x + F(LN(x)) with a final LN, post-norm x = LN(x + F(x)) without",
        init="N(0, 0.02) for every matrix and embedding, biases 0; scaled: the output "
             "projections of attention and MLP N(0, 0.02/sqrt(2 n_layers))",
        grad_norm="Frobenius norm of d(mean next-token loss)/dW at initialization",
        resid_norm="mean over tokens of |x_t| after the block",
        training="Adam, constant lr after a linear warm-up from 0; GPT-2's scaled init; "
                 "the same initial weights and batches for every run at every rate; final "
                 "loss = mean of the last 10% of steps (NaN: a step's loss was not finite)",
        trains=f"final loss below the unigram plateau (the entropy of the text's token "
               f"frequencies) by at least {MARGIN} nats; a diverged run does not train",
        unembedding="tied to the token embedding" if tc.tie else "its own matrix (untied)")
