"""`blockscope prune-heads`: which heads matter, and how many can go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err, status, styled
from blockscope.api.corpus_run import passage_command, stability_line, uncertainty_record
from blockscope.api.options import Load, Options, Output, comma_list, group
from blockscope.api.text_options import (
    MethodOpt,
    PassageOptions,
    Sweep,
    WindowOptions,
    check_resample,
    resample_record,
)
from blockscope.choices import HeadOrder, Method
from blockscope.errors import BadValue


@dataclass
class PruneHeads(Options):
    name: ClassVar[str] = "prune-heads"
    passage: PassageOptions = group(PassageOptions)
    load: Load = group(Load)
    method: MethodOpt = Method.zero
    order: Annotated[list[HeadOrder] | None, typer.Option(
        help="Pruning order: gradient, ablation or random; repeat for several curves. "
        "Default: gradient.", metavar="ORDER")] = None
    step: Annotated[float, typer.Option(
        help="Heads removed per step: a fraction of those left, or a count.")] = 0.1
    tolerance: Annotated[float, typer.Option(
        help="Perplexity allowed above the baseline, as a fraction.")] = 0.05
    seed: Annotated[int, typer.Option(
        help="Seed of the random order, the bootstrap and --shuffle.")] = 0
    layers: Annotated[str | None, typer.Option(
        help="Single-head sweep only these layers, e.g. 0,5,11.")] = None
    heads: Annotated[str | None, typer.Option(help="Single-head sweep only these heads.")] = None
    window: WindowOptions = group(WindowOptions)
    sweep: Sweep = group(Sweep)
    out: Output = group(Output)

    @property
    def orders(self) -> list[str]:
        return [o.value for o in (self.order or [HeadOrder.gradient])]

    @property
    def layer_ids(self) -> list[int] | None:
        return comma_list(self.layers, "layers", int)

    @property
    def head_ids(self) -> list[int] | None:
        return comma_list(self.heads, "heads", int)

    def check(self) -> None:
        from blockscope.experiments.prune_heads import check_pruning

        if "ablation" in self.orders and (self.layer_ids or self.head_ids):
            raise BadValue("`order` ablation ranks every head: drop `layers`/`heads`")
        for o in self.orders:
            check_pruning(o, self.step)
        if not 0 <= self.tolerance < float("inf"):
            raise BadValue(f"`tolerance` must be a fraction of 0 or more (got "
                           f"{self.tolerance})")
        check_resample(self.method, self.passage)

    def check_sizes(self, sizes: dict) -> None:
        n_layers, n_heads = sizes["n_layers"], sizes["n_heads"]
        for name, ids, top in (("layers", self.layer_ids, n_layers),
                               ("heads", self.head_ids, n_heads)):
            bad = [i for i in ids or [] if not 0 <= i < top]
            if bad:
                raise BadValue(f"`{name}` {bad[0]} is out of range: 0 to {top - 1}")
        if self.step >= 1 and self.step > n_layers * n_heads:
            raise BadValue(f"`step` {self.step:g} heads is more than the model's "
                           f"{n_layers * n_heads} heads")


@command
def prune_heads(o: PruneHeads):
    """Which heads matter, and how many can go with perplexity within a tolerance.

    Single-head ablation, Michel et al.'s gradient importance, a pruning curve and one head
    per layer. Example: blockscope prune-heads --text data/alice.txt --max-tokens 469
    """
    from blockscope.experiments import heads as experiment
    from blockscope.experiments import prune_heads as pruning

    c = passage_command(o, "prune-heads")
    run = c.run
    ablation, importance, normalised, curves, one = sweeps(o, run, c.settings, c.show)
    if not c.writes:
        return None
    import pandas as pd

    cfg, spec = run.model.cfg, run.spec
    per_head = experiment.head_table(ablation, importance, normalised)
    curve = pd.concat(curves, ignore_index=True)
    headline = pruning.headline(curves, o.tolerance, cfg.n_layers * cfg.n_heads)
    uncertainty = uncertainty_record(ablation)
    said = render(per_head, curves, one, [h["sentence"] for h in headline.values()],
                  spec.label, cfg)
    said.append((stability_line(uncertainty, "head rankings"), {"highlight": False}))

    def plot():
        from blockscope.results.plots import prune_heads_plot

        return prune_heads_plot(per_head, curve, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                tolerance=o.tolerance,
                                title=f"{spec.label} on {run.name}: which heads matter")

    return c.finish(
        {"": per_head, "-curve": curve, "-one-head": one},
        n_scored=curve.loc[0, "n_scored"], ran=(ablation, *curves, one),
        suffix="" if o.method is Method.zero else f"-{o.method.value}", plot=plot, shown=said,
        method=o.method.value, orders=o.orders, step=o.step, tolerance=o.tolerance,
        seed=o.seed, layers=o.layer_ids, heads=o.head_ids, **experiment.MEANINGS,
        uncertainty=uncertainty, **resample_record(o.method, ablation),
        headline={k: {f: v for f, v in h.items() if f != "sentence"}
                  for k, h in headline.items()})


def sweeps(o: PruneHeads, run, settings, show: bool):
    """The four experiments on one clean pass: single-head ablation, gradient importance,
    a pruning curve per order, one head per layer."""
    from blockscope.experiments import heads as experiment
    from blockscope.experiments import prune_heads as pruning
    from blockscope.results.progress import progress_bar

    lm, tokens, cfg = run.model, run.docs, run.model.cfg
    kw = dict(method=o.method.value)
    with status("clean pass, shared by every experiment below", not show):
        kw["prepared"] = experiment.prepare(lm, tokens, settings=settings, **kw)
    n_sweep = len(o.layer_ids or range(cfg.n_layers)) * len(o.head_ids or range(cfg.n_heads))
    with progress_bar(err, n_sweep + 1, "ablating heads one at a time", show,
                      o.out.reporter) as tick:
        ablation = experiment.single_head_ablation(lm, tokens, layers=o.layer_ids,
                                                   heads=o.head_ids,
                                                   settings=settings.reporting(tick), **kw)
    with status("gradient importance: one forward and backward pass", not show):
        importance, normalised = experiment.head_importance(lm, tokens, settings=settings,
                                                            prepared=kw["prepared"])
    curves = []
    for order in o.orders:
        with progress_bar(err, cfg.n_layers * cfg.n_heads + 1, f"pruning ({order} order)",
                          show, o.out.reporter) as tick:
            curves.append(pruning.pruning_curve(lm, tokens, order=order, step=o.step,
                                                ablation=ablation, importance=normalised,
                                                refine=o.tolerance,
                                                settings=settings.reporting(tick), **kw))
    with progress_bar(err, cfg.n_layers + 1, "one head per layer", show,
                      o.out.reporter) as tick:
        one = experiment.one_head_per_layer(lm, tokens, importance,
                                            settings=settings.reporting(tick), **kw)
    return ablation, importance, normalised, curves, one


def render(per_head, curves, one, sentences, name: str, cfg) -> list:
    import torch

    from blockscope.results.render import heat_grid, table

    said = []
    grid = torch.full((cfg.n_layers, cfg.n_heads), float("nan"))
    for r in per_head.itertuples():
        grid[r.layer, r.head] = r.ratio - 1
    said.append(heat_grid(grid, title=f"{name}: perplexity change with one head removed"))
    for c in curves:
        c = c.assign(step=[f"{s}" + (" (1 by 1)" if r else "")
                           for s, r in zip(c["step"], c["refined"], strict=True)])
        said.append(table(c, {"step": ("step", "s"), "heads_removed": ("heads removed", "d"),
                            "share_removed": ("share", ".0%"), "perplexity": ("perplexity", ",.2f"),
                            "ratio": ("x baseline", ".3f"), "kl": ("KL", ".4f")},
                        title=f"pruning curve, {c.loc[0, 'order']} order"))
    one = one.assign(layer=[("baseline" if v != v or v is None else str(v))
                            for v in one["layer"].astype(object).fillna(float("nan"))])
    said.append(table(one, {"layer": ("layer", "s"), "kept_head": ("kept head", "s"),
                          "perplexity": ("perplexity", ",.2f"), "ratio": ("x baseline", ".3f")},
                    title="each layer alone down to its most important head"))
    for s in sentences:
        said.append((styled(s, "bold"), {"highlight": False}))
    return said
