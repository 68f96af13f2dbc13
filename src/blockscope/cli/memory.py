"""`blockscope mlp-memory`: the MLP neurons that write the answer, as keys and values."""

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
    QuietOpt,
    app,
    early_tokens,
    flag,
    handled,
    load,
    model_record,
    out,
    prompt_text,
)
from blockscope.cli.data import ColumnOpt, ConfigOpt, DatasetOpt, NDocsOpt, NTokensOpt, SplitOpt
from blockscope.cli.output import write
from blockscope.cli.prompts import pick_positions
from blockscope.errors import BlockscopeError


@app.command("mlp-memory")
@handled
def mlp_memory(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    text: Annotated[Path | None, typer.Option(
        "--text", "-t", help="A UTF-8 passage to find each neuron's keys in: the contexts "
        "that trigger it most.", show_default=False)] = None,
    dataset: DatasetOpt = None,
    config: ConfigOpt = None,
    split: SplitOpt = None,
    column: ColumnOpt = "text",
    n_tokens: NTokensOpt = None,
    n_docs: NDocsOpt = None,
    n_examples: Annotated[int, typer.Option(help="Trigger contexts per neuron.")] = 5,
    target: Annotated[str | None, typer.Option(
        help="The token followed (one token, e.g. ' Paris'). Default: the model's own top-1.",
        show_default=False)] = None,
    contrast: Annotated[str | None, typer.Option(
        help="Follow the logit difference target - contrast.", show_default=False)] = None,
    position: Annotated[int, typer.Option(help="Token index; negative counts from the end.")
                        ] = -1,
    n_layers: Annotated[int, typer.Option(help="MLP layers shown: those writing most "
                                          "toward the target.")] = 3,
    per_layer: Annotated[int, typer.Option(help="Neurons per layer.")] = 5,
    top_k: Annotated[int, typer.Option(help="Tokens a neuron's write promotes and "
                                       "suppresses.")] = 5,
    method: Annotated[str, typer.Option(help="How the chosen neurons are removed for the "
                                        "check: zero, or mean (over the prompt).")] = "zero",
    prepend_bos: Annotated[bool, flag(help="Prepend BOS (see --bos-token).")] = True,
    bos_token: BosTokenOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """The MLP as a key-value memory (Geva et al.): the neurons whose activation x value
    adds most to the target's logit, what their writes promote, and what removing them does.

    Example: blockscope mlp-memory "The capital of France is" --target " Paris"
    """
    from blockscope.experiments import logit_lens
    from blockscope.experiments import mlp_memory as experiment
    from blockscope.inputs.text import tokenize
    from blockscope.model.loading import spec_for
    from blockscope.results.files import check_out_dir, sidecar

    started = time.perf_counter()
    for name, value in (("--n-layers", n_layers), ("--per-layer", per_layer),
                        ("--top-k", top_k), ("--n-examples", n_examples)):
        if value < 1:
            raise BlockscopeError(f"{name} must be at least 1 (got {value})")
    if method not in ("zero", "mean"):
        raise BlockscopeError(f"--method must be zero or mean (got {method!r})")
    text_, source = prompt_text(prompt, None)
    spec = spec_for(model, device=device, dtype=dtype.value, bos_token=bos_token)
    out_path = check_out_dir(out_dir)
    early = early_tokens(spec, text_, prepend_bos)
    if early is not None:
        pick_positions(early.shape[-1], position, False)
    run = None
    if text is not None or dataset is not None:  # the keys' corpus, read once loaded
        from blockscope.cli.data import corpus_run, source_of

        corpus = source_of(text=text, dataset=dataset, config=config, split=split,
                           column=column, revision=None, n_tokens=n_tokens, n_docs=n_docs,
                           shuffle=False, seed=0, prepend_bos=prepend_bos, max_tokens=None)
        run = corpus_run(corpus, model, device=device, dtype=dtype.value, stride=None,
                         out_dir=out_dir, allow_pickle=allow_pickle, quiet=quiet,
                         bos_token=bos_token)
    lm = run.model if run is not None else load(spec, allow_pickle, quiet)
    tokens = tokenize(lm.tokenizer, text_, prepend_bos=prepend_bos)
    (pos,) = pick_positions(tokens.shape[-1], position, False)
    if target is None:
        wanted = int(logit_lens.lens(lm, tokens, positions=[pos], k=1)["target_id"].iloc[-1])
    else:
        wanted = logit_lens.target_id(lm.tokenizer, target)
    against = None if contrast is None else logit_lens.target_id(lm.tokenizer, contrast,
                                                                  "--contrast")
    layers, df = experiment.neurons(lm, tokens, position=pos, target=wanted, contrast=against,
                                    n_layers=n_layers, per_layer=per_layer, k=top_k,
                                    method=method)
    label = lm.tokenizer.decode([wanted])
    keys = None
    if run is not None:
        picks = [(int(r.layer), int(r.neuron), 1.0 if r.activation >= 0 else -1.0)
                 for r in df.itertuples()]
        keys = experiment.triggers(lm, run.docs, picks, n_examples=n_examples)
    if not quiet:
        render(layers, df, spec.label, label, keys)
    meta = sidecar(command="mlp-memory", model=model_record(spec, lm), text=source,
                   tokens=tokens[0].tolist(), prepend_bos=prepend_bos, position=pos,
                   target=label, contrast=contrast, removal=df.attrs,
                   keys=None if run is None else {
                       "corpus": run.docs.record, "n_examples": n_examples,
                       "read": "every document's tokens but its first, each position once, "
                       "ranked by activation x the sign it has on the prompt"},
                   contribution="activation x the value's direct logit, through the final "
                   "norm with its scale frozen at the clean pass (as logit-lens)",
                   dtype=spec.dtype, device=spec.device,
                   wall_time_s=round(time.perf_counter() - started, 3))
    frames = {"": df, "-layers": layers, **({} if keys is None else {"-keys": keys})}
    stem = f"mlp-memory-{spec.slug}"
    extra = {}
    if plot:
        from blockscope.results.mlp_plots import memory_plot

        extra[f"{stem}.png"] = memory_plot(df, keys, f"{spec.label}: the MLP neurons writing "
                                           f"{label!r} on {prompt!r}")
    write(out_path, stem, frames, meta, quiet, extra=extra)


def render(layers, df, label: str, target: str, keys=None) -> None:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    shown = layers.assign(block=layers["layer"] + 1)
    out.print(table(shown, {"block": ("block", "d"), "contribution": ("MLP's direct logit",
                                                                      "+.3f"),
                            "share_of_logit": ("of the logit", ".1%"),
                            "top_share": ("of it, the neurons below", ".1%")},
                    title=f"{label}: the MLPs writing most toward {visible(target)}",
                    caption="blocks counted from 1"))
    neat = df.assign(block=df["layer"] + 1,
                     promotes=df["promotes"].map(lambda s: " ".join(map(visible,
                                                                        s.split("|")))))
    out.print(table(neat, {"block": ("block", "d"), "neuron": ("neuron", "d"),
                           "activation": ("activation", "+.2f"),
                           "contribution": ("direct logit", "+.3f"),
                           "target_rank": (f"rank of {visible(target)} in its write", ",d"),
                           "promotes": ("its write promotes", "s")},
                    title="the neurons adding most (activation x value)"))
    if keys is not None:
        first = keys[keys["rank"] == 1].assign(block=keys["layer"] + 1, context=keys[
            "context"].map(lambda c: " ".join(c[-60:].split())))  # one line, spaces kept
        out.print(table(first, {"block": ("block", "d"), "neuron": ("neuron", "d"),
                                "activation": ("activation", "+.2f"),
                                "context": ("the context that triggers it most", "s")},
                        title="each neuron's key: the corpus context firing it most",
                        caption="all top contexts are in the -keys CSV"))
    a = df.attrs
    out.print(f"removing these {a['n_removed']} neurons ({a['method']}): the probability of "
              f"{visible(target)} goes from {a['prob_before']:.4f} to {a['prob_after']:.4f}",
              highlight=False, soft_wrap=True)
