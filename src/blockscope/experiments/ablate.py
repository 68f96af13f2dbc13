"""Block ablation: perplexity with each block (or one half of it) removed in turn.

Skipping block i sets its output to its input, as the article does; `part="attn"`/`"mlp"`
removes only that half's write to the residual stream. `method="mean"` writes the removed
part's mean over positions from the clean run instead of nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from blockscope.choices import Method, Part, one_of
from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.similarity import BlockSimilarity, spearman
from blockscope.inputs.corpus import as_docs
from blockscope.interventions import intervention, mean_points, resampled, with_mean
from blockscope.sweeps import scoring
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant


def check_method(part: str, method: str) -> None:
    """`method` resample replaces a half's write with another document's: not a block's."""
    if method == "resample" and part == "block":
        raise BadValue("`method` resample replaces a half's write: give `part` attn or mlp")


def block_ablation(
    model,
    tokens,
    *,
    part: str = "block",
    method: str = "zero",
    layers: Sequence[int] | None = None,
    settings: RunSettings = RunSettings(),
) -> pd.DataFrame:
    """Baseline row, then one row per removed layer: perplexity, change and ratio (and with
    `settings.ci`, bootstrap intervals: `stats.frame`).

    Args:
        tokens: `(1, pos)` token ids of a passage, BOS already decided by the caller, or
            `corpus.Docs` (each document scored alone; perplexity over all their tokens).
        part: "block" (the whole block skipped), "attn" or "mlp".
        method: "zero" (remove), "mean" (replace by the clean mean over positions) or
            "resample" (a half only, on a corpus: by what it wrote on another document,
            position by position; the documents paired by `settings.seed`).
        layers: which blocks to remove (default all).
        settings: how it runs (`RunSettings`: stride, engine, batch size, intervals, seed,
            progress). Same numbers with either engine.
    """
    one_of(Part, part, "part")
    one_of(Method, method, "method")
    check_method(part, method)
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    if any(not 0 <= i < n_layers for i in layers):
        raise BlockscopeError(f"layers must be between 0 and {n_layers - 1}")
    docs = as_docs(tokens)
    variants, prepared = removals(model, docs, part=part, method=method, layers=layers,
                                  settings=settings)
    similarity = BlockSimilarity(n_layers, part)  # from the clean passes either engine runs
    df = scoring.run(model, docs, variants, settings, prepared=prepared,
                     on_clean=similarity.add)
    similarity = similarity.joined(docs.comm)
    df["layer"] = df["layer"].astype("Int64")
    df.loc[0, ["part", "method"]] = "none"
    attrs = df.attrs
    df = df.merge(similarity.frame(), on="layer", how="left")[COLUMNS + CI_COLUMNS]
    df.attrs = attrs  # how the engine ran (merge drops it)
    if method == "resample":
        df.attrs["resample"] = scoring.pairing(docs, prepared)
    return df


def removals(model, docs, *, part: str, method: str, layers: list[int],
             settings: RunSettings) -> tuple[list[Variant], scoring.Prepared]:
    """One variant per removed layer (its fill made as `method` says), and the prepared
    clean passes and means they were made from."""
    edits = [intervention(part, i) for i in layers]
    names = [n for e in edits for n in mean_points(e)] if method == "mean" else []
    drawn = [e.site.name for e in edits] if method == "resample" else []
    prepared = scoring.prepare(model, docs, settings, mean_names=names, resample=drawn)
    if method == "mean":
        edits = [with_mean(e, prepared.means) for e in edits]
    if method == "resample":
        edits = [resampled(e) for e in edits]
    return [Variant({"layer": e.site.layer, "part": part, "method": method}, (e,))
            for e in edits], prepared


def decomposed(model, tokens, *, part: str = "block", method: str = "zero",
               layers: Sequence[int] | None = None, settings: RunSettings = RunSettings()
               ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each removal's change in the correct token's centred logit split into its own
    write, later blocks' reactions and the final norm (`decompose`): per component, and
    per scored token, by `settings.engine`."""
    from blockscope.experiments.decompose import decompose

    check_method(part, method)
    docs = as_docs(tokens)
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    variants, prepared = removals(model, docs, part=part, method=method, layers=layers,
                                  settings=settings)
    per_doc = [scoring.resampled(model, docs, k, variants, prepared) for k in range(len(docs.ids))]
    df, tokens_df = decompose(model, docs, per_doc, part=part, settings=settings,
                              cleans=prepared.cleans)
    df.insert(3, "method", method)
    if method == "resample":
        df.attrs["resample"] = scoring.pairing(docs, prepared)
    return df, tokens_df


COLUMNS = ["variant", "layer", "part", "method", "n_scored", "nll", "perplexity", "delta",
           "ratio", "kl", "block_influence", "angular_distance"]
CI_COLUMNS = ["ci_low", "ci_high", "delta_ci_low", "delta_ci_high"]


def metric_correlations(df: pd.DataFrame) -> dict[str, float]:
    """Spearman correlation of each cheap metric with the perplexity increase, over blocks."""
    rows = df.iloc[1:]
    return {m: spearman(rows[m], rows["delta"]) for m in ("block_influence", "angular_distance")}


def metrics_meaning(part: str) -> str:
    """What the block-influence and angular-distance columns measure, for the sidecar."""
    return ("cosine of each block's input and output" if part == "block" else
            f"cosine of what the {part} half reads and the stream after its write (input + "
            "the half's write)") + (
        " per token (all but the first token of each document): block_influence = 1 - mean "
        "cos (ShortGPT), angular_distance = mean arccos(cos)/pi (Gromov et al.)")
