"""Which heads matter, and how many can go (Michel et al. 2019; Voita et al. 2019).

- `single_head_ablation`: perplexity with each head removed (z zeroed before W_O, or replaced
  by its clean mean over positions).
- `head_importance`: Michel et al.'s |dLoss/dmask| for a head mask multiplying each z, from
  one forward and backward pass with the weights frozen, plus the per-layer L2-normalised
  score their code prunes by.
- `one_head_per_layer`: keep only each layer's most important head in turn.

The pruning curve built on these is in `pruning`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.choices import Method, one_of
from blockscope.errors import BadValue
from blockscope.inputs.corpus import as_docs
from blockscope.interventions import Resampled, mean_points, scale_heads
from blockscope.sweeps import scoring
from blockscope.sweeps.gradient import gradient_pass
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

# What prune-heads' figures mean, for its sidecar.
MEANINGS = {
    "importance": "|d mean NLL / d head mask|, mask multiplying z; normalised per layer (L2)",
    "gradient_order": "normalised importance re-computed after every step; with the cached "
    "engine and --method zero each step's perplexity is read off that same forward pass (the "
    "hooked model with the step's mask), not from a second one",
    "one_head_per_layer": "kept head = the layer's highest gradient importance",
}


def prepare(model, tokens, *, method: str = "zero", settings: RunSettings = RunSettings()
            ) -> scoring.Prepared:
    """The clean passes (or NLL) and, for `method` mean, the clean mean z (for resample, the
    documents' partners, drawn with `settings.seed`) that every head experiment below
    starts from: computed once, passed to each as `prepared=`."""
    return prepare_fill(model, as_docs(tokens), method, settings)[0]


def prepare_fill(model, docs, method: str, settings: RunSettings,
                 prepared: scoring.Prepared | None = None
                 ) -> tuple[scoring.Prepared, dict | None]:
    """`prepared` (made here if None), and `fill`: None for zero ablation, else each
    layer's clean mean z over positions (n_heads, d_head), or its z on another document
    (`Resampled`, drawn per document by the sweep)."""
    one_of(Method, method, "method")
    names = [n for i in range(model.cfg.n_layers)  # where each layer's z is read
             for n in mean_points(scale_heads(i, torch.ones(model.cfg.n_heads)))]
    if prepared is None:
        prepared = scoring.prepare(model, docs, settings, heads=True,
                                   mean_names=names if method == "mean" else (),
                                   resample=names if method == "resample" else ())
    elif prepared.engine != settings.engine or not set(names) <= set(
            {"mean": prepared.means, "resample": prepared.resample}.get(method, names)):
        raise ValueError(f"`prepared` was made for another engine or method than "
                         f"{settings.engine}/{method}")
    fill = ({i: prepared.means[n] for i, n in enumerate(names)} if method == "mean" else
            {i: Resampled(n) for i, n in enumerate(names)} if method == "resample" else None)
    return prepared, fill


def _head_sweep(model, docs, items, settings: RunSettings, *, prepared, fill):
    """Score `items` = [(label, layer, keep (n_heads,))], each changing one layer's heads."""
    variants = [Variant(label, (scale_heads(layer, keep, fill[layer] if fill else None),))
                for label, layer, keep in items]
    return scoring.run(model, docs, variants, settings, prepared=prepared)


def _check(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    values = list(range(n)) if values is None else list(values)
    if not values or any(not 0 <= v < n for v in values):
        raise BadValue(f"`{what}` must be between 0 and {n - 1}")
    return values


def single_head_ablation(
    model, tokens, *, method: str = "zero", layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None, prepared: scoring.Prepared | None = None,
    settings: RunSettings = RunSettings(),
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone. `tokens`: a passage
    `(1, pos)` or `corpus.Docs`; `settings.ci`: bootstrap intervals (`stats.frame`);
    `prepared`: from `prepare` with the same method and settings, if at hand."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    docs = as_docs(tokens)
    prepared, fill = prepare_fill(model, docs, method, settings, prepared)
    items = []
    for layer in layers:
        for head in heads:
            keep = torch.ones(cfg.n_heads)
            keep[head] = 0
            items.append(({"layer": layer, "head": head, "method": method}, layer, keep))
    df = _head_sweep(model, docs, items, settings, prepared=prepared, fill=fill)
    df[["layer", "head"]] = df[["layer", "head"]].astype("Int64")
    df.loc[0, "method"] = "none"
    if method == "resample":
        df.attrs["resample"] = scoring.pairing(docs, prepared)
    return df


def head_importance(
    model, tokens, *, keep: torch.Tensor | None = None,
    prepared: scoring.Prepared | None = None, settings: RunSettings = RunSettings(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance, normalised), each (n_layers, n_heads).

    importance = |d(mean NLL)/d mask| with the mask at `keep` (default all ones), and 0 for
    a head `keep` removes (sets to 0: it is gone, and the plain replay leaves it out); with
    several windows, each window's |gradient of its summed NLL| is added, then divided by
    the tokens scored; over documents (`corpus.Docs`, every process), every window of every
    document. normalised divides each layer's scores by their L2 norm (Michel et al.'s code).
    With the cached clean passes in `prepared`, the pass runs as `gradient_pass` says.
    Of `settings`, only the stride matters here.
    """
    importance, normalised, _ = gradient_pass(model, tokens, stride=settings.stride, keep=keep,
                                              prepared=prepared)
    return importance, normalised


def one_head_per_layer(
    model, tokens, importance: torch.Tensor, *, method: str = "zero",
    prepared: scoring.Prepared | None = None, settings: RunSettings = RunSettings(),
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    docs = as_docs(tokens)
    prepared, fill = prepare_fill(model, docs, method, settings, prepared)
    items = []
    for layer in range(cfg.n_layers):
        kept = int(importance[layer].argmax())
        keep = torch.zeros(cfg.n_heads)
        keep[kept] = 1
        items.append(({"layer": layer, "kept_head": kept}, layer, keep))
    df = _head_sweep(model, docs, items, settings, prepared=prepared, fill=fill)
    df[["layer", "kept_head"]] = df[["layer", "kept_head"]].astype("Int64")
    return df


def head_table(ablation: pd.DataFrame, importance, normalised) -> pd.DataFrame:
    """One row per head: ablation perplexity and change, importance, normalised, rank."""
    df = ablation.iloc[1:].reset_index(drop=True)
    df = df.rename(columns={"perplexity": "ablation_perplexity"})
    layer, head = df["layer"].astype(int), df["head"].astype(int)
    df["gradient_importance"] = importance[layer, head].numpy()
    df["normalized_importance"] = normalised[layer, head].numpy()
    ranks = (-normalised).flatten().argsort(stable=True).argsort() + 1  # 1 = most important
    df["rank"] = ranks.reshape(normalised.shape)[layer, head].numpy()
    return df[["layer", "head", "method", "ablation_perplexity", "delta", "ratio", "kl",
               "gradient_importance", "normalized_importance", "rank", "ci_low", "ci_high",
               "delta_ci_low", "delta_ci_high"]]
