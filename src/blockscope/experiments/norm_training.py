"""Training the pre- and post-norm stacks on a learning-rate grid, each with and without a
warm-up (Xiong et al. 2020; Liu et al. 2020): the same initial weights and batches for every
run, deterministic on the CPU; which runs train (MARGIN below the unigram plateau), and the
two training claims stated on the grid."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.norm_stack import LAYOUTS, Stack, StackConfig, init_weights


def check_sizes(cfg: StackConfig, what: str) -> None:
    """One clear line for sizes no stack can have."""
    for field in ("n_layers", "d_model", "n_heads", "d_mlp"):
        if getattr(cfg, field) is None or getattr(cfg, field) < 1:
            raise BlockscopeError(f"{what}: {field} must be at least 1")
    if cfg.d_model % cfg.n_heads:
        raise BlockscopeError(f"{what}: n_heads {cfg.n_heads} does not divide d_model "
                              f"{cfg.d_model}")
    params = cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_mlp)
    if params > MAX_PARAMS:
        raise BlockscopeError(f"{what}: {cfg.n_layers} layers of d_model {cfg.d_model} are "
                              f"{params:,} parameters in the blocks, more than the "
                              f"{MAX_PARAMS:,} a CPU run of these stacks is sized for")


MAX_PARAMS = 2_000_000_000  # a stack's block parameters: 8 GB in float32, and its gradients


@dataclass(frozen=True)
class TrainConfig:
    """How the small models are trained; every run shares seed and batches."""

    steps: int = 300  # optimizer steps per run
    warmup_steps: int = 100  # linear warm-up from 0 to lr (the runs with warm-up)
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)  # Adam's learning rates after warm-up
    #   (constant), each run by every layout x warm-up: a half-decade grid
    betas: tuple[float, float] = (0.9, 0.98)  # Adam's betas, as Xiong et al.
    batch_size: int = 16  # sequences per step
    seq_len: int = 64  # tokens per sequence (+1 for the target)
    seed: int = 0  # initial weights and batch order
    tie: bool = True  # the unembedding tied to the token embedding (GPT-2, the 2017 model)

    def check(self) -> None:
        if self.steps < 0:
            raise BadValue(f"`train_steps` must be 0 or more (got {self.steps})")
        if self.warmup_steps < 0:
            raise BadValue(f"`warmup_steps` must be 0 or more (got {self.warmup_steps})")
        if self.steps and self.warmup_steps >= self.steps:
            raise BadValue(f"`warmup_steps` {self.warmup_steps} is not shorter than the run "
                           f"(`train_steps` {self.steps})")
        if not self.lrs or not all(lr > 0 for lr in self.lrs):
            raise BadValue(f"`lr` takes one or more positive rates (got "
                           f"{','.join(map(str, self.lrs)) or 'none'})")
        if self.batch_size < 1 or self.seq_len < 2:
            raise BadValue("`batch_size` must be at least 1 and `seq_len` at least 2")

    def lr_at(self, step: int, warmup: int, lr: float) -> float:
        """Learning rate at 0-based `step` of a run at peak `lr` with `warmup` warm-up
        steps."""
        return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def batches(data: torch.Tensor, tc: TrainConfig) -> torch.Tensor:
    """(steps, batch_size, seq_len + 1) windows of `data` (N,), drawn once from the seed:
    the same batches for every run."""
    if data.numel() < tc.seq_len + 2:
        raise BadValue(f"the text has {data.numel()} tokens: training needs more than "
                              f"`seq_len` + 1 = {tc.seq_len + 1}")
    gen = torch.Generator().manual_seed(tc.seed)
    starts = torch.randint(0, data.numel() - tc.seq_len, (tc.steps, tc.batch_size), generator=gen)
    return data[starts[..., None] + torch.arange(tc.seq_len + 1)]


def train(cfg: StackConfig, data: torch.Tensor, tc: TrainConfig, *,
          progress: Callable | None = None) -> pd.DataFrame:
    """Train a pre-norm and a post-norm stack (GPT-2's scaled init), each without and with
    warm-up, at each learning rate of the grid, on the same batches from the same initial
    weights. One row per step (`kind="step"`), then one per run (`kind="final"`: the mean
    loss of the last 10%; NaN once a step's loss is not finite: the run diverged)."""
    check_sizes(cfg, "norm-placement training")
    tc.check()
    if tc.seq_len > cfg.n_ctx:
        raise BadValue(f"`seq_len` {tc.seq_len} is longer than the stack's {cfg.n_ctx} "
                       "positions")
    if not tc.steps:
        return pd.DataFrame(columns=["layout", "warmup_steps", "peak_lr", "seed", "step", "lr",
                                     "loss", "kind"])
    xs = batches(data, tc)
    rows = []
    for peak in tc.lrs:
        for layout in LAYOUTS:
            for warmup in (0, tc.warmup_steps):
                run = {"layout": layout, "warmup_steps": warmup, "peak_lr": peak,
                       "seed": tc.seed}
                losses = _run(cfg, layout, warmup, peak, xs, tc, progress)
                rows += [{**run, "step": step, "lr": tc.lr_at(step, warmup, peak), "loss": v,
                          "kind": "step"} for step, v in enumerate(losses)]
                tail = losses[-max(1, tc.steps // 10):]
                final = sum(tail) / len(tail) if all(map(math.isfinite, losses)) else math.nan
                rows.append({**run, "step": tc.steps, "lr": None, "loss": final,
                             "kind": "final"})
    df = pd.DataFrame(rows)
    df.attrs.update(plateau=plateau(data), margin=MARGIN)  # what "trains" is measured by
    return df


def _run(cfg, layout: str, warmup: int, peak: float, xs: torch.Tensor, tc: TrainConfig,
         progress) -> list[float]:
    """One training run's loss per step (a diverged run's steps past the first non-finite
    loss are NaN: not trained further)."""
    stack = init_weights(Stack(cfg, layout, tie=tc.tie), scaled=True, seed=tc.seed).train()
    opt = torch.optim.Adam(stack.parameters(), lr=peak, betas=tc.betas)
    losses: list[float] = []
    for step in range(tc.steps):
        if losses and not math.isfinite(losses[-1]):
            losses.append(math.nan)
        else:
            for group in opt.param_groups:
                group["lr"] = tc.lr_at(step, warmup, peak)
            loss = stack.loss(xs[step])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        if progress:
            progress()
    return losses


def final_losses(trained: pd.DataFrame) -> dict[tuple[str, int, float], float]:
    """(layout, warmup_steps, peak_lr) -> final loss (mean of the last 10% of steps; NaN:
    the run diverged)."""
    f = trained[trained["kind"] == "final"]
    return {(r.layout, int(r.warmup_steps), float(r.peak_lr)): float(r.loss)
            for r in f.itertuples()}


MARGIN = 0.3  # a run "trains" when its final loss is at least this far (nats) below the
#   unigram plateau, the loss of predicting each token by its frequency alone


def plateau(data: torch.Tensor) -> float:
    """The unigram plateau of token ids `data` (N,): the entropy (nats) of their
    frequencies, what a model that ignores the context reaches at best."""
    counts = torch.bincount(data).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def trains(loss: float, plateau_nats: float) -> bool:
    """Whether a final loss is clearly below the plateau (NaN, a diverged run: no)."""
    return math.isfinite(loss) and loss < plateau_nats - MARGIN


def largest_trainable(finals: dict, layout: str, warmup: int, plateau_nats: float
                      ) -> float | None:
    """The largest learning rate at which `layout` with `warmup` trains; None if none."""
    ok = [lr for (lay, w, lr), loss in finals.items()
          if lay == layout and w == warmup and trains(loss, plateau_nats)]
    return max(ok) if ok else None


def training_claims(finals: dict, warmup: int, plateau_nats: float) -> list[dict]:
    """The two training claims, stated on the learning-rate grid (Xiong et al.; Liu et al.
    2020): by the largest rate at which each layout x warm-up trains."""
    lrs = sorted({lr for _, _, lr in finals})
    top = {(lay, w): largest_trainable(finals, lay, w, plateau_nats)
           for lay in LAYOUTS for w in (0, warmup)}

    def rate(v):
        return "none" if v is None else f"{v:g}"

    def losses(lay, w):
        return ", ".join(f"{finals[(lay, w, lr)]:.2f}" for lr in lrs)

    ok = {(lay, w): {lr for lr in lrs if trains(finals[(lay, w, lr)], plateau_nats)}
          for lay in LAYOUTS for w in (0, warmup)}
    post_ok = ", ".join(f"{lr:g}" for lr in sorted(ok[("post", warmup)])) or "none"
    band = f"trains: final loss below the unigram plateau {plateau_nats:.2f} - {MARGIN}"
    grid = f"at lr {', '.join(f'{lr:g}' for lr in lrs)}"
    return [
        dict(claim="post-norm needs a learning-rate warm-up at large learning rates",
             measured=f"largest rate that trains, post-norm: {rate(top[('post', 0)])} "
                      f"without warm-up, {rate(top[('post', warmup)])} with; final losses "
                      f"{grid}: {losses('post', 0)} without, {losses('post', warmup)} with",
             test=f"post-norm's largest trainable rate is smaller without warm-up than with "
                  f"it ({band})",
             shown=top[("post", warmup)] is not None
             and (top[("post", 0)] or 0) < top[("post", warmup)]),
        dict(claim="pre-norm can drop the warm-up",
             measured=f"pre-norm without warm-up trains at {rate(top[('pre', 0)])} and "
                      f"below (final losses {grid}: {losses('pre', 0)}); post-norm with "
                      f"warm-up at {post_ok}",
             test="pre-norm without warm-up trains at every rate where post-norm with warm-up "
                  f"does, and that is at least one ({band})",
             shown=bool(ok[("post", warmup)]) and ok[("post", warmup)] <= ok[("pre", 0)]),
    ]
