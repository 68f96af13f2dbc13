"""`blockscope patch`: activation patching, the clean run's activation written into the
corrupted run at one site at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, engine_record
from blockscope.api.options import (
    BosTokenOpt,
    Load,
    Options,
    Output,
    PromptBosOpt,
    group,
    tokens_given,
)
from blockscope.api.output import write
from blockscope.api.prompts import one_token_each, two_prompts
from blockscope.api.text_options import Sweep


@dataclass
class PatchOptions(Options):
    name: ClassVar[str] = "patch"
    clean: Annotated[str, typer.Option(help="The clean prompt, e.g. 'The capital of France "
                                       "is'.", show_default=False)]
    corrupted: Annotated[str, typer.Option(help="The corrupted prompt, the same number of "
                                           "tokens, e.g. 'The capital of Italy is'.",
                                           show_default=False)]
    target: Annotated[str, typer.Option(help="The clean answer, one token with its space "
                                        "(' Paris').", show_default=False)]
    contrast: Annotated[str | None, typer.Option(
        help="The corrupted answer (' Rome'): the metric is then the logit difference; "
        "without it, log P(target).", show_default=False)] = None
    site: Annotated[list[str] | None, typer.Option(
        help="What is patched (repeatable): resid-pre, attn-out, mlp-out (every layer x "
        "position) or z (every layer x head, all positions). Default: resid-pre.",
        show_default=False)] = None
    sweep: Sweep = group(Sweep)
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    @property
    def sites(self) -> list[str]:
        return list(dict.fromkeys(self.site or ["resid-pre"]))

    def check(self) -> None:
        from blockscope.experiments.patch import check_sites

        check_sites(self.sites)
        tokens_given(target=self.target, contrast=self.contrast)


@command
def patch(o: PatchOptions):
    """Activation patching: run the corrupted prompt with one activation of the clean run
    written back, at every (layer, position) or (layer, head), and see how much of the
    clean answer comes back (0: corrupted, 1: clean).

    Example: blockscope patch --clean "The capital of France is" --corrupted "The capital
    of Italy is" --target " Paris" --contrast " Rome" --site resid-pre --site z
    """
    from blockscope.experiments import patch as experiment
    from blockscope.experiments.logit_lens import target_id
    from blockscope.results.render import progress_bar

    started = time.perf_counter()
    run = two_prompts(o.clean, o.corrupted, o.load, o.prepend_bos, o.bos_token, o.out.quiet,
                      experiment.check_lengths,
                      one_token_each(target=o.target, contrast=o.contrast))
    lm = run.model
    target = target_id(lm.tokenizer, o.target)
    contrast = None if o.contrast is None else target_id(lm.tokenizer, o.contrast, "contrast")
    from blockscope.api.common import err

    with progress_bar(err, 1, "patching", not o.out.quiet, o.out.reporter) as tick:
        df = experiment.patch(lm, run.tokens, run.other, target=target, contrast=contrast,
                              sites=o.sites, settings=o.sweep.settings().reporting(tick))
    metric = df.attrs["metric"]
    meta = run.meta("patch", o.prepend_bos, started, corrupted=o.corrupted,
                    corrupted_tokens=run.other[0].tolist(), target=o.target,
                    contrast=o.contrast, sites=o.sites, metric=metric,
                    clean_value=df.attrs["clean"], corrupted_value=df.attrs["corrupted"],
                    **engine_record(df), columns=experiment.MEANING)
    stem = f"patch-{run.spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import patch_plot

        extra[f"{stem}.png"] = patch_plot(df, metric, f"{run.spec.label}: patching "
                                          f"{o.clean!r} into {o.corrupted!r}")
    return write(o, stem, {"": df}, meta, extra=extra,
                 shown=render(df, run.spec.label, o.target, o.contrast))


def render(df, label: str, target: str, contrast: str | None) -> list:
    import pandas as pd

    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    # tokens as the tables show them (␣Paris): a quoted ' Paris' wraps at its own space
    what = f"logit({visible(target)}) - logit({visible(contrast)})" if contrast else \
        f"log_prob({visible(target)})"

    # the strongest sites of each kind patched, so that one kind (resid-pre, which carries
    # everything) cannot fill the table: 10 rows in all, shared between the sites
    sites = list(dict.fromkeys(df["site"]))
    each = max(3, 10 // len(sites))
    top = pd.concat([part.reindex(part["normalized"].abs().sort_values(ascending=False).index)
                     .head(each) for _, part in df.groupby("site", sort=False)])
    shown = top.assign(where=[f"{r.site} L{r.layer} " + (f"head {r.head}" if r.site == "z" else
                                                          f"@{r.position} {visible(r.token)}")
                              for r in top.itertuples()])
    metric = df.attrs["metric"]
    return [table(shown, {"where": ("site", "s"), metric: (metric, "+.3f"),
                          "normalized": ("restored", "+.1%")},
                  title=f"{label}: the sites whose patch moves {what} most",
                  caption=f"clean {df.attrs['clean']:+.3f}, corrupted "
                  f"{df.attrs['corrupted']:+.3f}; the strongest {each} of each site; layers from "
                  "0; every site is in the CSV")]
