"""`blockscope ablate`: perplexity with each block (or half-block) removed."""

from __future__ import annotations

import time
from enum import Enum
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
    engine_record,
    err,
    flag,
    handled,
    out,
)
from blockscope.cli.data import (
    BootstrapOpt,
    ColumnOpt,
    ConfigOpt,
    DatasetOpt,
    NDocsOpt,
    NTokensOpt,
    RevisionOpt,
    SeedOpt,
    ShuffleOpt,
    SplitOpt,
    TextOpt,
    corpus_run,
    source_of,
    stability_line,
    uncertainty_record,
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
        help="Prepend BOS (the token the model saw at document starts; see --bos-token), so "
        "the first word is predicted too. TransformerLens's default."
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
    text: TextOpt = None,
    dataset: DatasetOpt = None,
    config: ConfigOpt = None,
    split: SplitOpt = None,
    column: ColumnOpt = "text",
    revision: RevisionOpt = None,
    n_tokens: NTokensOpt = None,
    n_docs: NDocsOpt = None,
    shuffle: ShuffleOpt = False,
    bootstrap: BootstrapOpt = 1000,
    seed: SeedOpt = 0,
    model: ModelOpt = None,
    part: Annotated[Part, typer.Option(help="Remove the whole block or one half.")] = Part.block,
    method: MethodOpt = Method.zero,
    max_tokens: MaxTokensOpt = None,
    stride: StrideOpt = None,
    prepend_bos: BosOpt = True,
    bos_token: BosTokenOpt = None,
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
    """Skip each block in turn (its output = its input) and report perplexity on a passage
    or a corpus, with bootstrap intervals.

    Example: blockscope ablate --text data/alice.txt --max-tokens 469
    """
    from blockscope.experiments import ablate as experiment
    from blockscope.results.render import progress_bar
    from blockscope.sweeps.stats import Bootstrap

    started = time.perf_counter()
    source = source_of(text=text, dataset=dataset, config=config, split=split, column=column,
                       revision=revision, n_tokens=n_tokens, n_docs=n_docs, shuffle=shuffle,
                       seed=seed, prepend_bos=prepend_bos, max_tokens=max_tokens)
    run = corpus_run(source, model, device=device, dtype=dtype.value, stride=stride,
                     out_dir=out_dir, allow_pickle=allow_pickle, quiet=quiet,
                     bos_token=bos_token)
    spec, lm = run.spec, run.model
    show = not quiet and run.comm.writes
    sweep_started = time.perf_counter()
    what = {"block": "skipping each block", "attn": "removing each block's attention",
            "mlp": "removing each block's MLP"}[part.value]
    what += " (mean)" if method is Method.mean else ""
    with progress_bar(err, lm.cfg.n_layers + 1, what, show) as step:
        df = experiment.block_ablation(
            lm, run.docs, part=part.value, method=method.value, stride=stride,
            engine=engine.value, batch_size=batch_size, progress=step,
            ci=Bootstrap(bootstrap, seed),
        )
    sweep_s = time.perf_counter() - sweep_started
    if not run.comm.writes:
        return
    correlations = experiment.metric_correlations(df)
    uncertainty = uncertainty_record(df)
    if show:
        out.print(ablation_table(df, f"{spec.label} on {run.describe()}"))
        out.print("rank correlation (Spearman) with the perplexity increase: block influence "
                  f"{correlations['block_influence']:+.2f}, angular distance "
                  f"{correlations['angular_distance']:+.2f}", highlight=False)
        out.print(stability_line(uncertainty), highlight=False, soft_wrap=True)
    suffix = "" if part is Part.block else f"-{part.value}"
    suffix += "" if method is Method.zero else f"-{method.value}"
    meta = run.meta(
        "ablate",
        n_scored=int(df.loc[0, "n_scored"]),
        part=part.value,
        method=method.value,
        engine=engine.value,
        **engine_record(df),
        block_metrics=("cosine of each block's input and output" if part is Part.block else
                       f"cosine of what the {part.value} half reads and the stream after its "
                       "write (input + the half's write)")
        + " per token (all but the first token of each document): block_influence = 1 - mean "
        "cos (ShortGPT), angular_distance = mean arccos(cos)/pi (Gromov et al.)",
        spearman_with_delta=correlations,
        uncertainty=uncertainty,
        sweep_s=round(sweep_s, 3),
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    stem = f"ablate-{spec.slug}-{source.stem}{suffix}"
    extra = {}
    if plot:
        from blockscope.results.plots import ablation_plot

        shown = {"block": "each block skipped", "attn": "each block's attention removed",
                 "mlp": "each block's MLP removed"}[part.value]
        extra[f"{stem}.png"] = ablation_plot(
            df, f"{spec.label} on {run.describe()}: perplexity with {shown}"
            f"{' (mean)' if method is Method.mean else ''}")
    write(run.out_dir, stem, {"": df}, meta, quiet, extra=extra)


def with_intervals(value: float, lo: float, hi: float, spec: str = "+,.2f") -> str:
    """`+1.20 [0.80, 1.60]`; the value alone where there is no interval."""
    if lo != lo or hi != hi:  # NaN: no interval
        return format(value, spec)
    bound = spec.lstrip("+")
    return f"{value:{spec}} [{lo:{bound}}, {hi:{bound}}]"


def ablation_table(df, title: str):
    import pandas as pd

    from blockscope.results.render import table

    ablated = df.iloc[1:]
    styles = {0: "bold"}
    if len(ablated):
        styles[int(ablated["perplexity"].idxmax())] = "bold red"
        styles[int(ablated["perplexity"].idxmin())] = "green"
    shown = df.assign(
        block=[("baseline" if pd.isna(v) else str(v)) for v in df["layer"]],
        ppl=[with_intervals(r.perplexity, r.ci_low, r.ci_high, ",.2f")
             for r in df.itertuples()],
        change=["" if i == 0 else with_intervals(r.delta, r.delta_ci_low, r.delta_ci_high)
                for i, r in enumerate(df.itertuples())])
    part, method = df.loc[len(df) - 1, "part"], df.loc[len(df) - 1, "method"]
    ci = df["ci_low"].notna().any()
    return table(
        shown,
        {"block": ("block removed" if part in ("block", "none") else f"{part} removed in "
                   "block", "s"),
         "ppl": ("perplexity [95% CI]" if ci else "perplexity", "s"),
         "change": ("change [95% CI, paired]" if ci else "change", "s"),
         "ratio": ("ratio", ".3f"),
         "block_influence": ("block influence", ".3f"),
         "angular_distance": ("angular dist.", ".3f")},
        title=f"{title}; part={part}, method={method}",
        styles=styles,
        caption="red: the removal that hurts most; green: the mildest. Blocks count from 0."
        + (" Intervals: bootstrap percentiles; a change's interval resamples the same units "
           "for the variant and the baseline." if ci else ""),
    )
