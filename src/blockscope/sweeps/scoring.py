"""How a sweep of variants runs: the naive loop, or the engine from where each one departs.

Experiments build `variant.Variant`s (labels plus interventions) and call `run`; they never
reach into the engine. `entries.start` turns each intervention into an engine entry
point; `run` falls back to the naive loop, loudly, when the engine's self-check fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from blockscope.allocator import release
from blockscope.errors import BadValue
from blockscope.inputs.corpus import as_docs
from blockscope.inputs.parallel import total
from blockscope.interventions import resample
from blockscope.model import arch
from blockscope.sweeps import clean, engine, selfcheck
from blockscope.sweeps.entries import shared_skips, start
from blockscope.sweeps.how import Engine, How
from blockscope.sweeps.metrics import NllKl
from blockscope.sweeps.naive import (
    activations,
    clean_sums,
    model_windows,
    naive_nlls,
    partners,
)
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.units import Scores, doc_units, gather_units
from blockscope.sweeps.variant import Variant


@dataclass
class Prepared:
    """What every sweep of one set of documents starts from: the corpus-wide clean means of
    the hook points asked for, and, where this process holds one document, its clean passes
    (cached engine) or its baseline passes (naive), reused by every `run`. With several
    documents each `run` recomputes a document's clean pass when it scores it: memory stays
    flat."""

    engine: str  # "cached" or "naive"
    names: list[str]  # hook points a clean pass keeps (cached engine)
    means: dict[str, torch.Tensor]  # hook name -> mean activation over every position
    cleans: list | None = None  # clean.Clean per window of the one document held (cached)
    reference: list | None = None  # naive: its baseline's own passes (full logits, as
    #   `naive.token_nll`), each block's input kept, so metrics need no forward of their own
    resample: list[str] = field(default_factory=list)  # hook points a `Resampled` fill
    #   reads from each document's partner
    partner: list[int] = field(default_factory=list)  # each document's partner (corpus order)
    seed: int = 0  # the partners' seed


def prepare(model, tokens, settings: RunSettings = RunSettings(), *,
            mean_names: Sequence[str] = (), heads: bool = False,
            resample: Sequence[str] = ()) -> Prepared:
    """Means over every position of every window of every document (of every process), and
    the one document's clean passes or NLL when this process holds just one.

    `tokens`: a passage `(1, pos)` or `corpus.Docs`. With one window the cached clean pass
    gives the means; otherwise one hooked pass per window does. `resample`: the hook points
    whose activations on another document (`naive.partners`, seeded) `Resampled` fills read:
    two or more documents, each within the context, in one process (partners drawn with
    `settings.seed`)."""
    engine_name, stride, seed = settings.engine, settings.stride, settings.seed
    docs = as_docs(tokens)
    if resample:
        _check_resample(model, docs)
    mean_names = sorted(set(mean_names))
    names = []
    if engine_name == "cached":
        lay = arch.layout(model)
        names = sorted(set(clean.kept_names(lay, model.cfg.n_layers, heads)) | set(
            n for n in mean_names if not n.endswith(("hook_resid_pre", "hook_resid_post"))))
    prepared = Prepared(engine_name, names, {}, resample=sorted(set(resample)),
                        partner=partners(len(docs.ids), seed) if resample else [], seed=seed)
    one = len(docs.ids) == 1
    if one:
        ids = docs.ids[0]
        wins = model_windows(model, ids, stride)
        if engine_name == "naive":
            prepared.reference = _reference(model, ids, wins)
        else:
            prepared.cleans = [clean.clean_pass(model, ids, w, names) for w in wins]
    if not mean_names:
        return prepared
    if one and docs.comm.size == 1 and prepared.cleans and len(prepared.cleans) == 1:
        prepared.means = clean.cached_means(prepared.cleans[0], mean_names)
        return prepared
    parts = []  # (document, its sums and count): added in corpus order, as one process
    for index, ids in zip(docs.index, docs.ids, strict=True):
        _, s, n = clean_sums(model, ids, model_windows(model, ids, stride), mean_names)
        parts.append((index, {**s, COUNT: torch.tensor(float(n))}))
    sums = total(docs.comm, parts)
    count = sums.pop(COUNT)
    prepared.means = {k: (v / count).float() for k, v in sums.items()}
    return prepared


COUNT = "\0count"  # the number of positions summed, beside the hook names' sums


def _check_resample(model, docs) -> None:
    if docs.comm.size > 1:
        raise BadValue("`method` resample runs in one process (a document's partner "
                              "may be another rank's)")
    if len(docs.ids) < 2:
        raise BadValue("`method` resample needs a corpus of 2 or more documents "
                              "(`dataset`): each takes another's activations")
    longest = max(ids.shape[-1] for ids in docs.ids)
    if longest > model.cfg.n_ctx:
        raise BadValue(f"`method` resample takes documents within the context "
                              f"({model.cfg.n_ctx} tokens); one has {longest}")


def resampled(model, docs, k: int, variants: Sequence[Variant], prepared: Prepared
              ) -> list[Variant]:
    """Document k's variants with every `Resampled` fill drawn from its partner's clean
    forward, position by position (the partner's position t for t, cycling where it is
    shorter)."""
    if not prepared.resample:
        return list(variants)
    other = docs.ids[prepared.partner[k]]
    acts = activations(model, other, prepared.resample)  # name -> (T_partner, ...)
    n = docs.ids[k].shape[-1]
    acts = {name: a[torch.arange(n) % a.shape[0]] for name, a in acts.items()}  # (n, ...)
    return [Variant(v.label, tuple(resample(e, acts) for e in v.edits), v.order)
            for v in variants]


def pairing(docs, prepared: Prepared) -> dict:
    """How `--method resample` drew its fills, for the sidecar."""
    return {"seed": prepared.seed, "partner_of": {int(docs.index[k]): int(docs.index[p])
                                         for k, p in enumerate(prepared.partner)},
            "rule": "each document's component output at position t := its output at "
            "position t (mod the partner's length) in the partner's clean forward; partners "
            "form one seeded random cycle through the documents"}


def run(model, tokens, variants: Sequence[Variant], settings: RunSettings = RunSettings(),
        **kw) -> pd.DataFrame:
    """Baseline row, then one row per variant, over every document of every process: the
    `scores` as a table, with bootstrap intervals when `settings.ci` is given."""
    return scores(model, tokens, variants, settings, **kw).frame(settings.ci)


def scores(model, tokens, variants: Sequence[Variant], settings: RunSettings = RunSettings(),
           *, prepared: Prepared, on_clean: Callable[[int, clean.Clean], None] | None = None
           ) -> Scores:
    """The baseline's and each variant's NLL sums per unit, over every document of every
    process.

    Each document is scored alone (its own windows) by the engine `prepared` was made for;
    per unit (a document, or a 128-token chunk of one passage) only the NLL sums and token
    counts are kept, gathered across processes. If the engine's self-check fails on a
    document, that document is scored by the naive loop and `how["fallback"]` says why; the
    numbers are then the reference's. `on_clean(index, clean)` sees every clean pass, with
    its document's place in the corpus. The engine is the
    one `prepared` was made for; `settings` gives the stride, batch size and progress."""
    stride, progress = settings.stride, settings.progress
    docs = as_docs(tokens)
    labels = [{"variant": "baseline"}] + [{"variant": "ablated", **v.label} for v in variants]
    def starts_of(variants):
        if prepared.engine != "cached":
            return None
        lay = arch.layout(model)
        base = shared_skips(variants)
        return [start(model, lay, v, base if any(e in base for e in v.edits)
                      else ()) for v in variants]

    starts = None if prepared.resample else starts_of(variants)
    one = len(docs.ids) == 1
    if progress and not one:
        progress(total=len(docs.ids))
    units, hows = [], []
    # each document one unit of an interrupted run's kept work (`settings.kept`)
    scope = settings.kept.scope("documents", len(docs.ids)) if settings.kept else None
    for k, ids in enumerate(docs.ids):
        wins = model_windows(model, ids, stride)
        seen = on_clean and functools.partial(on_clean, docs.index[k])

        def score(k=k, ids=ids, wins=wins, seen=seen):
            here = resampled(model, docs, k, variants, prepared)  # each document's own fills
            nlls, how = _score(model, ids, wins, here,
                               starts_of(here) if prepared.resample else starts, prepared,
                               settings if one else settings.quiet(), prepared_here=one,
                               on_clean=seen, check=k == 0)
            return doc_units(docs.index[k], torch.stack(nlls), docs.unit), how

        def again(ids=ids, wins=wins, seen=seen):
            # a kept document: its scores are read back, its clean passes made again for
            # `on_clean`, as the engine would have made them
            for c in _cleans(model, ids, wins, prepared, starts is None, one) if seen else ():
                seen(c)

        doc, how = score() if scope is None else scope.unit(docs.index[k], score, again)
        units += doc
        hows.append(how)
        if not one:
            clean.drop_patterns(model)  # a naive forward's, sized by this document
            release()  # documents differ in length: keep the heap from fragmenting
        if progress and not one:
            progress()
    return gather_units(docs, units, hows, labels)


def _cleans(model, ids, wins, prepared: Prepared, naive: bool, prepared_here: bool
            ) -> list[clean.Clean]:
    """One document's clean passes as `_score` makes them: the naive loop's reference
    passes, or the cached engine's (the held ones where `prepared_here`)."""
    if naive:
        return prepared.reference if prepared_here else _reference(model, ids, wins)
    return prepared.cleans if prepared_here else [
        clean.clean_pass(model, ids, w, prepared.names) for w in wins]


