"""`blockscope resid-norm` and `blockscope shapes`: one forward pass on a prompt, read by hooks."""

from __future__ import annotations

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
    app,
    check_context,
    checked_load,
    early_tokens,
    flag,
    handled,
    load,
    model_record,
    out,
    prompt_text,
)
from blockscope.cli.data import (
    ColumnOpt,
    ConfigOpt,
    DatasetOpt,
    NDocsOpt,
    NTokensOpt,
    RevisionOpt,
    SeedOpt,
    ShuffleOpt,
    SplitOpt,
)
from blockscope.cli.output import write
from blockscope.errors import BlockscopeError

ProbeBosOpt = Annotated[
    bool,
    flag(
        help="Prepend BOS (see --bos-token). Off by default here, unlike the perplexity "
        'commands: the article measures its 5-token prompt "The capital of France is" with '
        "no BOS, and a BOS's own huge norm would dominate the stream's picture."
    ),
]


def _setup(prompt, text_file, model, device, dtype, processed, out_dir, bos_token):
    from blockscope.model.loading import spec_for
    from blockscope.results.files import check_out_dir

    text, source = prompt_text(prompt, text_file)
    spec = spec_for(model, device=device, dtype=dtype.value, processed=processed,
                    bos_token=bos_token)
    return text, source, spec, check_out_dir(out_dir)


def _common_meta(spec, model, source, tokens, prepend_bos, started) -> dict:
    return dict(model=model_record(spec, model), text=source, n_tokens=int(tokens.shape[-1]),
                tokens=tokens[0].tolist(), prepend_bos=prepend_bos, dtype=spec.dtype,
                device=spec.device, wall_time_s=round(time.perf_counter() - started, 3))


