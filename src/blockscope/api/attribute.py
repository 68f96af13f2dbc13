"""`blockscope attribute`: every cell of `patch`'s grid estimated from gradients (attribution
patching, or integrated gradients), each run checked against exact patching."""

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
from blockscope.choices import Attribution
from blockscope.errors import BadValue


@dataclass
class AttributeOptions(Options):
    name: ClassVar[str] = "attribute"
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
        help="What is estimated (repeatable): resid-pre, attn-out, mlp-out (every layer x "
        "position) or z (every layer x head, all positions), as patch patches it. Default: "
        "resid-pre.", show_default=False)] = None
    method: Annotated[Attribution, typer.Option(
        help="atp: the gradient at the corrupted run (two forwards, one backward); ig: the "
        "gradient averaged over --ig-steps points from the corrupted to the clean input."
        )] = Attribution.atp
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
    def sites(self) -> list[str]:
        return list(dict.fromkeys(self.site or ["resid-pre"]))

    @property
    def checked(self) -> int | None:
        """The per-site count of --check, or None for every cell."""
        text = str(self.check_cells).strip().lower()
        return None if text == "all" else int(text)

    def check(self) -> None:
        from blockscope.experiments.attribute import check_count, check_method
        from blockscope.experiments.patch import check_sites

        check_sites(self.sites)
        tokens_given(target=self.target, contrast=self.contrast)
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
    from blockscope.experiments.logit_lens import target_id
    from blockscope.experiments.patch import check_lengths
    from blockscope.results.render import progress_bar

    started = time.perf_counter()
    run = two_prompts(o.clean, o.corrupted, o.load, o.prepend_bos, o.bos_token, o.out.quiet,
                      check_lengths, one_token_each(target=o.target, contrast=o.contrast))
    lm = run.model
    target = target_id(lm.tokenizer, o.target)
    contrast = None if o.contrast is None else target_id(lm.tokenizer, o.contrast, "contrast")
    with progress_bar(err, 1, "checking", not o.out.quiet, o.out.reporter) as tick:
        df = experiment.attribute(lm, run.tokens, run.other, target=target, contrast=contrast,
                                  sites=o.sites, method=o.method.value, steps=o.ig_steps,
                                  check=o.checked, seed=o.seed,
                                  settings=o.sweep.settings().reporting(tick))
    metric = df.attrs["metric"]
    meta = run.meta("attribute", o.prepend_bos, started, corrupted=o.corrupted,
                    corrupted_tokens=run.other[0].tolist(), target=o.target,
                    contrast=o.contrast, sites=o.sites, metric=metric,
                    method=o.method.value, ig_steps=o.ig_steps if o.method == "ig" else None,
                    sign=experiment.SIGN_RULE, path_rule=experiment.PATH_RULE
                    if o.method == "ig" else None,
                    clean_value=df.attrs["clean"], corrupted_value=df.attrs["corrupted"],
                    attribution=df.attrs["attribution"], check=df.attrs["check"],
                    check_rule=experiment.CHECK_RULE, seed=o.seed,
                    agreement=df.attrs["agreement"], **engine_record(df),
                    columns=experiment.MEANING)
    stem = f"attribute-{run.spec.slug}"
    extra = {}
    if o.out.plot and (df["checked"] != "").any():
        from blockscope.results.interchange_plots import attribute_plot

        extra[f"{stem}.png"] = attribute_plot(df, f"{run.spec.label}: {o.method.value} "
                                              f"against exact patching, {o.clean!r} into "
                                              f"{o.corrupted!r}")
    return write(o, stem, {"": df}, meta, extra=extra,
                 shown=render(df, run.spec.label, o.target, o.contrast, o.method.value))


def render(df, label: str, target: str, contrast: str | None, method: str) -> list:
    import math

    import pandas as pd

    from blockscope.experiments.attribute import where
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    what = f"logit({visible(target)}) - logit({visible(contrast)})" if contrast else \
        f"log_prob({visible(target)})"
    sites = list(dict.fromkeys(df["site"]))
    each = max(3, 10 // len(sites))
    top = pd.concat([part.reindex(part["normalized"].abs().sort_values(ascending=False).index)
                     .head(each) for _, part in df.groupby("site", sort=False)])
    shown = top.assign(where=[where(r) + (f" {visible(r['token'])}" if r["site"] != "z" else "")
                              for _, r in top.iterrows()])
    tables = [table(shown, {"where": ("site", "s"), "normalized": (method, "+.1%"),
                            "exact_normalized": ("exact", "+.1%")},
                    title=f"{label}: the sites {method} says move {what} most",
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
            "site": ("site", "s"), "checked": ("cells", "d"), "pearson": ("Pearson", ".2f"),
            "spearman": ("Spearman", ".2f"), "miss": ("miss", ".1%"),
            "at": ("at", "s"), "random": ("random", ".1%")},
            title=f"How far to trust {method}: estimate against exact patching",
            caption="cells: checked, but the inert ones (the patch writes what is there); "
            "miss: the largest |estimate - exact|, restored share; random: the largest "
            "|exact| among the cells drawn at random"))
    return tables
