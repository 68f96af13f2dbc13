"""`blockscope ablate`: perplexity with each block (or half-block) removed."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.common import (
    DeviceOpt,
    Dtype,
    DtypeOpt,
    ModelOpt,
    NoOverwriteOpt,
    OutDirOpt,
    PickleOpt,
    PlotOpt,
    QuietOpt,
    TextFileOpt,
    app,
    engine_record,
    err,
    flag,
    handled,
    out,
    passage_run,
)
from blockscope.cli.output import write


class Part(str, Enum):
    block = "block"
    attn = "attn"
    mlp = "mlp"


class Method(str, Enum):
    zero = "zero"
    mean = "mean"


BosOpt = Annotated[
    bool,
    flag(
        help="Prepend the BOS token (GPT-2's <|endoftext|>, the document separator it was "
        "trained with), so the first word is predicted too. TransformerLens's default."
    ),
]
MaxTokensOpt = Annotated[
    int | None, typer.Option(help="Keep only the first N tokens of the text (BOS not counted).")
]
StrideOpt = Annotated[
    int | None,
    typer.Option(help="Sliding-window stride for text longer than the context (default n_ctx/2)."),
]
class Engine(str, Enum):
    cached = "cached"
    naive = "naive"


EngineOpt = Annotated[
    Engine,
    typer.Option(help="cached: one clean pass, each variant from the block it changes; "
                 "naive: one hooked forward per variant (the reference). Same numbers."),
]
BatchOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Variants per batch (default: by memory; on the CPU at most 6, "
                 "or 1 where blocks run through the bridge)."),
]
MethodOpt = Annotated[
    Method, typer.Option(help="zero: remove it; mean: write its clean mean over positions.")
]


@app.command()
@handled
def ablate(
    text: TextFileOpt = Path("data/alice.txt"),
    model: ModelOpt = "gpt2",
    part: Annotated[Part, typer.Option(help="Remove the whole block or one half.")] = Part.block,
    method: MethodOpt = Method.zero,
    max_tokens: MaxTokensOpt = None,
    stride: StrideOpt = None,
    prepend_bos: BosOpt = True,
    engine: EngineOpt = Engine.cached,
    batch_size: BatchOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Skip each block in turn (its output = its input) and report perplexity on a passage.

    Example: blockscope ablate --text data/alice.txt --max-tokens 469
    """
    from blockscope import ablate as experiment
    from blockscope.render import progress_bar

    started = time.perf_counter()
    run = passage_run(text, model, device=device, dtype=dtype.value, max_tokens=max_tokens,
                      prepend_bos=prepend_bos, stride=stride, out_dir=out_dir,
                      allow_pickle=allow_pickle, quiet=quiet)
    spec, passage, lm, tokens = run.spec, run.passage, run.model, run.tokens
    with progress_bar(err, lm.cfg.n_layers + 1, "ablating blocks", not quiet) as step:
        df = experiment.block_ablation(
            lm, tokens, part=part.value, method=method.value, stride=stride,
            engine=engine.value, batch_size=batch_size, progress=step,
        )
    n_text = int(tokens.shape[-1]) - int(prepend_bos)
    correlations = experiment.metric_correlations(df)
    if not quiet:
        out.print(ablation_table(df, f"{spec.label} on {passage.path.name}: {n_text} tokens"
                                 f"{' + BOS' if prepend_bos else ''}"))
        out.print("rank correlation (Spearman) with the perplexity increase: block influence "
                  f"{correlations['block_influence']:+.2f}, angular distance "
                  f"{correlations['angular_distance']:+.2f}", highlight=False)
    suffix = "" if part is Part.block else f"-{part.value}"
    suffix += "" if method is Method.zero else f"-{method.value}"
    meta = run.meta(
        "ablate",
        n_scored=int(df.loc[0, "n_scored"]),
        part=part.value,
        method=method.value,
        engine=engine.value,
        **engine_record(df),
        block_metrics="cosine of each block's input and output per token (all but the first "
        "token): block_influence = 1 - mean cos (ShortGPT), angular_distance = mean "
        "arccos(cos)/pi (Gromov et al.)",
        spearman_with_delta=correlations,
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    stem = f"ablate-{spec.slug}-{passage.path.stem}{suffix}"
    extra = {}
    if plot:
        from blockscope.plots import ablation_plot

        what = {"block": "each block skipped", "attn": "each block's attention removed",
                "mlp": "each block's MLP removed"}[part.value]
        extra[f"{stem}.png"] = ablation_plot(
            df, f"{spec.label} on {passage.path.name} ({n_text} tokens): perplexity with {what}"
            f"{' (mean)' if method is Method.mean else ''}")
    write(run.out_dir, stem, {"": df}, meta, quiet, extra=extra)


def ablation_table(df, title: str):
    import pandas as pd

    from blockscope.render import table

    ablated = df.iloc[1:]
    styles = {0: "bold"}
    if len(ablated):
        styles[int(ablated["perplexity"].idxmax())] = "bold red"
        styles[int(ablated["perplexity"].idxmin())] = "green"
    shown = df.assign(block=[("baseline" if pd.isna(v) else str(v)) for v in df["layer"]])
    part, method = df.loc[len(df) - 1, "part"], df.loc[len(df) - 1, "method"]
    return table(
        shown,
        {"block": ("block removed" if part in ("block", "none") else f"{part} removed in "
                   "block", "s"), "perplexity": ("perplexity", ",.2f"),
         "delta": ("change", "+,.2f"), "ratio": ("ratio", ".3f"),
         "block_influence": ("block influence", ".3f"),
         "angular_distance": ("angular dist.", ".3f")},
        title=f"{title}; part={part}, method={method}",
        styles=styles,
        caption="red: the removal that hurts most; green: the mildest. Blocks count from 0.",
    )
