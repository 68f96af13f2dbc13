"""How a sweep of variants runs: the naive loop, or the engine from where each one departs.

Experiments build `sweep.Variant`s (labels plus `interventions.Edit` records) and call
`run`; they never reach into the engine. `start` is the one place that turns an edit into
an engine entry point, using the facts of `arch.layout`; `run` falls back to the naive loop,
loudly, when the engine's self-check fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from blockscope import arch, clean, engine, replay
from blockscope.errors import BlockscopeError
from blockscope.interventions import hooks
from blockscope.sweep import Progress, Variant, clean_means, sweep, token_nll
from blockscope.text import Window

ENGINES = ("cached", "naive")


def check_engine(name: str) -> None:
    if name not in ENGINES:
        raise BlockscopeError(f"--engine must be one of {', '.join(ENGINES)}")


@dataclass
class Prepared:
    """What a sweep starts from: the clean passes (cached engine) or the clean NLL (naive),
    and the clean means over positions of the hook points asked for."""

    cleans: list | None  # clean.Clean per window, or None for the naive loop
    baseline: torch.Tensor | None  # (n_scored,) clean NLL for the naive loop
    means: dict[str, torch.Tensor]  # hook name -> mean activation over positions


def prepare(model, tokens: torch.Tensor, wins: Sequence[Window], *, engine_name: str,
            mean_names: Sequence[str] = (), heads: bool = False) -> Prepared:
    """One clean pass per window (cached engine) or the clean NLL (naive), and the means.

    With one window the cached clean pass gives the means; with several, one hooked pass
    over all windows does (a mean over every position of every window)."""
    check_engine(engine_name)
    mean_names = sorted(set(mean_names))
    if engine_name == "naive":
        if mean_names:
            nll, means = clean_means(model, tokens, wins, mean_names)
            return Prepared(None, nll, means)
        return Prepared(None, token_nll(model, tokens, wins), {})
    lay = arch.layout(model)
    names = sorted(set(clean.kept_names(lay, model.cfg.n_layers, heads)) | set(
        n for n in mean_names if not n.endswith(("hook_resid_pre", "hook_resid_post"))))
    cleans = [clean.clean_pass(model, tokens, w, names) for w in wins]
    means = {}
    if mean_names:
        means = (clean.cached_means(cleans[0], mean_names) if len(wins) == 1
                 else clean_means(model, tokens, wins, mean_names)[1])
    return Prepared(cleans, None, means)


def start(model, lay: arch.Layout, v: Variant) -> engine.Start:
    """Where the engine enters the stack for variant `v`, derived from its edits.

    One edit in a block no user's hook sits in enters as late as the layout allows (see
    engine.py); anything else enters at the first block it touches with the edits' own
    hooks on, which is the naive loop's run from that block on."""
    first = min(e.layer for e in v.edits)
    generic = engine.Start(v.label, first, lambda c: c.entering(first), hooks=hooks(v.edits))
    if len(v.edits) != 1 or replay.hooked(model.blocks[first]):
        return generic
    e = v.edits[0]
    k = e.layer

    def plus(f: Callable[[clean.Clean], torch.Tensor], fill=e.fill) -> Callable:
        return f if fill is None else (lambda c: f(c) + fill.to(c.pre[0]))

    if e.component == "block":  # output := input (+ mean contribution)
        return engine.Start(v.label, k + 1, plus(lambda c: c.pre[k]))
    if e.component in ("attn", "mlp") and lay.parallel:  # output minus that write
        write = f"hook_{e.component}_out"
        return engine.Start(v.label, k + 1, plus(lambda c: c.entering(k + 1) - c.act(write, k)),
                            relies_on="halves")
    if e.component == "mlp":  # sequential: output := mid (+ fill)
        return engine.Start(v.label, k + 1, plus(lambda c: c.act("hook_resid_mid", k)))
    if not lay.mlp_alone:  # no entry at the mid residual
        return generic
    if e.component == "attn":  # sequential: mid := input (+ fill), then the MLP half
        return engine.Start(v.label, k, plus(lambda c: c.pre[k]), mid=True)
    if not lay.linear_heads:
        return generic
    delta = _heads_delta(model, k, e.keep, e.fill)
    if lay.parallel:
        return engine.Start(v.label, k + 1, lambda c: c.entering(k + 1) + delta(c),
                            relies_on="heads")
    return engine.Start(v.label, k, lambda c: c.act("hook_resid_mid", k) + delta(c),
                        mid=True, relies_on="heads")


def _heads_delta(model, layer: int, keep: torch.Tensor, fill: torch.Tensor | None) -> Callable:
    """The change in layer `layer`'s attention write when heads are scaled by `keep`
    (n_heads,) and the removed part filled with `fill` (n_heads, d_head):
    sum_h (1 - keep_h) (fill_h - z_h) W_O[h], over the changed heads only."""
    idx = (keep != 1).nonzero().flatten()

    def delta(clean: clean.Clean) -> torch.Tensor:
        z = clean.act("attn.hook_z", layer)[0][:, idx]  # (T, k, d_head)
        W_O = model.blocks[layer].attn.W_O[idx]  # (k, d_head, d_model)
        gone = (1 - keep[idx]).to(z)  # (k,)
        diff = (fill[idx].to(z) if fill is not None else 0) - z  # (T, k, d_head)
        return torch.einsum("h,thd,hde->te", gone, diff, W_O.to(z))  # (T, d_model)

    return delta


def run(model, tokens: torch.Tensor, variants: Sequence[Variant], *, wins: Sequence[Window],
        prepared: Prepared, batch_size: int | None = None,
        progress: Progress | None = None) -> pd.DataFrame:
    """Baseline row, then one row per variant, by the engine `prepared` was made for.

    If the engine's self-check fails, every variant is scored by the naive loop instead and
    `attrs["engine"]["fallback"]` says why; the numbers are then the reference's."""
    if prepared.cleans is None:
        df = sweep(model, tokens, variants, wins=wins, baseline_nll=prepared.baseline,
                   progress=progress)
        df.attrs["engine"] = {"replay": "naive", "batch_size": 1}
        return df
    lay = arch.layout(model)
    starts = [start(model, lay, v) for v in variants]
    try:
        return engine.engine_sweep(model, tokens, starts, wins=wins, cleans=prepared.cleans,
                                   batch_size=batch_size, progress=progress)
    except engine.ReplayMismatch as exc:
        # the baseline too: the clean passes scored it through the replayed unembedding
        df = sweep(model, tokens, variants, wins=wins, progress=progress)
        df.attrs["engine"] = {"replay": "naive", "batch_size": 1,
                              "fallback": f"the cached engine's self-check failed: {exc}; "
                              "every variant was scored by the naive loop"}
        return df
