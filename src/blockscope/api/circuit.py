"""`blockscope circuit`: the top edges by EAP or EAP-IG, kept as circuits of growing size, each
circuit's faithfulness measured by patching."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import BosTokenOpt, Load, Options, Output, PromptBosOpt, group
from blockscope.api.output import line, write
from blockscope.api.pairs import Pairs
from blockscope.choices import Attribution
from blockscope.errors import BadValue


@dataclass
class CircuitOptions(Options):
    name: ClassVar[str] = "circuit"
    pair: Pairs = group(Pairs)
    method: Annotated[Attribution, typer.Option(
        help="How edges are ranked: atp (EAP: the gradient at the corrupted run) or ig "
        "(EAP-IG: averaged over --ig-steps points from the corrupted to the clean input)."
        )] = Attribution.ig
    ig_steps: Annotated[int, typer.Option(
        help="Points on the path for --method ig (k/m for k = 0..m-1).")] = 5
    faithfulness: Annotated[float, typer.Option(
        help="The share of the clean - corrupted gap the circuit must carry.")] = 0.8
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    def check(self) -> None:
        from blockscope.experiments.attribute import check_method

        if self.method == "atp-star":
            raise BadValue("`method` atp-star scores nodes; edges are ranked by atp or ig")
        check_method(self.method, self.ig_steps)
        if not 0 < self.faithfulness <= 1:
            raise BadValue(f"`faithfulness` must be a share in (0, 1] (got "
                           f"{self.faithfulness})")


@command
def circuit(o: CircuitOptions):
    """Circuits: rank every edge of the residual stream's graph by EAP (or EAP-IG), keep the
    top N for N on a grid, and measure each circuit's faithfulness by patching every other
    edge to the corrupted run; report the smallest circuit that carries --faithfulness of
    the gap.

    Example: blockscope circuit --clean "The capital of France is" --corrupted "The capital
    of Italy is" --target " Paris" --contrast " Rome"
    """
    from blockscope.experiments import circuit as experiment

    started = time.perf_counter()
    pair = o.pair
    if pair.pairs is not None:
        from blockscope.api.common import err
        from blockscope.results.progress import progress_bar

        run = pair.open_many(o.load, o.prepend_bos, o.bos_token, o.out.quiet)
        mine = sum(run.comm.owns(k) for k in range(len(run.items)))
        with progress_bar(err, mine, "estimating edges, pairs", not o.out.quiet and
                          run.comm.writes, o.out.reporter) as tick:
            curve, ranked = experiment.circuit_pairs(run.model, run.items,
                                                     method=o.method.value, steps=o.ig_steps,
                                                     threshold=o.faithfulness, comm=run.comm,
                                                     progress=tick)
        if not run.comm.writes:  # rank 0 alone prints and writes
            return None
        what, more = f"averaged over {len(run.items)} pairs ({run.source})", {}
        stem = f"circuit-{run.spec.slug}-{run.name}"
    else:
        run, target, contrast = pair.open(o.load, o.prepend_bos, o.bos_token, o.out.quiet)
        curve, ranked = experiment.circuit(run.model, run.tokens, run.other, target=target,
                                           contrast=contrast, method=o.method.value,
                                           steps=o.ig_steps, threshold=o.faithfulness)
        what, more = f"{pair.clean!r} against {pair.corrupted!r}", pair.record(run)
        stem = f"circuit-{run.spec.slug}"
    a = curve.attrs
    name = {"atp": "EAP", "ig": "EAP-IG"}[o.method.value]
    meta = run.meta("circuit", o.prepend_bos, started, **more,
                    metric=a["metric"], method=o.method.value, ranking=name,
                    ig_steps=o.ig_steps if o.method == "ig" else None,
                    clean_value=a["clean"], corrupted_value=a["corrupted"],
                    threshold=o.faithfulness, smallest=a["smallest"],
                    total_edges=a["total_edges"], attribution=a["attribution"],
                    rule=experiment.RULE + (experiment.PAIRS_RULE if pair.pairs else ""),
                    columns=experiment.MEANING)
    extra = {}
    if o.out.plot:
        from blockscope.results.interchange_plots import circuit_plot

        extra[f"{stem}.png"] = circuit_plot(curve, f"{run.spec.label}: circuits of the top "
                                            f"{name} edges, {what}")
    metric = run.metric_text() if pair.pairs else pair.metric_text()
    return write(o, stem, {"": curve, "-edges": ranked}, meta, extra=extra,
                 shown=render(curve, ranked, run.spec.label + (
                     f", {len(run.items)} pairs ({run.name})" if pair.pairs else ""), metric,
                     name))


def render(curve, ranked, label: str, what: str, name: str) -> list:
    from blockscope.results.render import table

    a = curve.attrs
    n, total = a["smallest"], a["total_edges"]
    said = (f"The smallest circuit that carries {a['threshold']:.0%} of the gap: {n:,} of "
            f"{total:,} edges ({n / total:.1%})." if n is not None else
            f"No circuit of the top {name} edges carries {a['threshold']:.0%} of the gap, "
            f"not even all {total:,} edges.")
    rows = curve[curve["on_grid"] | (curve["n_edges"] == (n or -1))]
    columns = {"n_edges": ("edges", ",d"), "share": ("share", ".1%"),
               "faithfulness": ("faithfulness", "+.1%")}
    if "ci_low" in rows:  # over pairs
        from blockscope.results.render import interval

        rows = rows.assign(interval=[interval(a, b) for a, b in
                                     zip(rows["ci_low"], rows["ci_high"], strict=True)])
        columns["interval"] = ("95% CI", "s")
    shown = [line(said),
             table(rows, columns,
                   title=f"{label}: the top {name} edges kept, the rest patched",
                   caption=f"faithfulness: 0 = corrupted ({a['corrupted']:+.3f}), 1 = clean "
                   f"({a['clean']:+.3f}), {what}")]
    top = ranked.head(10).assign(edge=lambda d: d["writer"] + " -> " + d["reader"])
    shown.append(table(top, {"rank": ("rank", "d"), "edge": ("edge", "s"),
                             "normalized": (name, "+.1%")},
                       title=f"The strongest edges by {name}",
                       caption="the estimate of patching that edge alone, restored share; "
                       "every edge is in the -edges CSV"))
    return shown
