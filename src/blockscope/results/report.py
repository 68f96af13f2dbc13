"""The reproduce report: its markdown and the headers and verdicts its tables share."""

from __future__ import annotations


def markdown(table, name, reference, best, headline, missing, pictures, other,
             extra: list[str] = ()) -> str:
    """The reproduce report as markdown: each experiment's figures beside what was
    measured, the residual-norm verdict, the pruning headline, `extra` sections and the
    `pictures` (file names as written)."""
    lines = [f"# blockscope reproduce: {name}", "",
             f"Figures from `{reference}` beside blockscope's measurements. 'within rounding' "
             "means within half a unit of the article's last printed digit.", ""]
    if missing:
        lines += [f"**Measured without the model** ({missing}). Figures marked 'needs the "
                  "model' are listed with the command to run where the hub is reachable.", ""]
    for experiment, group in table.groupby("experiment", sort=False):
        here = own_model(group, other)
        lines += [f"## {experiment}", "", f"| figure | variant | {article_header(here)} | "
                  f"{measured_header(here)} | "
                  "difference | status |", "| --- | --- | ---: | ---: | ---: | --- |"]
        for r in group.itertuples():
            lines.append(f"| {r.figure} | {r.variant} | {r.article} | {r.measured_text} | "
                         f"{r.difference_text} | {r.status} |")
        cmds = group[group["status"] == "needs the model"]["command"].unique()
        lines += [""] + [f"To measure: `{c}`" for c in cmds if c] + [""]
    if best:
        lines += [best_sentence(best)[0].upper() + best_sentence(best)[1:] + ".", ""]
    if headline:
        lines += [f"Head pruning (blockscope's own headline, no article figure): {headline}.", ""]
    lines += list(extra)
    lines += [f"![{p}]({p})" for p in pictures]  # the names the files are written under
    return "\n".join(lines) + "\n"


def own_model(group, other: str | None) -> str | None:
    """`other` where this experiment's figures were measured on its weights; None where
    they need none (parameter counts, layer norm, GPT-2's shapes): those are GPT-2's."""
    return other if other and (group["status"] == f"{other}'s own figure").any() else None


def article_header(other: str | None) -> str:
    return "the article (GPT-2 small)" if other else "article"


def measured_header(other: str | None) -> str:
    return f"measured ({other})" if other else "measured"


def best_sentence(best: tuple[str, int, int]) -> str:
    """The residual-norm verdict, which must not read as a match when nothing matches."""
    name, hits, n = best
    if hits == 0:
        return (f"residual norms: no BOS x weights variant matches any of the {n} figures "
                f"within rounding; the nearest overall is {name}")
    return f"residual norms: {name} matches {hits} of {n} figures within rounding (the most)"
