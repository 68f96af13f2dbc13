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

        if not self.subject.strip():
            from blockscope.errors import BadValue

            raise BadValue("give the `subject`, as it appears in the prompt")
        at_least(1, samples=self.samples, window=self.window)
        check(self.kinds, self.samples, self.window, self.sever)


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
