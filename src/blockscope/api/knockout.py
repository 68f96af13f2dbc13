"""`blockscope knockout`: Geva et al.'s attention knockout into the last position."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, engine_record
from blockscope.api.facts import (
    AllFactsOpt,
    FactsOpt,
    FactTargetOpt,
    SubjectOpt,
    check_facts,
    fact_prompt,
    many_facts,
    window_of,
)
from blockscope.api.options import (
    BosTokenOpt,
    Load,
    Options,
    Output,
    PromptBosOpt,
    at_least,
    at_most,
    group,
    tokens_given,
)
from blockscope.api.output import write
from blockscope.api.text_options import Prompt, Sweep

GEVA_WINDOW = 9  # Geva et al.'s window of blocks knocked out, where the model has as many


@dataclass
class KnockoutOptions(Options):
    name: ClassVar[str] = "knockout"
    prompt: Prompt = group(Prompt)
    subject: SubjectOpt = ""
    target: FactTargetOpt = None
    window: Annotated[int | None, typer.Option(
        help="Consecutive blocks knocked out together (default: Geva et al.'s 9, or every "
        "block of a model with fewer).", show_default=False)] = None
    facts: FactsOpt = None
    all_facts: AllFactsOpt = False
    sweep: Sweep = group(Sweep)
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    def check(self) -> None:
        check_facts(self)
        if self.facts is None and not self.subject.strip():
            from blockscope.errors import BadValue

            raise BadValue("give the `subject`, as it appears in the prompt")
        at_least(1, window=self.window)
        tokens_given(target=self.target)

    def check_sizes(self, sizes: dict) -> None:
        if sizes.get("n_layers"):
            at_most(sizes["n_layers"], f"the model's {sizes['n_layers']} blocks",
                    window=self.window)


@command
def knockout(o: KnockoutOptions):
    """Attention knockout: stop the last position attending to the subject, to the other
    positions, or to itself, in a window of blocks, and see what P(target) loses (Geva et
    al. 2023).

    Example: blockscope knockout "The capital of France is" --subject France --target " Paris"
    """
    from blockscope.api.common import err
    from blockscope.experiments import knockout as experiment
    from blockscope.results.progress import progress_bar

    started = time.perf_counter()
    if o.facts is not None:
        return knockout_facts(o, started)
    run, span, target, word = fact_prompt(o)
    lm = run.model
    with progress_bar(err, 1, "knocking out", not o.out.quiet,
                      o.out.reporter) as tick:
        df = experiment.knockout(lm, run.tokens, span, target=target,
                                 window=window_of(o, lm, GEVA_WINDOW),
                                 bos=o.prepend_bos,
                                 settings=o.sweep.settings().reporting(tick))
    said = render(df, run.spec.label, word)
    meta = run.meta("knockout", o.prepend_bos, started, subject=o.subject,
                    subject_tokens=list(span), target=word, target_id=target,
                    p_clean=df.attrs["p_clean"], window=df.attrs["window"],
                    edges={e: list(experiment.keys(e, span, run.tokens.shape[-1],
                                                   o.prepend_bos))
                           for e in experiment.EDGES}, **engine_record(df))
    stem = f"knockout-{run.spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import knockout_plot

        extra[f"{stem}.png"] = knockout_plot(df, f"{run.spec.label}: attention knocked out "
                                             f"into the last position", word)
    return write(o, stem, {"": df}, meta, extra=extra, shown=said)


def knockout_facts(o: KnockoutOptions, started: float):
    from blockscope.api.common import model_record
    from blockscope.experiments import knockout as experiment
    from blockscope.results.files import sidecar

    def one(lm, tokens, span, target):
        return experiment.knockout(lm, tokens, span, target=target,
                                   window=window_of(o, lm, GEVA_WINDOW),
                                   bos=o.prepend_bos, settings=o.sweep.settings())

    done = many_facts(o, "knocking out", one, ["from", "layer_start", "layer_end"],
                      "relative_change", started)
    if done is None:
        return None
    spec, lm, per_fact, avg, record = done
    avg.attrs["window"] = window_of(o, lm, GEVA_WINDOW)
    meta = sidecar(command="knockout", model=model_record(spec, lm), **record,
                   window=avg.attrs["window"],
                   prepend_bos=o.prepend_bos, dtype=spec.dtype, device=spec.device,
                   wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"knockout-{spec.slug}-facts"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import knockout_plot

        extra[f"{stem}.png"] = knockout_plot(avg, f"{spec.label}: attention knocked out into "
                                             f"the last position, mean over {record['n_used']} "
                                             "facts", "target")
    return write(o, stem, {"": avg, "-per-fact": per_fact}, meta, extra=extra,
                 shown=render_facts(avg, spec.label, record["n_used"]))


def render_facts(avg, label: str, n: int) -> list:
    said = []
    from blockscope.results.render import table

    worst = avg.loc[avg.groupby("from", sort=False)["relative_change"].idxmin()]
    shown = worst.assign(blocks=[f"{r.layer_start}-{r.layer_end}" for r in worst.itertuples()],
                         ci=[f"{a:+.1%}..{b:+.1%}" for a, b in zip(worst["ci_low"],
                                                                  worst["ci_high"],
                                                                  strict=True)])
    said.append(table(shown, {"from": ("edges from", "s"), "blocks": ("worst window", "s"),
                            "relative_change": ("mean change", "+.1%"),
                            "ci": ("95% interval", "s")},
                    title=f"{label}: knockout into the last position, {n} facts",
                    caption="layers from 0; every window is in the CSV, each fact's in "
                    "-per-fact"))
    return said


def render(df, label: str, word: str) -> list:
    said = []
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    worst = df.loc[df.groupby("from", sort=False)["relative_change"].idxmin()]
    shown = worst.assign(blocks=[f"{r.layer_start}-{r.layer_end}" for r in worst.itertuples()])
    said.append(table(shown, {"from": ("edges from", "s"), "blocks": ("worst window", "s"),
                            "p_target": (f"P({visible(word)})", ".4f"),
                            "relative_change": ("change", "+.1%")},
                    title=f"{label}: knocking out attention into the last position",
                    caption=f"clean P {df.attrs['p_clean']:.4f}; layers from 0; every window "
                    "is in the CSV"))
    return said
