"""`blockscope norm-placement`: pre-norm against post-norm, at initialization and in training."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err, status
from blockscope.api.options import Options, Output, at_least, comma_list, flag, group, within
from blockscope.api.output import write
from blockscope.api.text_options import TextFileOpt
from blockscope.errors import BadValue, BlockscopeError


class Tokenizer(str, Enum):
    bytes = "bytes"
    model = "model"


def _int(help_text: str):
    return Annotated[int | None, typer.Option(help=help_text)]


def _opt(kind, help_text: str):
    return Annotated[kind, typer.Option(help=help_text)]


@dataclass
class NormPlacement(Options):
    name: ClassVar[str] = "norm-placement"
    model: Annotated[str, typer.Option(
        help="Sizes of the init stacks: a preset, config.json, checkpoint dir or cached hub "
        "id. Only its sizes are used; the blocks are GPT-2's.")] = "gpt2"
    n_layers: _int("Override the config's layer count (init stacks).") = None
    d_model: _int("Override the config's d_model (d_mlp becomes 4 d_model).") = None
    n_heads: _int("Override the config's head count.") = None
    text: TextFileOpt = Path("data/alice.txt")
    max_tokens: _opt(int, "Tokens of the text the init loss is taken on.") = 256
    tokenizer: _opt(Tokenizer, "bytes (256 symbols) or the --model's own tokenizer."
                    ) = Tokenizer.bytes
    seeds: _opt(int, "Initializations averaged at init.") = 5
    seed: _opt(int, "First seed (init seeds: seed, seed+1, ...); the training seed.") = 0
    train_steps: _opt(int, "Steps per training run; 0 skips training.") = 300
    warmup_steps: _opt(int, "Linear warm-up of the runs with warm-up.") = 100
    lr: _opt(str, "Adam's learning rates after warm-up, comma-separated: every layout and "
             "warm-up trains at each.") = "3e-4,1e-3,3e-3"
    tie: Annotated[bool, flag(help="Tie the unembedding to the token embedding (GPT-2's "
                              "choice), or give it its own matrix.")] = True
    train_layers: _opt(int, "Layers of the trained models.") = 4
    train_d_model: _opt(int, "d_model of the trained models.") = 96
    train_heads: _opt(int, "Heads of the trained models.") = 4
    batch_size: _opt(int, "Sequences per training step.") = 16
    seq_len: _opt(int, "Tokens per training sequence.") = 64
    out: Output = group(Output)

    def check(self) -> None:
        within(1, 1000, seeds=self.seeds)
        within(0, 1_000_000, train_steps=self.train_steps, warmup_steps=self.warmup_steps)
        within(1, 8192, seq_len=self.seq_len, batch_size=self.batch_size)
        within(2, 1_000_000, max_tokens=self.max_tokens)
        self.train().check()
        at_least(1, n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                 train_layers=self.train_layers, train_d_model=self.train_d_model,
                 train_heads=self.train_heads)

    def train(self):
        from blockscope.experiments.norm_placement import TrainConfig

        return TrainConfig(steps=self.train_steps, warmup_steps=self.warmup_steps,
                           lrs=tuple(dict.fromkeys(comma_list(self.lr, "lr"))),
                           batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed,
                           tie=self.tie)


@command
def norm_placement(o: NormPlacement):
    """Pre-norm against post-norm: gradient norms per layer at initialization, and small
    models trained with and without a learning-rate warm-up. No weights are downloaded.

    Example: blockscope norm-placement --train-steps 300
    """
    from blockscope.experiments import norm_placement as experiment
    from blockscope.inputs.text import read_passage
    from blockscope.results.progress import progress_bar

    started = time.perf_counter()
    tc, passage = o.train(), read_passage(o.text)
    init_cfg, train_cfg, data = stacks(o, passage)
    plateau = experiment.plateau(data)  # the loss a context-blind model reaches
    total = 4 * o.seeds + 4 * len(tc.lrs) * o.train_steps  # layouts x inits x seeds, then
    #   every run's steps (layouts x warm-ups x rates)
    with progress_bar(err, total, "init gradients, then training", not o.out.quiet,
                      o.out.reporter) as tick:
        init, trained, summary, claims = experiment.run_all(
            init_cfg, train_cfg, data, tc, max_tokens=o.max_tokens, seeds=o.seeds,
            progress=(tick, tick))
    finals = experiment.final_losses(trained) if o.train_steps else None
    meta = experiment.sidecar_record(init_cfg, train_cfg, tc)
    meta.update(command="norm-placement", model=o.model, tokenizer=o.tokenizer.value,
                text={"path": passage.where, "sha256": passage.sha256},
                init_tokens=min(o.max_tokens, init_cfg.n_ctx, data.numel() - 1),
                seeds=o.seeds, seed=o.seed, claims=claims.to_dict(orient="records"),
                plateau_nats=plateau,
                wall_time_s=round(time.perf_counter() - started, 3))
    from blockscope.results.files import sidecar

    extra = {}
    if o.out.plot:
        from blockscope.results import norm_plots as plots

        extra["norm-placement-init.png"] = plots.norm_init_plot(summary, "gradient norm per "
                                                                "block at initialization")
        if o.train_steps:
            extra["norm-placement-train.png"] = plots.norm_train_plot(
                trained, "final training loss against the learning rate")
    frames = {"-init": init, **({"-train": trained} if o.train_steps else {})}
    return write(o, "norm-placement", frames, sidecar(**meta), extra,
                 shown=render(summary, finals, claims, o.warmup_steps, plateau))


def stacks(o: NormPlacement, passage):
    """The init stack (the --model's sizes, overridden), the trained stack, and the text's
    token ids (N,), with sizes and lengths no run can have refused."""
    from blockscope.experiments import norm_placement as experiment
    from blockscope.experiments.norm_stack import StackConfig

    config, encode, vocab = _sizes_and_tokens(o.model, o.tokenizer)
    init_cfg = StackConfig.from_hf(config, n_layers=o.n_layers, d_model=o.d_model,
                                   n_heads=o.n_heads)
    experiment.check_sizes(init_cfg, "norm-placement")
    if o.tokenizer is Tokenizer.model or init_cfg.d_vocab is None:
        init_cfg = replace(init_cfg, d_vocab=vocab)
    init_cfg = replace(init_cfg, n_ctx=min(init_cfg.n_ctx, o.max_tokens))  # positions used
    data = encode(passage.text)  # (N,) token ids
    train_cfg = StackConfig.gpt2_shaped(o.train_layers, o.train_d_model, o.train_heads,
                                        n_ctx=max(o.seq_len, 1), d_vocab=vocab)
    if o.train_steps:
        experiment.check_sizes(train_cfg, "norm-placement training")
        if data.numel() < o.seq_len + 2:
            raise BadValue(f"{passage.path}: {data.numel()} tokens, training needs more "
                                  f"than `seq_len` + 1 = {o.seq_len + 1}")
    if data.numel() < 2:
        raise BlockscopeError(f"{passage.path}: gives fewer than 2 tokens")
    return init_cfg, train_cfg, data


def _sizes_and_tokens(model: str, tokenizer: Tokenizer):
    """The --model's config, an encoder text -> (N,) ids, and its vocabulary size."""
    import torch

    from blockscope.model.configs import load_config
    from blockscope.model.peek import local_tokenizer

    with status(f"reading the config of {model}", False):
        config = load_config(model)
    if tokenizer is Tokenizer.bytes:
        from blockscope.experiments.norm_placement import byte_ids

        return config, byte_ids, 256
    tok = local_tokenizer(model)

    def encode(s):
        return torch.tensor(tok(s, add_special_tokens=False)["input_ids"], dtype=torch.long)

    return config, encode, len(tok)


def render(summary, finals, claims, warmup: int, plateau: float) -> list:
    import pandas as pd

    from blockscope.experiments.norm_placement import MARGIN
    from blockscope.results.render import table

    said = []
    keys = [(lay, s) for lay in ("pre", "post") for s in (False, True)]
    grid = summary.pivot_table(index="layer", columns=["layout", "scaled_init"],
                               values="grad_norm", sort=False)
    rows = pd.DataFrame({"layer": grid.index,  # blocks count from 0, as the CSV
                         **{f"{lay}|{s}": grid[(lay, s)] for lay, s in keys}})
    columns = {"layer": ("layer", "d"), **{f"{lay}|{s}": (
        f"{lay}-norm {'scaled' if s else 'unscaled'}", "sig3") for lay, s in keys}}
    said.append(table(rows, columns, title="gradient norm per block at initialization (mean "
                    "over seeds)", caption="three significant figures; layers from 0"))
    if finals:
        lrs = sorted({lr for _, _, lr in finals})
        rows = pd.DataFrame([{"run": f"{lay}-norm, warm-up {w}",
                              **{f"{lr:g}": finals[(lay, w, lr)] for lr in lrs}}
                             for lay in ("pre", "post") for w in (0, warmup)])
        said.append(table(rows, {"run": ("layout, warm-up", "s"),
                               **{f"{lr:g}": (f"lr {lr:g}", ".3f") for lr in lrs}},
                        title="training: final loss (mean of the last 10% of steps) at each "
                        "learning rate",
                        caption=f"unigram plateau {plateau:.3f}; a run trains below "
                        f"{plateau - MARGIN:.3f}; nan: diverged"))
    from blockscope.results.render import claims_table

    said.append(claims_table(claims))
    return said


