"""`blockscope attribute`: every cell of `patch`'s grid estimated from gradients (attribution
patching, or integrated gradients), each run checked against exact patching."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, engine_record
from blockscope.api.options import BosTokenOpt, Load, Options, Output, PromptBosOpt, group
from blockscope.api.output import write
from blockscope.api.text_options import Pair, SiteOpt, Sweep, sites_of
from blockscope.choices import Attribution, Granularity
from blockscope.errors import BadValue


@dataclass
class AttributeOptions(Options):
    name: ClassVar[str] = "attribute"
    pair: Pair = group(Pair)
    site: SiteOpt = None
    method: Annotated[Attribution, typer.Option(
        help="atp: the gradient at the corrupted run (two forwards, one backward); ig: the "
        "gradient averaged over --ig-steps points from the corrupted to the clean input; "
        "atp-star: atp with the QK fix for q and k, and GradDrop's bound (one more backward "
        "per block) to rank the cells by.")] = Attribution.atp
    granularity: Annotated[Granularity, typer.Option(
        help="node: patch's cells (--site); edge: every edge from the embedding, a head or "
        "an MLP into a head's query, key or value, an MLP or the logits (EAP; EAP-IG with "
        "--method ig).")] = Granularity.node
    ig_steps: Annotated[int, typer.Option(
        help="Points on the path for --method ig (k/m for k = 0..m-1; 1 is atp).")] = 5
    check_cells: Annotated[str, typer.Option(
        "--check", help="Cells patched exactly to check the estimates, per site: the K "
        "largest |estimates| and K drawn from the rest (--seed); 'all' patches every cell; "
        "0 checks none.")] = "20"
    seed: Annotated[int, typer.Option(help="The seed of the randomly checked cells.")] = 0
    sweep: Sweep = group(Sweep)
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    @property
    def checked(self) -> int | None:
        """The per-site count of --check, or None for every cell."""
        text = str(self.check_cells).strip().lower()
        return None if text == "all" else int(text)

    def check(self) -> None:
        from blockscope.experiments.attribute import check_count, check_method
        from blockscope.experiments.patch import check_sites

        check_sites(sites_of(self.site))
        if self.granularity == "edge" and self.site:
            raise BadValue("`site` goes with node granularity: edges join every component")
        if self.granularity == "edge" and self.method == "atp-star":
            raise BadValue("`method` atp-star scores nodes; edges are scored by atp or ig")
        text = str(self.check_cells).strip().lower()
        if text != "all" and not text.lstrip("-").isdigit():
            raise BadValue(f"`check_cells` must be a count or all (got {self.check_cells})")
        check_count(self.checked)
        check_method(self.method, self.ig_steps)


@command
def attribute(o: AttributeOptions):
    """Attribution patching: every cell of patch's grid estimated from gradients in a few
    passes, and checked against exact patching of the largest estimates and a random sample
    of the rest (Pearson and Spearman correlations, the largest miss).

    Example: blockscope attribute --clean "The capital of France is" --corrupted "The
    capital of Italy is" --target " Paris" --contrast " Rome" --site resid-pre --site z
    """
    from blockscope.api.common import err
    from blockscope.experiments import attribute as experiment
    from blockscope.results.render import progress_bar

    started = time.perf_counter()
    pair = o.pair
    run, target, contrast = pair.open(o.load, o.prepend_bos, o.bos_token, o.out.quiet)
    edge = o.granularity == "edge"
    with progress_bar(err, 1, "checking", not o.out.quiet, o.out.reporter) as tick:
        if edge:
            from blockscope.experiments.circuit import MEANING, edge_attribution

            df = edge_attribution(run.model, run.tokens, run.other, target=target,
                                  contrast=contrast, method=o.method.value, steps=o.ig_steps,
                                  check=o.checked, seed=o.seed)
        else:
            MEANING = experiment.MEANING
            df = experiment.attribute(run.model, run.tokens, run.other, target=target,
                                      contrast=contrast, sites=sites_of(o.site),
                                      method=o.method.value, steps=o.ig_steps,
                                      check=o.checked, seed=o.seed,
                                      settings=o.sweep.settings().reporting(tick))
    ig = o.method == "ig"
    meta = run.meta("attribute", o.prepend_bos, started, **pair.record(run),
                    granularity=o.granularity.value, sites=None if edge else sites_of(o.site),
                    metric=df.attrs["metric"], method=o.method.value,
                    ig_steps=o.ig_steps if ig else None, sign=experiment.SIGN_RULE,
                    path_rule=experiment.PATH_RULE if ig else None,
                    star_rule=experiment.STAR_RULE if o.method == "atp-star" else None,
                    clean_value=df.attrs["clean"], corrupted_value=df.attrs["corrupted"],
                    attribution=df.attrs["attribution"], check=df.attrs["check"],
                    check_rule=experiment.EDGE_CHECK_RULE if edge else experiment.CHECK_RULE,
                    seed=o.seed, agreement=df.attrs["agreement"],
                    **({} if edge else engine_record(df)), columns=MEANING)
    shown_as = {"atp": "EAP", "ig": "EAP-IG"}[o.method.value] if edge else o.method.value
    stem = f"attribute-{run.spec.slug}"
    extra = {}
    if o.out.plot and (df["checked"] != "").any():
        from blockscope.results.interchange_plots import attribute_plot

        extra[f"{stem}.png"] = attribute_plot(df.assign(site="edge") if edge else df,
                                              f"{run.spec.label}: {shown_as} "
                                              f"against exact patching, {pair.clean!r} into "
                                              f"{pair.corrupted!r}")
    return write(o, stem, {"": df}, meta, extra=extra,
                 shown=render(df, run.spec.label, pair.metric_text(), shown_as))


def render(df, label: str, what: str, method: str) -> list:
    import math

    import pandas as pd

    from blockscope.results.render import strongest, table

    edges = "writer" in df
    if edges:  # the 10 strongest edges, named writer -> reader
        shown = df.reindex(df["normalized"].abs().sort_values(ascending=False).index).head(10)
        shown = shown.assign(where=shown["writer"] + " -> " + shown["reader"])
    else:
        shown, _ = strongest(df, "normalized")
    tables = [table(shown, {"where": ("edge" if edges else "site", "s"),
                            "normalized": (method, "+.1%"),
                            "exact_normalized": ("exact", "+.1%")},
                    title=f"{label}: the {'edges' if edges else 'sites'} {method} says move "
                    f"{what} most",
                    caption=f"0 = corrupted ({df.attrs['corrupted']:+.3f}), 1 = clean "
                    f"({df.attrs['clean']:+.3f}); exact: empty where not checked")]
    agree = df.attrs["agreement"]
    if agree:
        rows = []
        for site, rec in agree.items():
            miss = rec.get("largest_miss", {})
            rand = rec.get("largest_random_exact", {})
            rows.append({"site": site, "checked": rec["checked"], "pearson": rec["pearson"],
                         "spearman": rec["spearman"],
                         "miss": abs(miss.get("normalized", math.nan)
                                     - miss.get("exact_normalized", math.nan)),
                         "at": miss.get("where", "").removeprefix(site).strip(),
                         "random": abs(rand.get("exact_normalized", math.nan))})
        tables.append(table(pd.DataFrame(rows), {
            "site": ("site", "s"), "checked": ("edges" if edges else "cells", "d"),
            "pearson": ("Pearson", ".2f"),
            "spearman": ("Spearman", ".2f"), "miss": ("miss", ".1%"),
            "at": ("at", "s"), "random": ("random", ".1%")},
            title=f"How far to trust {method}: estimate against exact patching",
            caption="cells: checked, but the inert ones (the patch writes what is there); "
            "miss: the largest |estimate - exact|, restored share; random: the largest "
            "|exact| among the cells drawn at random"))
    return tables
