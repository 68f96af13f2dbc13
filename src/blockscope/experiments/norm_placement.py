"""Pre-norm against post-norm: gradients at initialization, and training with and without
a learning-rate warm-up (Xiong et al. 2020, "On Layer Normalization in the Transformer
Architecture"). No pretrained weights: every model here is built from a seed.

`at_init` and `train` return DataFrames; `verdicts` sets the article's claims beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.norm_stack import LAYOUTS, WEIGHTS, Stack, StackConfig, init_weights


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
    return init, trained, summary, verdicts(summary, finals, tc.warmup_steps)


def check_sizes(cfg: StackConfig, what: str) -> None:
    """One clear line for sizes no stack can have."""
    for field in ("n_layers", "d_model", "n_heads", "d_mlp"):
        if getattr(cfg, field) is None or getattr(cfg, field) < 1:
            raise BlockscopeError(f"{what}: {field} must be at least 1")
    if cfg.d_model % cfg.n_heads:
        raise BlockscopeError(f"{what}: n_heads {cfg.n_heads} does not divide d_model "
                              f"{cfg.d_model}")


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


@dataclass(frozen=True)
class TrainConfig:
    """How the small models are trained; every run shares seed and batches."""

    steps: int = 300  # optimizer steps per run
    warmup_steps: int = 100  # linear warm-up from 0 to lr (the runs with warm-up)
    lr: float = 3e-3  # Adam's learning rate after warm-up (constant)
    betas: tuple[float, float] = (0.9, 0.98)  # Adam's betas, as Xiong et al.
    batch_size: int = 16  # sequences per step
    seq_len: int = 64  # tokens per sequence (+1 for the target)
    seed: int = 0  # initial weights and batch order

    def check(self) -> None:
        if self.steps < 0:
            raise BadValue(f"`train_steps` must be 0 or more (got {self.steps})")
        if self.warmup_steps < 0:
            raise BadValue(f"`warmup_steps` must be 0 or more (got {self.warmup_steps})")
        if self.steps and self.warmup_steps >= self.steps:
            raise BadValue(f"`warmup_steps` {self.warmup_steps} is not shorter than the run "
                           f"(`train_steps` {self.steps})")
        if not self.lr > 0:
            raise BadValue(f"`lr` must be positive (got {self.lr})")
        if self.batch_size < 1 or self.seq_len < 2:
            raise BadValue("`batch_size` must be at least 1 and `seq_len` at least 2")

    def lr_at(self, step: int, warmup: int) -> float:
        """Learning rate at 0-based `step` of a run with `warmup` warm-up steps."""
        return self.lr * min(1.0, (step + 1) / warmup) if warmup else self.lr


def batches(data: torch.Tensor, tc: TrainConfig) -> torch.Tensor:
    """(steps, batch_size, seq_len + 1) windows of `data` (N,), drawn once from the seed:
    the same batches for every run."""
    if data.numel() < tc.seq_len + 2:
        raise BlockscopeError(f"the text has {data.numel()} tokens: training needs more than "
                              f"--seq-len + 1 = {tc.seq_len + 1}")
    gen = torch.Generator().manual_seed(tc.seed)
    starts = torch.randint(0, data.numel() - tc.seq_len, (tc.steps, tc.batch_size), generator=gen)
    return data[starts[..., None] + torch.arange(tc.seq_len + 1)]


def train(cfg: StackConfig, data: torch.Tensor, tc: TrainConfig, *,
          progress: Callable | None = None) -> pd.DataFrame:
    """Train a pre-norm and a post-norm stack (GPT-2's scaled init), each without and with
    warm-up, on the same batches from the same initial weights. One row per step
    (`kind="step"`), then one per run (`kind="final"`: the mean loss of the last 10%)."""
    check_sizes(cfg, "norm-placement training")
    tc.check()
    if tc.seq_len > cfg.n_ctx:
        raise BadValue(f"`seq_len` {tc.seq_len} is longer than the stack's {cfg.n_ctx} "
                       "positions")
    if not tc.steps:
        return pd.DataFrame(columns=["layout", "warmup_steps", "seed", "step", "lr", "loss",
                                     "kind"])
    xs = batches(data, tc)
    rows = []
    for layout in LAYOUTS:
        for warmup in (0, tc.warmup_steps):
            stack = init_weights(Stack(cfg, layout), scaled=True, seed=tc.seed).train()
            opt = torch.optim.Adam(stack.parameters(), lr=tc.lr, betas=tc.betas)
            losses = []
            for step in range(tc.steps):
                lr = tc.lr_at(step, warmup)
                for group in opt.param_groups:
                    group["lr"] = lr
                loss = stack.loss(xs[step])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                rows.append({"layout": layout, "warmup_steps": warmup, "seed": tc.seed,
                             "step": step, "lr": lr, "loss": losses[-1], "kind": "step"})
                if progress:
                    progress()
            tail = losses[-max(1, tc.steps // 10):]
            rows.append({"layout": layout, "warmup_steps": warmup, "seed": tc.seed,
                         "step": tc.steps, "lr": None, "loss": sum(tail) / len(tail),
                         "kind": "final"})
    return pd.DataFrame(rows)


def final_losses(trained: pd.DataFrame) -> dict[tuple[str, int], float]:
    """(layout, warmup_steps) -> final loss (mean of the last 10% of steps)."""
    f = trained[trained["kind"] == "final"]
    return {(r.layout, int(r.warmup_steps)): float(r.loss) for r in f.itertuples()}


CLOSE = 0.05  # "about the same": within 5% (pre-norm's loss without warm-up vs with)


def verdicts(summary: pd.DataFrame, finals: dict | None, warmup: int) -> pd.DataFrame:
    """Each of the article's claims, what was measured, and whether it shows (each test
    written out in the `test` column). `summary` is `layer_summary(at_init(...))`;
    `finals` is `final_losses(train(...))` or None when training was skipped."""
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
        effect = {lay: finals[(lay, 0)] - finals[(lay, warmup)] for lay in LAYOUTS}
        out += [
            dict(claim="post-norm needs a learning-rate warm-up",
                 measured=f"final loss without warm-up {finals[('post', 0)]:.3f}, with "
                          f"{finals[('post', warmup)]:.3f} (warm-up effect "
                          f"{effect['post']:+.3f}; pre-norm's {effect['pre']:+.3f})",
                 test="warm-up lowers post-norm's final loss, and by more than pre-norm's",
                 shown=effect["post"] > 0 and effect["post"] > effect["pre"]),
            dict(claim="pre-norm can drop the warm-up",
                 measured=f"final loss without warm-up {finals[('pre', 0)]:.3f}, with "
                          f"{finals[('pre', warmup)]:.3f}",
                 test=f"without warm-up within {CLOSE:.0%} of with it, or lower",
                 shown=finals[("pre", 0)] <= finals[("pre", warmup)] * (1 + CLOSE)),
        ]
    return pd.DataFrame(out)


def sidecar_record(init_cfg: StackConfig, train_cfg: StackConfig, tc: TrainConfig) -> dict:
    """What the stacks were and how each figure is measured, for the sidecar."""
    return dict(
        init_stack=vars(init_cfg), train_stack=vars(train_cfg),
        train={**vars(tc), "betas": list(tc.betas)},
        blocks="GPT-2's (LayerNorm, learned positions, tanh GELU MLP, tied unembedding); "
               "pre-norm x = x + F(LN(x)) with a final LN, post-norm x = LN(x + F(x)) without",
        init="N(0, 0.02) for every matrix and embedding, biases 0; scaled: the output "
             "projections of attention and MLP N(0, 0.02/sqrt(2 n_layers))",
        grad_norm="Frobenius norm of d(mean next-token loss)/dW at initialization",
        resid_norm="mean over tokens of |x_t| after the block",
        training="Adam, constant lr after a linear warm-up from 0; GPT-2's scaled init; "
                 "the same initial weights and batches for every run; final loss = mean of "
                 "the last 10% of steps")