@app.command("resid-norm")
@handled
def resid_norm(
    prompt: PromptArg = None,
    text: PromptFileOpt = None,
    dataset: DatasetOpt = None,
    config: ConfigOpt = None,
    split: SplitOpt = None,
    column: ColumnOpt = "text",
    revision: RevisionOpt = None,
    n_tokens: NTokensOpt = None,
    n_docs: NDocsOpt = None,
    shuffle: ShuffleOpt = False,
    seed: SeedOpt = 0,
    model: ModelOpt = None,
    position: Annotated[int, typer.Option(help="Token index; negative counts from the end.")] = -1,
    all_positions: Annotated[bool, flag("--all-positions", help="Every token.")] = False,
    prepend_bos: ProbeBosOpt = False,
    bos_token: BosTokenOpt = None,
    processed: Annotated[
        bool,
        flag(
            "--processed/--raw",
            help="TransformerLens compatibility mode (folded layer norms, centred writing "
            "weights) or the raw HF weights.",
        ),
    ] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Length of the residual stream after the embeddings and after every half-block: at
    a prompt's tokens, or its distribution over a corpus (--dataset).

    Example: blockscope resid-norm "The capital of France is"
    """
    from blockscope.experiments.resid_norm import resid_norms
    from blockscope.inputs.text import tokenize
    from blockscope.results.files import sidecar
    from blockscope.results.render import table

    started = time.perf_counter()
    if all_positions and position != -1:
        raise BlockscopeError("give --position or --all-positions, not both")
    if dataset is not None:
        if prompt is not None or text is not None:
            raise BlockscopeError("give a prompt, --text or --dataset, one of them")
        if all_positions or position != -1:
            raise BlockscopeError("--position/--all-positions pick a prompt's tokens; with "
                                  "--dataset every position but each document's first counts")
        from blockscope.cli.data import source_of

        source = source_of(text=None, dataset=dataset, config=config, split=split,
                           column=column, revision=revision, n_tokens=n_tokens, n_docs=n_docs,
                           shuffle=shuffle, seed=seed, prepend_bos=prepend_bos, max_tokens=None)
        return _corpus_norms(source, model, processed=processed, device=device, dtype=dtype,
                             allow_pickle=allow_pickle, out_dir=out_dir, plot=plot, quiet=quiet,
                             started=started, bos_token=bos_token)
    from blockscope.inputs.parallel import world_size

    if world_size() > 1:
        raise BlockscopeError("under torchrun resid-norm splits a --dataset; a prompt runs "
                              "in one process")
    text_, source, spec, out_path = _setup(prompt, text, model, device, dtype, processed, out_dir,
                                           bos_token)
    early = early_tokens(spec, text_, prepend_bos)
    if early is not None and not all_positions:
        from blockscope.experiments.resid_norm import check_positions

        check_positions([position], early.shape[-1])
    lm = load(spec, allow_pickle, quiet)
    tokens = tokenize(lm.tokenizer, text_, prepend_bos=prepend_bos)
    check_context(tokens, lm)
    positions = list(range(tokens.shape[-1])) if all_positions else [position]
    df = resid_norms(lm, tokens, positions=positions)
    from blockscope.model.arch import layout

    lay = layout(lm)
    no_mid = (None if lay.has_mid else f"{lay.family} blocks run attention and MLP in "
              "parallel: the stream has no point between them, so only block outputs are shown")
    if not quiet:
        title = (f"{spec.label}, {'processed' if processed else 'raw'} weights, "
                 f"{'with' if prepend_bos else 'no'} BOS: residual stream norm")
        from blockscope.inputs.text import visible

        shown = df.assign(token=df["token"].map(visible))
        out.print(table(shown, {"after": ("after", "s"), "layer": ("layer (0-based)", "s"),
                             "position": ("pos", "d"),
                             "token": ("token", "s"), "norm": ("L2 norm", ",.1f"),
                             "ratio_to_embed": ("x embeddings", ".1f")}, title=title))
        if no_mid:
            out.print(no_mid, highlight=False, soft_wrap=True)
        last = df[df["position"] == df["position"].max()]
        out.print(f"growth: after block {lm.cfg.n_layers} the norm is "
                  f"{last['ratio_to_embed'].iloc[-1]:,.1f} times the embeddings' "
                  f"({last['norm'].iloc[0]:,.1f} -> {last['norm'].iloc[-1]:,.1f}, position "
                  f"{int(last['position'].iloc[0])})", highlight=False, soft_wrap=True)
    meta = sidecar(command="resid-norm", positions=positions, family=lay.family,
                   mid_points=no_mid or "after each block's attention half (hook_resid_mid)",
                   **_common_meta(spec, lm, source, tokens, prepend_bos, started))
    stem = f"resid-norm-{spec.slug}{'-processed' if processed else ''}"
    stem += "-bos" if prepend_bos else ""
    extra = {}
    if plot:
        from blockscope.results.plots import resid_norm_plot

        shown = text_ if len(text_) <= 40 else text_[:37] + "..."
        extra[f"{stem}.png"] = resid_norm_plot(
            df, f"{spec.label} on {shown!r}: residual stream norm "
            f"({'BOS' if prepend_bos else 'no BOS'}, {'processed' if processed else 'raw'} "
            "weights)")
    write(out_path, stem, {"": df}, meta, quiet, extra=extra)


def _corpus_norms(source, model, *, processed, device, dtype, allow_pickle, out_dir, plot,
                  quiet, started, bos_token) -> None:
    """resid-norm --dataset: the norm's distribution over every token of the corpus."""
    from blockscope.cli.data import corpus_run
    from blockscope.experiments.resid_norm import norm_distribution
    from blockscope.model.arch import layout
    from blockscope.results.render import table

    run = corpus_run(source, model, device=device, dtype=dtype.value, stride=None,
                     out_dir=out_dir, allow_pickle=allow_pickle, quiet=quiet,
                     processed=processed, bos_token=bos_token)
    df = norm_distribution(run.model, run.docs)
    if not run.comm.writes:
        return
    spec, lay = run.spec, layout(run.model)
    if not quiet:
        out.print(table(df, {"after": ("after", "s"), "layer": ("layer (0-based)", "s"),
                             "p10": ("p10", ",.1f"), "median": ("median", ",.1f"),
                             "p90": ("p90", ",.1f"), "median_ratio_to_embed":
                             ("median / embeddings", ".1f")},
                        title=f"{spec.label}, {'processed' if processed else 'raw'} weights: "
                        f"residual stream norm over {int(df.loc[0, 'n_tokens']):,} tokens of "
                        f"{run.name} (each document's first position left out)"))
    meta = run.meta("resid-norm", family=lay.family, statistic="median, 10th and 90th "
                    "percentile (numpy linear interpolation) and mean of the L2 norm over every "
                    "token but each document's first", n_measured=int(df.loc[0, "n_tokens"]),
                    mid_points="after each block's attention half (hook_resid_mid)"
                    if lay.has_mid else f"{lay.family} blocks are parallel: no mid point",
                    weights="processed" if processed else "raw",
                    wall_time_s=round(time.perf_counter() - started, 3))
    stem = (f"resid-norm-{spec.slug}{'-processed' if processed else ''}"
            f"{'-bos' if source.prepend_bos else ''}-{source.stem}")
    extra = {}
    if plot:
        from blockscope.results.plots import resid_norm_band_plot

        extra[f"{stem}.png"] = resid_norm_band_plot(
            df, f"{spec.label} on {run.name}: residual stream norm, median and 10-90th "
            "percentile over tokens")
    write(run.out_dir, stem, {"": df}, meta, quiet, extra=extra)


@app.command()
@handled
def shapes(
    prompt: PromptArg = None,
    text: PromptFileOpt = None,
    model: ModelOpt = None,
    block: Annotated[int, typer.Option(help="Which block to trace (0-based).")] = 0,
    prepend_bos: ProbeBosOpt = False,
    bos_token: BosTokenOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """The shape of every tensor through one block, read from a real forward pass.

    Example: blockscope shapes "The capital of France is" --block 0
    """
    from blockscope.experiments.shapes import block_shapes
    from blockscope.inputs.text import tokenize
    from blockscope.results.files import sidecar
    from blockscope.results.render import table

    started = time.perf_counter()
    text_, source, spec, out_path = _setup(prompt, text, model, device, dtype, False, out_dir,
                                           bos_token)

    def check(sizes):
        if not 0 <= block < sizes["n_layers"]:
            raise BlockscopeError(f"--block must be between 0 and {sizes['n_layers'] - 1} "
                                  f"(0-based; got {block})")

    early_tokens(spec, text_, prepend_bos)
    lm = checked_load(spec, allow_pickle, quiet, check)
    tokens = tokenize(lm.tokenizer, text_, prepend_bos=prepend_bos)
    check_context(tokens, lm)
    df = block_shapes(lm, tokens, block=block)
    if not quiet:
        shown = df.assign(  # a shape is one label, never wrapped; a mismatch says the expected
            matches=df["matches"].map({True: "yes", False: "NO"}),
            shape=[r.shape.replace(" x ", "\u00d7") + ("" if r.matches else
                                                      f" (expected {r.expected})")
                   for r in df.itertuples()])
        out.print(table(shown, {"tensor": ("tensor", "s"), "shape": ("shape", "s"),
                                "dims": ("axes", "s"), "matches": ("as config", "s"),
                                "note": ("what it is", "s")},
                        title=f"{spec.label}, block {block}: {tokens.shape[-1]} tokens "
                        f"(batch of 1 not shown)"))
    meta = sidecar(command="shapes", block=block,
                   **_common_meta(spec, lm, source, tokens, prepend_bos, started))
    write(out_path, f"shapes-{spec.slug}-block{block}", {"": df}, meta, quiet)
