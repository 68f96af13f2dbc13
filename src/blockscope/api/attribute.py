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
from blockscope.api.pairs import Pairs, SiteOpt, sites_of
from blockscope.api.text_options import Sweep
from blockscope.choices import Attribution, Granularity
from blockscope.errors import BadValue


@dataclass
class AttributeOptions(Options):
    name: ClassVar[str] = "attribute"
    pair: Pairs = group(Pairs)
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
    from blockscope.results.progress import progress_bar

    started = time.perf_counter()
    if o.pair.pairs is not None:
        return many(o, started)
    pair = o.pair
    run, target, contrast = pair.open(o.load, o.prepend_bos, o.bos_token, o.out.quiet)
    edge = o.granularity == "edge"
    with progress_bar(err, 1, "checking", not o.out.quiet, o.out.reporter) as tick:
        if edge:
            from blockscope.experiments.circuit import edge_attribution

            df = edge_attribution(run.model, run.tokens, run.other, target=target,
                                  contrast=contrast, method=o.method.value, steps=o.ig_steps,
                                  check=o.checked, seed=o.seed)
        else:
            df = experiment.attribute(run.model, run.tokens, run.other, target=target,
                                      contrast=contrast, sites=sites_of(o.site),
                                      method=o.method.value, steps=o.ig_steps,
                                      check=o.checked, seed=o.seed,
                                      settings=o.sweep.settings().reporting(tick))
    meta = run.meta("attribute", o.prepend_bos, started, **pair.record(run),
                    **recorded(o, df))
    return written(o, run.spec, df, meta, {}, f"{pair.clean!r} into {pair.corrupted!r}",
                   pair.metric_text())


def many(o: AttributeOptions, started: float):
    """attribute --pairs: every pair estimated, the averaged cells checked in every pair."""
    from blockscope.api.common import err
    from blockscope.experiments import attribute as experiment
    from blockscope.results.progress import progress_bar

    many = o.pair.open_many(o.load, o.prepend_bos, o.bos_token, o.out.quiet,
                            sites=[] if o.granularity == "edge" else sites_of(o.site),
                            seed=o.seed)
    quiet = o.out.quiet or not many.comm.writes
    mine = sum(many.comm.owns(k) for k in range(len(many.items)))
    with progress_bar(err, 2 * mine, "pairs", not quiet, o.out.reporter) as tick:
        common = dict(method=o.method.value, steps=o.ig_steps, check=o.checked, seed=o.seed,
                      settings=o.sweep.settings().reporting(tick), comm=many.comm,
                      kept=o.out.partial)
        if o.granularity == "edge":
            from blockscope.experiments.circuit import edge_attribution_pairs

            df, per_pair = edge_attribution_pairs(many.model, many.items, **common)
        else:
            df, per_pair = experiment.attribute_pairs(many.model, many.items,
                                                      sites=sites_of(o.site), **common)
    if not many.comm.writes:  # rank 0 alone prints and writes
        return None
    meta = many.meta("attribute", o.prepend_bos, started, **recorded(o, df))
    return written(o, many.spec, df, meta, {"-pairs": per_pair},
                   f"averaged over {len(many.items)} pairs ({many.source})",
                   many.metric_text(), many.name, f", {len(many.items)} pairs ({many.name})")


def recorded(o: AttributeOptions, df) -> dict:
    """The sidecar's fields of the method, its rules and the check."""
    from blockscope.experiments import attribute as experiment
    from blockscope.experiments.circuit import MEANING as MEANING_EDGES

    edge = o.granularity == "edge"
    ig = o.method == "ig"
    return dict(granularity=o.granularity.value, sites=None if edge else sites_of(o.site),
                metric=df.attrs["metric"], method=o.method.value,
                ig_steps=o.ig_steps if ig else None, sign=experiment.SIGN_RULE,
                path_rule=experiment.PATH_RULE if ig else None,
                star_rule=experiment.STAR_RULE if o.method == "atp-star" else None,
                clean_value=df.attrs["clean"], corrupted_value=df.attrs["corrupted"],
                attribution=df.attrs["attribution"], check=df.attrs["check"],
                check_rule=experiment.EDGE_CHECK_RULE if edge else experiment.CHECK_RULE,
                seed=o.seed, agreement=df.attrs["agreement"],
                **({} if edge else engine_record(df)),
                columns={**(MEANING_EDGES if edge else experiment.MEANING),
                         **(experiment.MEANING_PAIRS if "ci_low" in df else {})})


def written(o: AttributeOptions, spec, df, meta: dict, more: dict, what: str, metric: str,
            pairs: str | None = None, over: str = ""):
    """The files and the tables of a run, one pair or many (`pairs`: the set's name, in the
    stem; `over`: said after the model's name in the titles)."""
    edge = o.granularity == "edge"
    shown_as = {"atp": "EAP", "ig": "EAP-IG"}[o.method.value] if edge else o.method.value
    stem = f"attribute-{spec.slug}" + (f"-{pairs}" if pairs else "")
    extra = {}
    if o.out.plot and (df["checked"] != "").any():
        from blockscope.results.interchange_plots import attribute_plot

        extra[f"{stem}.png"] = attribute_plot(df.assign(site="edge") if edge else df,
                                              f"{spec.label}: {shown_as} against exact "
                                              f"patching, {what}")
    return write(o, stem, {"": df, **more}, meta, extra=extra,
                 shown=render(df, spec.label + over, metric, shown_as))


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
    columns = {"where": ("edge" if edges else "site", "s"), "normalized": (method, "+.1%")}
    if "ci_low" in shown:  # over pairs: the estimate's interval, then the exact mean's
        from blockscope.results.render import interval

        shown = shown.assign(interval=[interval(a, b) for a, b in
                                       zip(shown["ci_low"], shown["ci_high"], strict=True)])
        columns["interval"] = ("95% CI", "s")
    columns["exact_normalized"] = ("exact", "+.1%")
    tables = [table(shown, columns,
                    title=f"{label}: the {'edges' if edges else 'sites'} {method} says move "
                    f"{what} most",
                    caption=f"0 = corrupted ({df.attrs['corrupted']:+.3f}), 1 = clean "
                    f"({df.attrs['clean']:+.3f})" + ("" if "ci_low" not in shown else
                                                     ", means over pairs; 95% CI: over pairs "
                                                     "by bootstrap")
                    + "; exact: empty where not checked")]
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

