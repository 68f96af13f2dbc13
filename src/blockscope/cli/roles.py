"""`blockscope head-roles` and `blockscope attention`: what the heads do."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.common import (
    BosTokenOpt,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    ModelOpt,
    NoOverwriteOpt,
    OutDirOpt,
    PickleOpt,
    PlotOpt,
    PromptArg,
    PromptFileOpt,
    QuietOpt,
    TextFileOpt,
    app,
    checked_load,
    comma_list,
    early_tokens,
    err,
    flag,
    handled,
    model_record,
    out,
    prompt_text,
    sizes_of,
)
from blockscope.cli.output import write
from blockscope.errors import BlockscopeError

AttnBosOpt = Annotated[bool, flag(help="Prepend BOS (see --bos-token), as "
                                          "TransformerLens does by default.")]


@app.command("head-roles")
@handled
def head_roles(
    text: TextFileOpt = Path("data/alice.txt"),
    model: ModelOpt = None,
    max_tokens: Annotated[int | None, typer.Option(
        help="Text tokens for the previous-token score (default 200, or what the model's "
        "context holds after BOS).", show_default=False)] = None,
    n_random: Annotated[int, typer.Option(help="Random tokens, repeated once, for the "
                                          "duplicate-token and induction scores.")] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the random tokens.")] = 0,
    bos_token: BosTokenOpt = None,
    from_prune_heads: Annotated[Path | None, typer.Option(
        help="A prune-heads CSV to join (default: the one for this model and text in "
        "--out-dir, if there).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Score every head as previous-token, duplicate-token and induction head
    (TransformerLens's head detector, "mul" measure), beside prune-heads' importance.

    Example: blockscope head-roles --text data/alice.txt
    """
    import pandas as pd

    from blockscope.experiments import head_roles as experiment

    started = time.perf_counter()
    if n_random < 2:
        raise BlockscopeError(f"--n-random must be at least 2 (got {n_random})")
    if from_prune_heads is not None and not from_prune_heads.is_file():
        raise BlockscopeError(f"--from-prune-heads {from_prune_heads}: no such file")
    def check(sizes):
        top = (sizes["n_ctx"] - 1) // 2  # BOS + twice the random tokens must fit
        if n_random > top:
            raise BlockscopeError(f"--n-random must be between 2 and half the context "
                                  f"({top}), got {n_random}")

    from blockscope.cli.data import corpus_run
    from blockscope.inputs.corpus import Source

    run = corpus_run(Source(text=text, max_tokens=max_tokens or 200), model, device=device,
                     dtype=dtype.value, stride=None, out_dir=out_dir,
                     allow_pickle=allow_pickle, quiet=quiet, check=check,
                     bos_token=bos_token)
    lm, spec = run.model, run.spec
    tokens = run.tokens
    if tokens.shape[-1] > lm.cfg.n_ctx:
        if max_tokens is not None:
            raise BlockscopeError(f"{tokens.shape[-1]} tokens, the model's context is "
                                  f"{lm.cfg.n_ctx:,}: lower --max-tokens")
        tokens = tokens[:, : lm.cfg.n_ctx]  # the default, cut to what the context holds
        if not quiet:
            err.print(f"note: the previous-token score uses the first {lm.cfg.n_ctx:,} "
                      "tokens (the model's context)", highlight=False, soft_wrap=True)
    random_ids = experiment.repeated_random(lm, n_random, seed)
    joined = _prune_heads_csv(from_prune_heads, out_dir, spec, run.passage)  # before work
    df = experiment.role_scores(lm, tokens, random_ids)
    corr = None
    if joined is not None:
        df, corr = experiment.join_importance(df, pd.read_csv(joined))
    tops = {role: experiment.top_heads(df, role) for role in experiment.ROLES}
    if not quiet:
        render_roles(tops, corr, spec.label)
    meta = run.meta(
        "head-roles", measure="mul: attention mass on the detection pattern / total mass "
        "(transformer_lens.head_detector), exclude_bos=False, exclude_current_token=False",
        sequences={"previous_token": tokens[0].tolist(),
                   "duplicate_token and induction": random_ids[0].tolist()},
        n_random=n_random, seed=seed, joined_prune_heads=None if joined is None else str(joined),
        spearman=corr, top5={r: [f"{layer}.{head}" for layer, head, _ in t]
                             for r, t in tops.items()},
        wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"head-roles-{spec.slug}-{run.passage.path.stem}"
    extra = {}
    if plot:
        from blockscope.results.plots import head_roles_plot

        extra[f"{stem}.png"] = head_roles_plot(df, experiment.ROLES, lm.cfg.n_layers,
                                               lm.cfg.n_heads, f"{spec.label}: head roles")
    write(run.out_dir, stem, {"": df}, meta, quiet, extra)


def _prune_heads_csv(explicit: Path | None, out_dir: Path, spec, passage) -> Path | None:
    """The prune-heads CSV to join: the one given (refused if its sidecar names another
    model or text), else the newest one in out_dir for this model and text, if any."""
    import re

    if explicit is not None:
        if _same_run(explicit, spec, passage):
            return explicit
        raise BlockscopeError(f"--from-prune-heads {explicit} was not made with {spec.name} "
                              f"on {passage.path.name} (by its sidecar)")
    name = re.compile(re.escape(f"prune-heads-{spec.slug}-{passage.path.stem}")
                      + r"(-mean)?-[0-9a-f]{8}\.csv")
    found = [p for p in Path(out_dir).glob("prune-heads-*.csv") if name.fullmatch(p.name)]
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        if _same_run(path, spec, passage):
            out.print(f"joining {path}", highlight=False, soft_wrap=True)
            return path
    return None


def _same_run(csv: Path, spec, passage) -> bool:
    """Whether the prune-heads sidecar beside `csv` names this model and this text."""
    try:
        meta = json.loads(csv.with_suffix(".json").read_text(encoding="utf-8"))
        return meta["model"]["name"] == spec.name and meta["text"]["sha256"] == passage.sha256
    except (OSError, ValueError, KeyError, TypeError):
        return False


def render_roles(tops: dict, corr: dict | None, name: str) -> None:
    from rich.table import Table

    t = Table(title=f"{name}: top heads per role (layer.head score)")
    t.add_column("role", overflow="fold")
    for i in range(max(len(v) for v in tops.values())):
        t.add_column(f"#{i + 1}", justify="right", overflow="fold")
    for role, heads in tops.items():
        t.add_row(role.replace("_", " "), *[f"{layer}.{head} {s:.2f}" for layer, head, s in heads])
    out.print(t)
    if corr:
        out.print("Spearman correlation of role score with importance: " + ", ".join(
            f"{k} {v:+.2f}" for k, v in corr.items()), highlight=False, soft_wrap=True)


@app.command()
@handled
def attention(
    prompt: PromptArg = None,
    text: PromptFileOpt = None,
    model: ModelOpt = None,
    layer: Annotated[str, typer.Option(help="Layers, e.g. 0 or 0,5 (0-based).")] = "0",
    head: Annotated[str | None, typer.Option(help="Heads, e.g. 1,7 (default: all).")] = None,
    prepend_bos: AttnBosOpt = True,
    bos_token: BosTokenOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """The attention patterns of chosen heads on a prompt: a heatmap grid, each query's
    top-3 keys, and a long CSV.

    Example: blockscope attention "The capital of France is" --layer 5 --head 1,5
    """
    from blockscope.experiments import attention as experiment
    from blockscope.inputs.text import tokenize
    from blockscope.model.loading import spec_for
    from blockscope.results.files import check_out_dir

    started = time.perf_counter()
    layers = comma_list(layer, "layer", int) or []
    if not layers:
        raise BlockscopeError("--layer needs at least one layer")
    heads = comma_list(head, "head", int)
    prompt_str, source = prompt_text(prompt, text)
    spec = spec_for(model, device=device, dtype=dtype.value, bos_token=bos_token)
    out_path = check_out_dir(out_dir)
    early_tokens(spec, prompt_str, prepend_bos)
    lm = checked_load(spec, allow_pickle, quiet,
                      lambda sizes: experiment.check_heads(sizes, layers, heads))
    heads = experiment.check_heads(sizes_of(lm), layers, heads)
    tokens = tokenize(lm.tokenizer, prompt_str, prepend_bos=prepend_bos)
    if tokens.shape[-1] > lm.cfg.n_ctx:
        raise BlockscopeError(f"{tokens.shape[-1]} tokens, the model's context is "
                              f"{lm.cfg.n_ctx:,}")
    df = experiment.attention_table(lm, tokens, layers=layers, heads=heads)
    if not quiet:
        render_attention(df, experiment, spec.label)
    meta = {"command": "attention", "model": model_record(spec, lm), "text": source,
            "tokens": tokens[0].tolist(), "prepend_bos": prepend_bos, "layers": layers,
            "heads": heads, "dtype": spec.dtype, "device": spec.device,
            "read_at": "blocks.<layer>.attn.hook_pattern (each query head's own pattern)",
            "wall_time_s": round(time.perf_counter() - started, 3)}
    from blockscope.results.files import sidecar

    meta = sidecar(**meta)
    digest = hashlib.sha256(json.dumps([tokens[0].tolist(), layers, heads],
                                    allow_nan=False).encode())
    stem = f"attention-{spec.slug}-{digest.hexdigest()[:8]}"
    extra = {}
    if plot:
        from blockscope.results.plots import attention_plot

        extra[f"{stem}.png"] = attention_plot(df, f"{spec.label}: attention on {prompt_str!r}"
                                              [:120])
    write(out_path, stem, {"": df}, meta, quiet, extra)


def render_attention(df, experiment, name: str) -> None:
    from rich.table import Table

    for layer, head in dict.fromkeys(zip(df["layer"], df["head"], strict=True)):
        t = Table(title=f"{name}: layer {layer}, head {head}: top-3 keys per query")
        t.add_column("query", overflow="fold")
        for i in range(3):
            t.add_column(f"#{i + 1}", overflow="fold")
        for query, keys in experiment.top_keys(df, layer, head):
            t.add_row(query, *[f"{k} {w:.2f}" for k, w in keys])
        out.print(t)
