"""`blockscope trace`: ROME's causal trace, restoring clean states into a noised run."""

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
    above_zero,
    at_least,
    at_most,
    group,
    tokens_given,
    within,
)
from blockscope.api.output import write
from blockscope.api.text_options import Prompt, Sweep

ROME_WINDOW = 10  # ROME's window of restored blocks, where the model has as many
MAX_SAMPLES = 1000  # noise samples: each is a row of every variant's batch (ROME: 10)


@dataclass
class Trace(Options):
    name: ClassVar[str] = "trace"
    prompt: Prompt = group(Prompt)
    subject: SubjectOpt = ""
    target: FactTargetOpt = None
    kind: Annotated[list[str] | None, typer.Option(
        help="What is restored (repeatable): resid (the state after a block), mlp or attn "
        "(their outputs over --window blocks). Default: all three.", show_default=False)] = None
    samples: Annotated[int, typer.Option(help="Noise samples (ROME: 10).")] = 10
    noise: Annotated[float, typer.Option(help="Noise scale, in standard deviations (see "
                                         "--noise-std) (ROME: 3).")] = 3.0
    noise_std: Annotated[str, typer.Option(
        help="The standard deviation the noise scale counts in: subjects (ROME's: of the "
        "subjects' token embeddings, every fact's with --facts), embeddings (of every "
        "entry of W_E), or a number.")] = "subjects"
    window: Annotated[int | None, typer.Option(
        help="Blocks restored together for mlp and attn (default: ROME's 10, or every block "
        "of a model with fewer).", show_default=False)] = None
    sever: Annotated[str | None, typer.Option(
        help="Also trace the state with this part's later outputs frozen at their corrupted "
        "values: mlp or attn.", show_default=False)] = None
    seed: Annotated[int, typer.Option(help="The noise's seed (drawn on the CPU).")] = 0
    facts: FactsOpt = None
    all_facts: AllFactsOpt = False
    sweep: Sweep = group(Sweep)
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(self.kind or ["resid", "mlp", "attn"]))

    def check(self) -> None:
        from blockscope.experiments.trace import check

        check_facts(self)
        if self.facts is None and not self.subject.strip():
            from blockscope.errors import BadValue

            raise BadValue("give the `subject`, as it appears in the prompt")
        at_least(1, samples=self.samples, window=self.window)
        tokens_given(target=self.target)
        check(self.kinds, self.samples, self.window or 1, self.sever)
        above_zero(noise=self.noise)
        within(1, MAX_SAMPLES, samples=self.samples)
        self.std_rule  # noqa: B018 (refuses a bad --noise-std)

    def check_sizes(self, sizes: dict) -> None:
        if sizes.get("n_layers"):
            at_most(sizes["n_layers"], f"the model's {sizes['n_layers']} blocks",
                    window=self.window)

    @property
    def std_rule(self) -> str | float:
        """--noise-std as a rule name or a positive number."""
        from blockscope.errors import BadValue

        if self.noise_std in ("subjects", "embeddings"):
            return self.noise_std
        try:
            value = float(self.noise_std)
        except ValueError:
            raise BadValue(f"`noise_std` must be subjects, embeddings or a number (got "
                           f"{self.noise_std!r})")
        above_zero(noise_std=value)
        return value


@command
def trace(o: Trace):
    """Causal tracing: noise the subject's embeddings, then restore one clean state at a
    time, and see where P(target) comes back (Meng et al. 2022, ROME).

    Example: blockscope trace "The capital of France is" --subject France --target " Paris"
    """
    from blockscope.api.common import err
    from blockscope.experiments import trace as experiment
    from blockscope.results.progress import progress_bar

    started = time.perf_counter()
    if o.facts is not None:
        return trace_facts(o, started)
    run, span, target, word = fact_prompt(o)
    lm = run.model
    std, std_record = experiment.noise_std(lm, o.std_rule, [o.subject])
    with progress_bar(err, 1, "tracing", not o.out.quiet, o.out.reporter) as tick:
        df = experiment.trace(lm, run.tokens, span, target=target, kinds=o.kinds,
                              samples=o.samples, window=window_of(o, lm, ROME_WINDOW),
                              noise=o.noise, std=std,
                              sever=o.sever,
                              settings=o.sweep.settings(seed=o.seed).reporting(tick))
    a = df.attrs
    said = render(df, run.spec.label, word)
    meta = run.meta("trace", o.prepend_bos, started, subject=o.subject, subject_tokens=a["subject"],
                    target=word, target_id=target, p_clean=a["p_clean"],
                    p_corrupted=a["p_corrupted"], noise_scale=a["noise_scale"],
                    noise_factor=o.noise, noise_std=std_record,
                    noise_rule=experiment.NOISE_RULE, seed=o.seed,
                    samples=o.samples, window=window_of(o, lm, ROME_WINDOW), kinds=o.kinds,
                    sever=o.sever,
                    **engine_record(df))
    stem = f"trace-{run.spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import trace_plot

        extra[f"{stem}.png"] = trace_plot(df, span, f"{run.spec.label}: restoring states "
                                          f"after noising {o.subject!r}", word)
    return write(o, stem, {"": df}, meta, extra=extra, shown=said)


