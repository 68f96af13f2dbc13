"""`blockscope norm-placement`: pre-norm against post-norm, at initialization and in training."""

from __future__ import annotations

import time
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.common import (
    NoOverwriteOpt,
    OutDirOpt,
    PlotOpt,
    QuietOpt,
    TextFileOpt,
    app,
    err,
    handled,
    out,
    status,
)
from blockscope.cli.output import write
from blockscope.errors import BlockscopeError


class Tokenizer(str, Enum):
    bytes = "bytes"
    model = "model"


def _int(help_text: str):
    return Annotated[int | None, typer.Option(help=help_text)]


@app.command("norm-placement")
@handled
def norm_placement(
    model: Annotated[str, typer.Option(
        help="Sizes of the init stacks: a preset, config.json, checkpoint dir or cached hub "
        "id. Only its sizes are used; the blocks are GPT-2's.")] = "gpt2",
    n_layers: _int("Override the config's layer count (init stacks).") = None,
    d_model: _int("Override the config's d_model (d_mlp becomes 4 d_model).") = None,
    n_heads: _int("Override the config's head count.") = None,
    text: TextFileOpt = Path("data/alice.txt"),
    max_tokens: Annotated[int, typer.Option(
        help="Tokens of the text the init loss is taken on.")] = 256,
    tokenizer: Annotated[Tokenizer, typer.Option(
        help="bytes (256 symbols) or the --model's own tokenizer.")] = Tokenizer.bytes,
    seeds: Annotated[int, typer.Option(help="Initializations averaged at init.")] = 5,
    seed: Annotated[int, typer.Option(help="First seed (init seeds: seed, seed+1, ...); "
                                      "the training seed.")] = 0,
    train_steps: Annotated[int, typer.Option(help="Steps per training run; 0 skips "
                                             "training.")] = 300,
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up of the runs with "
                                              "warm-up.")] = 100,
    lr: Annotated[float, typer.Option(help="Adam's learning rate after warm-up.")] = 3e-3,
    train_layers: Annotated[int, typer.Option(help="Layers of the trained models.")] = 6,
    train_d_model: Annotated[int, typer.Option(help="d_model of the trained models.")] = 128,
    train_heads: Annotated[int, typer.Option(help="Heads of the trained models.")] = 4,
    batch_size: Annotated[int, typer.Option(help="Sequences per training step.")] = 16,
    seq_len: Annotated[int, typer.Option(help="Tokens per training sequence.")] = 64,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Pre-norm against post-norm: gradient norms per layer at initialization, and small
    models trained with and without a learning-rate warm-up. No weights are downloaded.

    Example: blockscope norm-placement --train-steps 300
    """
    from blockscope.experiments import norm_placement as experiment
    from blockscope.experiments.norm_stack import StackConfig
    from blockscope.inputs.text import read_passage
    from blockscope.results.files import check_out_dir, sidecar
    from blockscope.results.render import progress_bar

    started = time.perf_counter()
    if seeds < 1:
        raise BlockscopeError(f"--seeds must be at least 1 (got {seeds})")
    if max_tokens < 2:
        raise BlockscopeError(f"--max-tokens must be at least 2 (got {max_tokens})")
    tc = experiment.TrainConfig(steps=train_steps, warmup_steps=warmup_steps, lr=lr,
                                batch_size=batch_size, seq_len=seq_len, seed=seed)
    tc.check()
    for name, value in (("n-layers", n_layers), ("d-model", d_model), ("n-heads", n_heads),
                        ("train-layers", train_layers), ("train-d-model", train_d_model),
                        ("train-heads", train_heads)):
        if value is not None and value < 1:
            raise BlockscopeError(f"--{name} must be at least 1 (got {value})")
    passage = read_passage(text)
    out_path = check_out_dir(out_dir)
    config, encode, vocab = _sizes_and_tokens(model, tokenizer)
    init_cfg = StackConfig.from_hf(config, n_layers=n_layers, d_model=d_model, n_heads=n_heads)
    experiment.check_sizes(init_cfg, "norm-placement")
    if tokenizer is Tokenizer.model or init_cfg.d_vocab is None:
        init_cfg = replace(init_cfg, d_vocab=vocab)
    init_cfg = replace(init_cfg, n_ctx=min(init_cfg.n_ctx, max_tokens))  # positions used
    data = encode(passage.text)  # (N,) token ids
    train_cfg = StackConfig.gpt2_shaped(train_layers, train_d_model, train_heads,
                                        n_ctx=max(seq_len, 1), d_vocab=vocab)
    if train_steps:
        experiment.check_sizes(train_cfg, "norm-placement training")
        if data.numel() < seq_len + 2:
            raise BlockscopeError(f"{passage.path}: {data.numel()} tokens, training needs more "
                                  f"than --seq-len + 1 = {seq_len + 1}")
    if data.numel() < 2:
        raise BlockscopeError(f"{passage.path}: gives fewer than 2 tokens")

    total = 4 * seeds + 4 * train_steps  # layouts x inits x seeds, then 4 runs' steps
    with progress_bar(err, total, "init gradients, then training", not quiet) as tick:
        init, trained, summary, claims = experiment.run_all(
            init_cfg, train_cfg, data, tc, max_tokens=max_tokens, seeds=seeds,
            progress=(tick, tick))
    finals = experiment.final_losses(trained) if train_steps else None
    if not quiet:
        render(summary, finals, claims, warmup_steps)
    meta = sidecar(
        command="norm-placement", model=model, tokenizer=tokenizer.value,
        text={"path": str(passage.path), "sha256": passage.sha256},
        init_stack=vars(init_cfg), init_tokens=min(max_tokens, init_cfg.n_ctx, data.numel() - 1),
        seeds=seeds, seed=seed,
        train_stack=vars(train_cfg), train={**vars(tc), "betas": list(tc.betas)},
        blocks="GPT-2's (LayerNorm, learned positions, tanh GELU MLP, tied unembedding); "
               "pre-norm x = x + F(LN(x)) with a final LN, post-norm x = LN(x + F(x)) without",
        init="N(0, 0.02) for every matrix and embedding, biases 0; scaled: the output "
             "projections of attention and MLP N(0, 0.02/sqrt(2 n_layers))",
        grad_norm="Frobenius norm of d(mean next-token loss)/dW at initialization",
        resid_norm="mean over tokens of |x_t| after the block",
        training="Adam, constant lr after a linear warm-up from 0; GPT-2's scaled init; "
                 "the same initial weights and batches for every run; final loss = mean of "
                 "the last 10% of steps",
        claims=claims.to_dict(orient="records"),
        wall_time_s=round(time.perf_counter() - started, 3))
    extra = {}
    if plot:
        from blockscope.results import plots

        extra["norm-placement-init.png"] = plots.norm_init_plot(summary, "gradient norm per "
                                                                "block at initialization")
        if train_steps:
            extra["norm-placement-train.png"] = plots.norm_train_plot(trained, "training loss")
    frames = {"-init": init}
    if train_steps:
        frames["-train"] = trained
    write(out_path, "norm-placement", frames, meta, quiet, extra)


def _sizes_and_tokens(model: str, tokenizer: Tokenizer):
    """The --model's config, an encoder text -> (N,) ids, and its vocabulary size."""
    import torch

    from blockscope.model.loading import load_config

    with status(f"reading the config of {model}", False):
        config = load_config(model)
    if tokenizer is Tokenizer.bytes:
        from blockscope.experiments.norm_placement import byte_ids

        return config, byte_ids, 256
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BlockscopeError(f"--tokenizer model: no tokenizer for {model} here "
                              f"({str(exc).splitlines()[0]})")

    def encode(s):
        return torch.tensor(tok(s, add_special_tokens=False)["input_ids"], dtype=torch.long)

    return config, encode, len(tok)


