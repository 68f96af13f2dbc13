"""The reproduce report's attribution section: how far attribution patching can be trusted on
the model in use, and the smallest circuit that carries the pair's gap.

Not the article's: it patches one site at a time and does not estimate. The section holds
`attribute`'s estimate, per site, to the whole exact grid (`attribute --check all`) for one
pair of facts of one template, and `circuit`'s smallest circuit, both with the settings of
[attribution] in the reference."""

from __future__ import annotations

import pandas as pd

from blockscope.experiments.reproduce.figures import no_stage


def attribution_measures(model, settings: dict, stage=no_stage) -> tuple[pd.DataFrame, dict]:
    """(one row per site: `site, cells, pearson, spearman, largest_miss`, the estimate set
    against the full exact grid; {"smallest", "total_edges", "threshold", "method"} of the
    circuit, or {"why": ...} where the pair cannot be measured on this tokenizer)."""
    from blockscope.errors import BlockscopeError
    from blockscope.experiments import attribute, circuit
    from blockscope.experiments.logit_lens import target_id
    from blockscope.experiments.patch import check_lengths
    from blockscope.inputs.text import tokenize

    s = settings["attribution"]
    clean, corrupted = (tokenize(model.tokenizer, s[k], prepend_bos=True)
                        for k in ("clean", "corrupted"))
    try:
        check_lengths(clean.shape[-1], corrupted.shape[-1])
        target = target_id(model.tokenizer, s["target"])
        contrast = target_id(model.tokenizer, s["contrast"], "contrast")
    except BlockscopeError as exc:
        return pd.DataFrame(), {"why": str(exc)}
    sites = s.get("sites", ["resid-pre", "attn-out", "mlp-out", "z"])
    with stage("attribution: the estimate against every exact patch, and a circuit", 2) as step:
        df = attribute.attribute(model, clean, corrupted, target=target, contrast=contrast,
                                 sites=sites, method=s.get("method", "atp"), check=None)
        step()
        curve, _ = circuit.circuit(model, clean, corrupted, target=target, contrast=contrast,
                                   method=s.get("circuit_method", "ig"),
                                   steps=s.get("ig_steps", 5),
                                   threshold=s.get("faithfulness", 0.8))
        step()
    rows = []
    for site, rec in df.attrs["agreement"].items():
        miss = rec.get("largest_miss", {})
        rows.append({"site": site, "cells": rec["checked"], "pearson": rec["pearson"],
                     "spearman": rec["spearman"],
                     "largest_miss": (f"{miss['where']}: {miss['normalized']:+.2f} for "
                                      f"{miss['exact_normalized']:+.2f}" if miss else "")})
    a = curve.attrs
    return pd.DataFrame(rows), {"smallest": a["smallest"], "total_edges": a["total_edges"],
                                "threshold": a["threshold"],
                                "method": s.get("circuit_method", "ig")}


def attribution_section(settings: dict, trust: pd.DataFrame | None, found: dict | None,
                        name: str) -> list[str]:
    """The report's markdown lines for the section."""
    if "attribution" not in settings:
        return []
    s = settings["attribution"]
    pair = f"{s['clean']!r} -> {s['corrupted']!r}, target {s['target']!r}, contrast " \
           f"{s['contrast']!r}"
    lines = ["## Where attribution can be trusted (not the article's)", ""]
    if trust is None:
        return lines + ["Needs the model: `blockscope attribute --check all` and `blockscope "
                        f"circuit` with --model MODEL on {pair}.", ""]
    if found.get("why"):
        return lines + [f"Not measured on {name}: {found['why']}.", ""]
    method = s.get("method", "atp")
    lines += [f"Measured on {name} with `blockscope attribute --method {method} --check all`, "
              f"{pair}: the estimate of every cell against its exact patch (cells where the "
              "two prompts' activations differ).", "",
              "| site | cells | Pearson | Spearman | largest miss (estimate for exact) |",
              "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.site} | {r.cells} | {r.pearson:.2f} | {r.spearman:.2f} | "
              f"{r.largest_miss} |" for r in trust.itertuples()]
    ranking = {"atp": "EAP", "ig": "EAP-IG"}[found["method"]]
    n, total = found["smallest"], found["total_edges"]
    lines += ["", (f"`blockscope circuit` ({ranking}): the smallest circuit that carries "
                   f"{found['threshold']:.0%} of the gap, measured by patching every other "
                   f"edge, is {n:,} of {total:,} edges." if n is not None else
                   f"`blockscope circuit` ({ranking}): no circuit of its top edges carries "
                   f"{found['threshold']:.0%} of the gap."), ""]
    return lines