def trace_facts(o: Trace, started: float):
    from blockscope.experiments import trace as experiment

    noise = {}  # the std, once over every fact kept (ROME's rule: all the subjects)

    def before(lm, kept):
        noise["std"], noise["record"] = experiment.noise_std(
            lm, o.std_rule, [it["fact"].subject for it in kept])

    def one(lm, tokens, span, target):
        return experiment.trace(lm, tokens, span, target=target, kinds=o.kinds,
                                samples=o.samples, window=window_of(o, lm, ROME_WINDOW),
                                noise=o.noise,
                                std=noise["std"], sever=o.sever,
                                settings=o.sweep.settings(seed=o.seed))

    done = many_facts(o, "tracing", one, ["kind", "layer", "category"], "indirect_effect",
                      started, before)
    if done is None:
        return None
    spec, lm, per_fact, avg, record = done
    from blockscope.api.common import model_record
    from blockscope.results.files import sidecar

    meta = sidecar(command="trace", model=model_record(spec, lm), **record, kinds=o.kinds,
                   samples=o.samples, window=window_of(o, lm, ROME_WINDOW),
                   noise_factor=o.noise,
                   noise_std=noise["record"], noise_scale=o.noise * noise["std"], seed=o.seed,
                   noise_rule=experiment.NOISE_RULE + "; each fact's noise drawn from `seed`",
                   sever=o.sever, prepend_bos=o.prepend_bos, dtype=spec.dtype,
                   device=spec.device, wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"trace-{spec.slug}-facts"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import facts_trace_plot

        extra[f"{stem}.png"] = facts_trace_plot(avg, f"{spec.label}: average indirect effect "
                                                f"over {record['n_used']} facts")
    return write(o, stem, {"": avg, "-per-fact": per_fact}, meta, extra=extra,
                 shown=render_facts(avg, spec.label, record["n_used"]))


def render_facts(avg, label: str, n: int) -> list:
    said = []
    from blockscope.results.render import table

    rows = []
    for kind, part in avg.groupby("kind", sort=False):
        for cat in ("last subject", "first subject", "middle subject", "last"):
            sub = part[part["category"] == cat]
            if len(sub):
                best = sub.loc[sub["indirect_effect"].idxmax()]
                rows.append({"kind": kind, "category": cat, "layer": int(best["layer"]),
                             "ie": best["indirect_effect"], "lo": best["ci_low"],
                             "hi": best["ci_high"]})
    import pandas as pd

    shown = pd.DataFrame(rows)
    shown["ci"] = [f"{a:+.3f}..{b:+.3f}" for a, b in zip(shown["lo"], shown["hi"], strict=True)]
    said.append(table(shown, {"kind": ("restored", "s"), "category": ("at", "s"),
                            "layer": ("peak layer", "d"), "ie": ("mean effect", "+.3f"),
                            "ci": ("95% interval", "s")},
                    title=f"{label}: average indirect effect over {n} facts",
                    caption="layers from 0; every (kind, layer, position category) is in "
                    "the CSV, each fact's cells in -per-fact"))
    return said


def render(df, label: str, word: str) -> list:
    said = []
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    best = df.loc[df.groupby("kind", sort=False)["indirect_effect"].idxmax()]
    shown = best.assign(where=[f"L{r.layer} @{r.position} {visible(r.token)}"
                               for r in best.itertuples()])
    said.append(table(shown, {"kind": ("restored", "s"), "where": ("strongest at", "s"),
                            "p_target": (f"P({visible(word)})", ".4f"),
                            "indirect_effect": ("indirect effect", "+.4f")},
                    title=f"{label}: where restoring a clean state brings {visible(word)} back",
                    caption=f"clean P {df.attrs['p_clean']:.4f}, corrupted "
                    f"{df.attrs['p_corrupted']:.4f}; layers from 0; every cell is in the CSV"))
    return said
