"""`reproduce` as one pure function: every section of the article measured on one model
(what needs no weights always; the rest where the model loaded), set beside the article's
figures and claims."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from blockscope.experiments.reproduce import figures as rp
from blockscope.experiments.reproduce import sections
from blockscope.experiments.reproduce.attribution import attribution_measures
from blockscope.experiments.reproduce.mlp import mlp_measures


@dataclass
class Reproduction:
    """What `reproduce` measured and how it compares with the article."""

    table: pd.DataFrame  # one row per figure (and variant): article vs measured
    frames: dict = field(default_factory=dict)  # each experiment's own table, for pictures
    best: tuple | None = None  # the BOS x weights variant closest to the article's norms
    headline: str | None = None  # prune-heads' headline sentence
    model_claims: pd.DataFrame | None = None  # the article's claims, tested on this model
    roles: pd.DataFrame | None = None  # known head roles, found or not
    norm_claims: pd.DataFrame | None = None  # norm-placement's claims
    mlp_claims: pd.DataFrame | None = None  # the MLP section's claims (lens, neurons)
    trust: pd.DataFrame | None = None  # attribution against the exact grid, per site
    circuit: dict | None = None  # the smallest circuit carrying the pair's gap


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


def reproduce(model, settings: dict, figures: list, *, name: str, label: str,
              other: str | None, shape_model, norm: bool, stage=rp.no_stage,
              load_processed=None) -> Reproduction:
    """Measure every section the reference asks for and compare.

    Args:
        model: the loaded model, or None (offline and not cached): then only what needs no
            weights is measured, and the rest is listed with the command to run.
        name, label: the model's name (for commands) and how titles call it.
        other: set when the model is known not to be the article's: the figures of its
            weights are its own, and its claims are compared instead.
        shape_model: a model whose shapes and tokenizer stand in for counts (None: none).
        norm: run norm-placement's training for the pre- vs post-norm claims.
        load_processed: `() -> model` with processed weights, for the residual variants.
    """
    frames: dict = {}
    measured = rp.offline_measures(settings, figures, shape_model, frames)
    offline = set(measured)
    roles = mlp_claims = trust = found = None
    if model is not None:
        more, model_frames = rp.model_measures(model, settings, stage=stage,
                                               load_processed=load_processed)
        measured.update(more)
        frames.update(model_frames)
        if "head_roles" in settings:
            with stage("head roles: previous-token, duplicate-token, induction", 1) as step:
                roles = sections.head_role_checks(model, settings, other)
                step()
        if "mlp" in settings:
            mlp_claims, mlp_frames = mlp_measures(model, settings, stage)
            frames.update(mlp_frames)
        if "attribution" in settings:
            trust, found = attribution_measures(model, settings, stage)
    own = set(measured) - offline  # measured on the model's own weights
    norm_claims = None
    if norm and "norm_placement" in settings:
        norm_claims, norm_frames = sections.norm_measures(settings, stage)
        frames.update(norm_frames)
    table = rp.compare(figures, measured, commands(name, settings),
                       model_loaded=model is not None, other=other, own=own)
    headline = None
    if "prune.heads_removed" in measured:
        headline = (f"{int(measured['prune.heads_removed'])} of {int(measured['prune.n_heads'])}"
                    f" heads ({measured['prune.share']:.0%}) can go within "
                    f"+{settings['prune_heads'].get('tolerance', 0.05):.0%} perplexity "
                    "(gradient order)")
    return Reproduction(
        table, frames, best=None if other else rp.best_resid_variant(table), headline=headline,
        model_claims=None if model is None else sections.article_claims(figures, measured,
                                                                        frames, label),
        roles=roles, norm_claims=norm_claims, mlp_claims=mlp_claims, trust=trust,
        circuit=found)


def n_stages(settings: dict, with_model: bool, norm: bool) -> int:
    """How many experiments the run says one line each for."""
    n = sum(k in settings for k in ("ablate", "resid_norm", "prune_heads", "head_roles",
                                    "mlp", "attribution")) if with_model else 0
    return n + (norm and "norm_placement" in settings)
