"""`blockscope patch`: activation patching, the clean run's activation written into the
corrupted run at one site at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from blockscope.api.common import command, engine_record
from blockscope.api.options import BosTokenOpt, Load, Options, Output, PromptBosOpt, group
from blockscope.api.output import write
from blockscope.api.pairs import Pair, SiteOpt, sites_of
from blockscope.api.text_options import Sweep


@dataclass
class PatchOptions(Options):
    name: ClassVar[str] = "patch"
    pair: Pair = group(Pair)
    site: SiteOpt = None
    sweep: Sweep = group(Sweep)
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    def check(self) -> None:
        from blockscope.experiments.patch import check_sites

        check_sites(sites_of(self.site))


@command
def patch(o: PatchOptions):
    """Activation patching: run the corrupted prompt with one activation of the clean run
    written back, at every (layer, position) or (layer, head), and see how much of the
    clean answer comes back (0: corrupted, 1: clean).

    Example: blockscope patch --clean "The capital of France is" --corrupted "The capital
    of Italy is" --target " Paris" --contrast " Rome" --site resid-pre --site z
    """
    from blockscope.api.common import err
    from blockscope.experiments import patch as experiment
    from blockscope.results.progress import progress_bar

    started = time.perf_counter()
    pair = o.pair
    run, target, contrast = pair.open(o.load, o.prepend_bos, o.bos_token, o.out.quiet)
    with progress_bar(err, 1, "patching", not o.out.quiet, o.out.reporter) as tick:
        df = experiment.patch(run.model, run.tokens, run.other, target=target,
                              contrast=contrast, sites=sites_of(o.site),
                              settings=o.sweep.settings().reporting(tick))
    metric = df.attrs["metric"]
    meta = run.meta("patch", o.prepend_bos, started, **pair.record(run),
                    sites=sites_of(o.site), metric=metric, clean_value=df.attrs["clean"],
                    corrupted_value=df.attrs["corrupted"],
                    **engine_record(df), columns=experiment.MEANING)
    stem = f"patch-{run.spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import patch_plot

        extra[f"{stem}.png"] = patch_plot(df, metric, f"{run.spec.label}: patching "
                                          f"{pair.clean!r} into {pair.corrupted!r}")
    return write(o, stem, {"": df}, meta, extra=extra,
                 shown=render(df, run.spec.label, pair.metric_text()))


def render(df, label: str, what: str) -> list:
    from blockscope.results.render import strongest, table

    shown, each = strongest(df, "normalized")
    metric = df.attrs["metric"]
    return [table(shown, {"where": ("site", "s"), metric: (metric, "+.3f"),
                          "normalized": ("restored", "+.1%")},
                  title=f"{label}: the sites whose patch moves {what} most",
                  caption=f"clean {df.attrs['clean']:+.3f}, corrupted "
                  f"{df.attrs['corrupted']:+.3f}; the strongest {each} of each site; layers from "
                  "0; every site is in the CSV")]
