"""`blockscope ablate`: perplexity with each block (or half-block) removed."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, engine_record, err
from blockscope.api.corpus_run import passage_command, stability_line, uncertainty_record
from blockscope.api.options import Load, Options, Output, group
from blockscope.api.output import write
from blockscope.api.text_options import (
    MethodOpt,
    PassageOptions,
    SeedOpt,
    Sweep,
    WindowOptions,
    check_resample,
    resample_record,
)
from blockscope.choices import Method, Part

REMOVED = {"block": "skipping each block", "attn": "removing each block's attention",
           "mlp": "removing each block's MLP"}
SHOWN = {"block": "each block skipped", "attn": "each block's attention removed",
         "mlp": "each block's MLP removed"}


@dataclass
class Ablate(Options):
    name: ClassVar[str] = "ablate"
    passage: PassageOptions = group(PassageOptions)
    seed: SeedOpt = 0
    load: Load = group(Load)
    part: Annotated[Part, typer.Option(help="Remove the whole block or one half.")] = Part.block
    method: MethodOpt = Method.zero
    decompose: Annotated[bool, typer.Option(
        "--decompose", help="Split each removal's change in the correct token's centred "
        "logit into the component's own write, later blocks' reactions and the final norm "
        "(self-repair).")] = False
    per_token: Annotated[bool, typer.Option(
        "--per-token", help="With --decompose: also a CSV of every scored token's split.")] = False
    window: WindowOptions = group(WindowOptions)
    sweep: Sweep = group(Sweep)
    out: Output = group(Output)

    def check(self) -> None:
        from blockscope.errors import BadValue
        from blockscope.experiments.ablate import check_method
        from blockscope.inputs.parallel import world_size

        check_method(self.part.value, self.method.value)
        check_resample(self.method, self.passage)
        if self.per_token and not self.decompose:
            raise BadValue("`per_token` goes with `decompose`")
        if self.decompose and world_size() > 1:
            raise BadValue("ablate with `decompose` runs in one process")

    @property
    def suffix(self) -> str:
        return ("" if self.part is Part.block else f"-{self.part.value}") + (
            "" if self.method is Method.zero else f"-{self.method.value}")


@command
def ablate(o: Ablate):
    """Skip each block in turn (its output = its input) and report perplexity on a passage
    or a corpus, with bootstrap intervals.

    Example: blockscope ablate --text data/alice.txt --max-tokens 469
    """
    from blockscope.experiments import ablate as experiment
    from blockscope.results.progress import progress_bar

    c = passage_command(o, "ablate")
    run = c.run
    part, method = o.part.value, o.method.value
    mean = "" if o.method is Method.zero else f" ({method})"
    if o.decompose:
        return decomposed(o, c)
    swept = time.perf_counter()
    with progress_bar(err, run.model.cfg.n_layers + 1, REMOVED[part] + mean, c.show,
                      o.out.reporter) as step:
        df = experiment.block_ablation(
            run.model, run.docs, part=part, method=method,
            settings=c.settings.reporting(step))
    sweep_s = time.perf_counter() - swept
    if not c.writes:
        return None
    correlations, uncertainty = experiment.metric_correlations(df), uncertainty_record(df)
    said = [ablation_table(df, c.title), (correlation_line(correlations), {"highlight": False}),
            (stability_line(uncertainty), {"highlight": False})]

    def plot():
        from blockscope.results.plots import ablation_plot

        return ablation_plot(df, f"{c.title}: perplexity with {SHOWN[part]}{mean}")

    return c.finish({"": df}, n_scored=df.loc[0, "n_scored"], suffix=o.suffix, plot=plot,
                    shown=said, part=part, method=method,
                    block_metrics=experiment.metrics_meaning(part),
                    **resample_record(o.method, df), spearman_with_delta=correlations,
                    uncertainty=uncertainty, sweep_s=round(sweep_s, 3))


def decomposed(o: Ablate, c):
    """`--decompose`: the split per removed component (and per token), its table, its
    headline, a stacked bar per component."""
    from blockscope.experiments import ablate as experiment
    from blockscope.experiments.decompose import MEANING, headline
    from blockscope.results.progress import progress_bar
    from blockscope.sweeps.naive import model_windows

    run, started = c.run, c.started
    part, method = o.part.value, o.method.value

    n_windows = sum(len(model_windows(run.model, ids, o.window.stride)) for ids in run.docs.ids)
    # one step per removal per window: every component is removed (the reads of a window
    # come in batches, so the bar moves batch by batch)
    with progress_bar(err, n_windows * run.model.cfg.n_layers,
                      f"splitting each removal ({REMOVED[part]})", not o.out.quiet,
                      o.out.reporter) as step:
        df, tokens = experiment.decomposed(run.model, run.docs, part=part, method=method,
                                           settings=c.settings.reporting(step))
    title = f"{run.spec.label} on {run.describe()}"
    line = headline(df, run.model.cfg.n_layers)
    said = [decompose_table(df, title, part, method), (line, {"highlight": False})]
    meta = run.meta("ablate", n_scored=df.attrs["n_scored"], part=part, method=method,
                    decompose=True, **engine_record(df), headline=line, columns=MEANING,
                    **({"resample": df.attrs["resample"]} if "resample" in df.attrs else {}),
                    wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"ablate-{run.spec.slug}-{run.source.stem}{o.suffix}-decompose"
    frames = {"": df} | ({"-tokens": tokens} if o.per_token else {})
    extra = {}
    if o.out.plot:
        from blockscope.results.decompose_plots import decompose_plot

        extra[f"{stem}.png"] = decompose_plot(df, f"{run.spec.label}, {SHOWN[part]} "
                                              f"({method}): where the logit change comes from")
    return write(o, stem, frames, meta, extra=extra, shown=said)


def decompose_table(df, title: str, part: str, method: str):
    from blockscope.results.render import table

    return table(df, {"layer": ("block" if part == "block" else f"{part} of", "d"),
                      "total": ("total", "+.3f"), "direct": ("own write", "+.3f"),
                      "downstream": ("later blocks", "+.3f"),
                      "final_norm": ("final norm", "+.3f"),
                      "self_repair": ("self-repair", "+.0%")},
                 title=f"{title}: where each removal's logit change comes from ({method})",
                 caption="the change in the correct token's logit minus the mean logit, "
                 "averaged over the scored tokens; own write + later blocks + final norm = "
                 "total; self-repair = (own - total) / own. Blocks count from 0; each later "
                 "block's share is in the CSV (downstream_<j>).")


def correlation_line(correlations: dict) -> str:
    return ("rank correlation (Spearman) with the perplexity increase: block influence "
            f"{correlations['block_influence']:+.2f}, angular distance "
            f"{correlations['angular_distance']:+.2f}")


def ablation_table(df, title: str):
    import pandas as pd

    from blockscope.results.render import table, with_intervals

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
         "kl": ("KL", ".4f"),
         "block_influence": ("block influence", ".3f"),
         "angular_distance": ("angular dist.", ".3f")},
        title=f"{title}; part={part}, method={method}",
        styles=styles,
        caption="red: the removal that hurts most; green: the mildest. Blocks count from 0."
        + (" Intervals: bootstrap percentiles; a change's interval resamples the same units "
           "for the variant and the baseline." if ci else ""),
    )
