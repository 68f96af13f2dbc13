"""`blockscope trace`: ROME's causal trace, restoring clean states into a noised run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.cli.common import command, out
from blockscope.cli.lens import PromptBosOpt
from blockscope.cli.options import BosTokenOpt, Load, Options, Output, at_least, group
from blockscope.cli.output import write
from blockscope.cli.prompts import prompt_run
from blockscope.cli.text_options import Prompt, Sweep

SubjectOpt = Annotated[str, typer.Option(help="The subject as it appears in the prompt "
                                         "('France').", show_default=False)]
FactsOpt = Annotated[str | None, typer.Option(
    help="Run every fact of a JSONL file (prompt, subject, target; 'builtin': blockscope's "
    "153) and average over them, with bootstrap intervals over facts.", show_default=False)]
AllFactsOpt = Annotated[bool, typer.Option(
    "--all-facts", help="Keep every fact, not only those the model knows (its top-1 is the "
    "target), e.g. to time a random-weight model.")]
FactTargetOpt = Annotated[str | None, typer.Option(
    help="The answer, one token with its space (' Paris'). Default: the model's own top-1.",
    show_default=False)]


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
    noise: Annotated[float, typer.Option(help="Noise scale, in standard deviations of the "
                                         "token embeddings (ROME: 3).")] = 3.0
    window: Annotated[int, typer.Option(help="Blocks restored together for mlp and attn "
                                        "(ROME: 10).")] = 10
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
        check(self.kinds, self.samples, self.window, self.sever)


def check_facts(o) -> None:
    """A prompt or --facts, not both; --all-facts only with --facts."""
    from blockscope.errors import BadValue, BlockscopeError
    from blockscope.inputs.parallel import world_size

    given = o.prompt.prompt is not None or o.prompt.text is not None
    if o.facts is None and world_size() > 1:
        raise BlockscopeError("under torchrun the facts of `facts` are shared across "
                              "processes; one prompt runs in one process")
    if o.facts is not None and (given or o.subject or o.target):
        raise BadValue("give a prompt (with `subject`) or `facts`, not both")
    if o.all_facts and o.facts is None:
        raise BadValue("`all_facts` goes with `facts`")


def many_facts(o, name: str, run, keys: list[str], value: str, started: float):
    """Every fact of --facts (those the model knows, unless --all-facts) through `run(model,
    tokens, span, target, progress)`: the per-fact rows, their averages, and the sidecar's
    record (None on a process that does not write, under torchrun). The facts are read
    before the model loads."""
    from blockscope.cli.common import checked_load, err
    from blockscope.errors import BlockscopeError
    from blockscope.experiments import facts as fx
    from blockscope.inputs import parallel
    from blockscope.model.loading import spec_for
    from blockscope.results.render import progress_bar

    facts = fx.read_facts(o.facts)
    spec = spec_for(o.load.model, device=parallel.local_device(o.load.device),
                    dtype=o.load.dtype.value, bos_token=o.bos_token)
    comm = parallel.from_env(spec.device)
    quiet = o.out.quiet or not comm.writes
    lm = checked_load(spec, o.load.allow_pickle, quiet)
    items = fx.prepared(lm, facts, o.prepend_bos)
    kept = items if o.all_facts else [i for i in items if i["known"]]
    if not kept:
        raise BlockscopeError(f"{spec.label} knows none of the {len(facts)} facts (its top-1 "
                              "is the target for none); --all-facts keeps every fact")
    if not quiet:
        err.print(f"{len(kept)} of {len(facts)} facts {'kept' if o.all_facts else 'known'} "
                  f"({spec.label}'s top-1 is the target's first token for "
                  f"{sum(i['known'] for i in items)})", highlight=False, soft_wrap=True)
    with progress_bar(err, len(kept), f"{name} over facts", not quiet) as tick:
        per_fact, avg = fx.over(kept, lambda t, s, g: run(lm, t, s, g), keys, value, tick,
                                comm)
    record = {"facts": o.facts, "n_facts": len(facts), "n_known": sum(i["known"] for i in items),
              "n_used": len(kept), "all_facts": o.all_facts, "categories": list(fx.CATEGORIES),
              "interval": "95% percentile bootstrap over facts, 1000 resamples, seed 0",
              "used": [{"prompt": i["fact"].prompt, "subject": i["fact"].subject,
                        "target": i["fact"].target} for i in kept], "processes": comm.size}
    if not comm.writes:  # rank 0 alone prints and writes
        return None
    return spec, lm, per_fact, avg, record


def answer(lm, tokens, target: str | None) -> int:
    """The target's token id, or the model's own top-1 at the last position."""
    import torch

    from blockscope.experiments.logit_lens import target_id

    if target is not None:
        return target_id(lm.tokenizer, target)
    with torch.inference_mode():
        return int(lm(tokens.to(lm.cfg.device), return_type="logits")[0, -1].argmax())


@command
def trace(o: Trace) -> None:
    """Causal tracing (Meng et al. 2022): noise the subject's embeddings, then restore one
    clean state at a time, and see where P(target) comes back.

    Example: blockscope trace "The capital of France is" --subject France --target " Paris"
    """
    from blockscope.cli.common import err
    from blockscope.experiments import trace as experiment
    from blockscope.results.render import progress_bar

    started = time.perf_counter()
    if o.facts is not None:
        return trace_facts(o, started)
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token)
    lm = run.model
    span = experiment.subject_span(lm.tokenizer, run.tokens[0].tolist(), o.subject)
    target = answer(lm, run.tokens, o.target)
    word = lm.tokenizer.decode([target])
    with progress_bar(err, 1, "tracing", not o.out.quiet) as tick:
        df = experiment.trace(lm, run.tokens, span, target=target, kinds=o.kinds,
                              samples=o.samples, window=o.window, noise=o.noise, seed=o.seed,
                              sever=o.sever, engine=o.sweep.engine.value, progress=tick)
    a = df.attrs
    if not o.out.quiet:
        render(df, run.spec.label, word)
    meta = run.meta("trace", o.prepend_bos, started, subject=o.subject, subject_tokens=a["subject"],
                    target=word, target_id=target, p_clean=a["p_clean"],
                    p_corrupted=a["p_corrupted"], noise_scale=a["noise_scale"],
                    noise_factor=o.noise, noise_rule=experiment.NOISE_RULE, seed=o.seed,
                    samples=o.samples, window=o.window, kinds=o.kinds, sever=o.sever,
                    engine=a["how"])
    stem = f"trace-{run.spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import trace_plot

        extra[f"{stem}.png"] = trace_plot(df, span, f"{run.spec.label}: restoring states "
                                          f"after noising {o.subject!r}", word)
    write(o, stem, {"": df}, meta, extra=extra)


def trace_facts(o: Trace, started: float) -> None:
    from blockscope.experiments import trace as experiment

    def one(lm, tokens, span, target):
        return experiment.trace(lm, tokens, span, target=target, kinds=o.kinds,
                                samples=o.samples, window=o.window, noise=o.noise, seed=o.seed,
                                sever=o.sever, engine=o.sweep.engine.value)

    done = many_facts(o, "tracing", one, ["kind", "layer", "category"], "indirect_effect",
                      started)
    if done is None:
        return
    spec, lm, per_fact, avg, record = done
    if not o.out.quiet:
        render_facts(avg, spec.label, record["n_used"])
    from blockscope.cli.common import model_record
    from blockscope.results.files import sidecar

    meta = sidecar(command="trace", model=model_record(spec, lm), **record, kinds=o.kinds,
                   samples=o.samples, window=o.window, noise_factor=o.noise, seed=o.seed,
                   noise_rule=experiment.NOISE_RULE + "; each fact's noise drawn from `seed`",
                   sever=o.sever, prepend_bos=o.prepend_bos, dtype=spec.dtype,
                   device=spec.device, wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"trace-{spec.slug}-facts"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import facts_trace_plot

        extra[f"{stem}.png"] = facts_trace_plot(avg, f"{spec.label}: average indirect effect "
                                                f"over {record['n_used']} facts")
    write(o, stem, {"": avg, "-per-fact": per_fact}, meta, extra=extra)


def render_facts(avg, label: str, n: int) -> None:
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
    out.print(table(shown, {"kind": ("restored", "s"), "category": ("at", "s"),
                            "layer": ("peak layer", "d"), "ie": ("mean effect", "+.3f"),
                            "ci": ("95% interval", "s")},
                    title=f"{label}: average indirect effect over {n} facts",
                    caption="layers from 0; every (kind, layer, position category) is in "
                    "the CSV, each fact's cells in -per-fact"))


def render(df, label: str, word: str) -> None:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    best = df.loc[df.groupby("kind", sort=False)["indirect_effect"].idxmax()]
    shown = best.assign(where=[f"L{r.layer} @{r.position} {visible(r.token)}"
                               for r in best.itertuples()])
    out.print(table(shown, {"kind": ("restored", "s"), "where": ("strongest at", "s"),
                            "p_target": (f"P({visible(word)})", ".4f"),
                            "indirect_effect": ("indirect effect", "+.4f")},
                    title=f"{label}: where restoring a clean state brings {visible(word)} back",
                    caption=f"clean P {df.attrs['p_clean']:.4f}, corrupted "
                    f"{df.attrs['p_corrupted']:.4f}; layers from 0; every cell is in the CSV"))
