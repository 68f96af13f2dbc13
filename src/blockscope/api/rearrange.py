"""`blockscope rearrange`: blocks swapped, reversed, repeated or run side by side."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err
from blockscope.api.corpus_run import passage_command, uncertainty_record
from blockscope.api.options import Load, Options, Output, group
from blockscope.api.text_options import PassageOptions, Sweep, WindowOptions
from blockscope.errors import BadValue


class Arrangements(str, Enum):
    adjacent_swaps = "adjacent-swaps"


@dataclass
class RearrangeOptions(Options):
    name: ClassVar[str] = "rearrange"
    passage: PassageOptions = group(PassageOptions)
    load: Load = group(Load)
    swap: Annotated[list[str] | None, typer.Option(
        help="Swap blocks i,j (e.g. 3,4); repeatable, one row each.", metavar="I,J")] = None
    reverse: Annotated[list[str] | None, typer.Option(
        help="Run blocks i to j (both included) in reverse order, e.g. 2:5.",
        metavar="I:J")] = None
    repeat: Annotated[list[str] | None, typer.Option(
        help="Run block i N times in all (default 2), e.g. 6 or 6x3.", metavar="I[xN]")] = None
    parallel: Annotated[list[str] | None, typer.Option(
        help="Run blocks i to j side by side on the same input, their writes summed, e.g. "
        "4:7.", metavar="I:J")] = None
    sweep_kind: Annotated[list[Arrangements] | None, typer.Option(
        "--sweep", help="A whole sweep: adjacent-swaps (every adjacent pair swapped, one "
        "at a time).", metavar="SWEEP")] = None
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap and --shuffle.")] = 0
    window: WindowOptions = group(WindowOptions)
    sweep: Sweep = group(Sweep)
    out: Output = group(Output)

    def given(self) -> list[tuple[str, str]]:
        return [(k, t) for k in ("swap", "reverse", "repeat", "parallel")
                for t in getattr(self, k) or []]

    def check(self) -> None:
        if not self.given() and not self.sweep_kind:
            raise BadValue("give at least one of `swap`, `reverse`, `repeat`, `parallel` "
                           "or `sweep`")

    def check_sizes(self, sizes: dict) -> None:
        self.arrangements(sizes["n_layers"])

    def arrangements(self, n_layers: int) -> list:
        from blockscope.experiments.rearrange import adjacent_swaps, arrangement

        found = [arrangement(k, t, n_layers) for k, t in self.given()]
        if self.sweep_kind:
            found += adjacent_swaps(n_layers)
        return found


@command
def rearrange(o: RearrangeOptions):
    """Run blocks in another arrangement (swapped, reversed, repeated, or side by side) and
    report perplexity and the KL divergence from the clean model, one row per arrangement.

    Example: blockscope rearrange --text data/alice.txt --sweep adjacent-swaps --reverse 4:7
    """
    from blockscope.experiments import rearrange as experiment
    from blockscope.results.progress import progress_bar

    c = passage_command(o, "rearrange")
    run = c.run
    arrangements = o.arrangements(run.model.cfg.n_layers)
    with progress_bar(err, len(arrangements) + 1, "rearranging blocks", c.show,
                      o.out.reporter) as tick:
        df = experiment.rearranged(
            run.model, run.docs, arrangements, settings=c.settings.reporting(tick))
    if not c.writes:
        return None

    def plot():
        from blockscope.results.plots import ablation_plot

        return ablation_plot(df, f"{c.title}: blocks rearranged",
                             labels=list(df["arrangement"].iloc[1:]),
                             xlabel="arrangement (blocks count from 0)")

    return c.finish({"": df}, n_scored=df.loc[0, "n_scored"], plot=plot,
                    shown=[arrangement_table(df, c.title)],
                    arrangements=[a.name for a in arrangements], **experiment.MEANINGS,
                    uncertainty=uncertainty_record(df))


def arrangement_table(df, title: str):
    from blockscope.results.render import table, with_intervals

    ci = df["ci_low"].notna().any()
    n_layers = len(df.loc[0, "order"].split())
    shown = df.assign(ppl=[with_intervals(r.perplexity, r.ci_low, r.ci_high, ",.2f")
                           for r in df.itertuples()],
                      order=[f"as built, 0 to {n_layers - 1}" if i == 0 else
                             _around(r.order, r.first, r.last, n_layers)
                             for i, r in enumerate(df.itertuples())])
    return table(shown, {"arrangement": ("arrangement", "s"),
                         "ppl": ("perplexity [95% CI]" if ci else "perplexity", "s"),
                         "ratio": ("x baseline", ".3f"), "kl": ("KL", ".4f"),
                         "order": ("blocks run", "s")},
                 title=title, styles={0: "bold"},
                 caption="Blocks count from 0; i:j includes both ends; (a+b): run side by "
                 "side on one input, writes summed; the changed run of blocks with one "
                 "either side (the CSV has the whole order). KL: mean KL(clean || "
                 "arranged), nats.")


def _around(order: str, first: int, last: int, n_layers: int) -> str:
    """The blocks as they run, from the one before the changed run to the one after."""
    steps, first, last = order.split(), int(first), int(last)
    changed = len(steps) - first - (n_layers - last - 1)  # steps of the changed run
    lo, hi = max(first - 1, 0), min(first + changed + 1, len(steps))
    return " ".join((["..."] if lo > 0 else []) + steps[lo:hi]
                    + (["..."] if hi < len(steps) else []))