def render(summary, finals, claims, warmup: int) -> None:
    import pandas as pd

    from blockscope.results.render import table

    keys = [(lay, s) for lay in ("pre", "post") for s in (False, True)]
    grid = summary.pivot_table(index="layer", columns=["layout", "scaled_init"],
                               values="grad_norm", sort=False)
    rows = pd.DataFrame({"layer": grid.index + 1,
                         **{f"{lay}|{s}": grid[(lay, s)] for lay, s in keys}})
    columns = {"layer": ("layer", "d"), **{f"{lay}|{s}": (
        f"{lay}-norm {'scaled' if s else 'unscaled'}", "sig3") for lay, s in keys}}
    out.print(table(rows, columns, title="gradient norm per block at initialization (mean "
                    "over seeds)", caption="three significant figures"))
    if finals:
        rows = pd.DataFrame([{"layout": f"{lay}-norm", "none": finals[(lay, 0)],
                              "warm": finals[(lay, warmup)],
                              "effect": finals[(lay, 0)] - finals[(lay, warmup)]}
                             for lay in ("pre", "post")])
        out.print(table(rows, {"layout": ("layout", "s"), "none": ("no warm-up", ".3f"),
                               "warm": (f"warm-up {warmup}", ".3f"),
                               "effect": ("warm-up effect", "+.3f")},
                        title="training: final loss (mean of the last 10% of steps)"))
    out.print(claims_table(claims))


def claims_table(claims):
    """The article's claims, what was measured, the test, and whether it shows."""
    from blockscope.results.render import table

    shown = claims.assign(shown=claims["shown"].map({True: "yes", False: "NOT shown here"}))
    return table(shown, {c: (c, "s") for c in ("claim", "measured", "test", "shown")},
                 title="the article's claims, measured here")
