"""`blockscope prune-blocks`: blocks removed cumulatively, in five orders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err, styled
from blockscope.api.corpus_run import passage_command, uncertainty_record
from blockscope.api.options import Load, Options, Output, group
from blockscope.api.text_options import PassageOptions, Sweep, WindowOptions
from blockscope.choices import BlockOrder
from blockscope.errors import BadValue


@dataclass
class PruneBlocks(Options):
    name: ClassVar[str] = "prune-blocks"
    passage: PassageOptions = group(PassageOptions)
    load: Load = group(Load)
    order: Annotated[list[BlockOrder] | None, typer.Option(
        help="Removal order: greedy (SLEB), ablation, influence (ShortGPT), angular (Gromov "
        "et al.: a window, not cumulative) or random; repeat for several curves. Default: "
        "greedy.", metavar="ORDER")] = None
    tolerance: Annotated[float, typer.Option(
        help="Perplexity allowed above the baseline, as a fraction.")] = 0.05
    max_removed: Annotated[int | None, typer.Option(
        help="Stop after this many blocks (default: all of them).")] = None
    seed: Annotated[int, typer.Option(
        help="Seed of the random order, the bootstrap and --shuffle.")] = 0
    window: WindowOptions = group(WindowOptions)
    sweep: Sweep = group(Sweep)
    out: Output = group(Output)

    @property
    def orders(self) -> list[str]:
        return list(dict.fromkeys(o.value for o in (self.order or [BlockOrder.greedy])))

    def check(self) -> None:
        if not 0 <= self.tolerance < float("inf"):
            raise BadValue(f"`tolerance` must be a fraction of 0 or more (got "
                           f"{self.tolerance})")
        if self.max_removed is not None and self.max_removed < 1:
            raise BadValue(f"`max_removed` must be at least 1 (got {self.max_removed})")

    def check_sizes(self, sizes: dict) -> None:
        if self.max_removed is not None and self.max_removed > sizes["n_layers"]:
            raise BadValue(f"`max_removed` {self.max_removed} is more than the model's "
                           f"{sizes['n_layers']} blocks")


@command
def prune_blocks(o: PruneBlocks):
    """Remove blocks cumulatively (each one's output := its input) and report perplexity
    after every step, per order, with the most blocks that can go within a tolerance.

    Example: blockscope prune-blocks --text data/alice.txt --order greedy --order influence
    """
    from blockscope.experiments import prune_blocks as experiment
    from blockscope.results.progress import progress_bar

    c = passage_command(o, "prune-blocks")
    run = c.run
    n_layers = run.model.cfg.n_layers
    top = o.max_removed or n_layers
    with progress_bar(err, len(o.orders) * top + 1, "removing blocks", c.show,
                      o.out.reporter) as tick:
        curves, metrics = experiment.block_curve(
            run.model, run.docs, orders=o.orders, max_removed=top,
            settings=c.settings.reporting(tick))
    if not c.writes:
        return None
    import pandas as pd

    curve = pd.concat(curves, ignore_index=True)
    found = experiment.headline(curves, o.tolerance, n_layers)
    said = [curve_table(one, c.title) for one in curves]
    said += [(styled(h["sentence"], "bold"), {"highlight": False}) for h in found.values()]

    def plot():
        from blockscope.results.plots import prune_blocks_plot

        return prune_blocks_plot(curve, n_layers=n_layers, tolerance=o.tolerance,
                                 title=f"{c.title}: blocks removed together")

    return c.finish(
        {"": curve}, n_scored=curve.loc[0, "n_scored"], ran=tuple(curves), plot=plot,
        shown=said, orders=o.orders, tolerance=o.tolerance, max_removed=top, seed=o.seed,
        removal="each removed block's output := its input", **experiment.MEANINGS,
        block_metrics=metrics, uncertainty=uncertainty_record(curves[0]),
        headline={k: {f: v for f, v in h.items() if f != "sentence"} for k, h in found.items()})


def curve_table(c, title: str):
    from blockscope.results.render import table, with_intervals

    ci = c["ci_low"].notna().any()
    shown = c.assign(
        blocks=[r or "none" for r in c["removed"]],
        ppl=[with_intervals(r.perplexity, r.ci_low, r.ci_high, ",.2f") for r in c.itertuples()])
    return table(shown, {"step": ("step", "d"), "n_removed": ("n", "d"),
                         "blocks": ("blocks removed", "s"),
                         "share_params": ("params", ".0%"),
                         "ppl": ("perplexity [95% CI]" if ci else "perplexity", "s"),
                         "ratio": ("x baseline", ".3f"), "kl": ("KL", ".4f")},
                 title=f"{title}: {c.loc[0, 'order']} order", styles={0: "bold"},
                 caption="Blocks count from 0, listed in the order removed"
                 + ("; the angular order removes one window per n, not a cumulative set."
                    if c.loc[0, "order"] == "angular" else "."))