def _score(model, ids, wins, variants, starts, prepared: Prepared, settings: RunSettings, *,
           prepared_here: bool, on_clean, check: bool = True
           ) -> tuple[list[torch.Tensor], dict]:
    """One document's per-token NLL, baseline first, and how it ran (`prepared_here`: the
    clean or baseline passes in `prepared` are this document's, so they are used, not made
    again; `check`: hold the engine's variants to the hooked model on this document,
    `check_variants`)."""
    progress = settings.progress
    if starts is None:
        refs = _cleans(model, ids, wins, prepared, True, prepared_here) if (
            prepared_here or on_clean) else None
        for c in refs if on_clean else ():
            on_clean(c)
        return (naive_nlls(model, ids, variants, wins=wins, reference=refs, metric=NllKl(),
                           progress=progress), How("naive", "naive", 1).record())
    cleans = _cleans(model, ids, wins, prepared, False, prepared_here)
    for c in cleans if on_clean else ():
        on_clean(c)
    def cached():
        nlls, how = engine.engine_nlls(model, ids, starts, wins=wins, cleans=cleans,
                                       batch_size=settings.batch_size, progress=progress)
        if check:
            selfcheck.check_variants(model, ids, wins[0], cleans[0], nlls, variants, starts)
        return nlls, how

    # on a fallback the baseline too: the clean passes scored it through the replayed
    # unembedding
    return Engine("cached", How("naive", "naive", 1)).run(
        cached, lambda how: naive_nlls(model, ids, variants, wins=wins, metric=NllKl(),
                                       progress=progress))


def _reference(model, ids, wins) -> list[clean.Clean]:
    """The naive loop's clean passes: its baseline forward (`naive.token_nll`'s full logits,
    kept for the KL), each block's input and the points between its halves
    (`clean.kept_names`) kept as it goes by."""
    names = clean.kept_names(arch.layout(model), model.cfg.n_layers, z=False)
    return [clean.clean_pass(model, ids, w, names, reference=True) for w in wins]
