"""Where the engine enters the stack for a variant, and the residual it enters with.

`start` is the one place that turns an intervention into an engine entry point, using the
facts of `arch.layout` and the intervention's own `apply`, applied to the cached clean
activation and its change carried into the stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from blockscope.interventions import ScaleHeads, component
from blockscope.model import arch
from blockscope.sweeps import clean, engine, replay, steps
from blockscope.sweeps.variant import Variant


def start(model, lay: arch.Layout, v: Variant, base: tuple = ()) -> engine.Start:
    """Where the engine enters the stack for variant `v`, and the residual it enters with:
    the variant's one intervention `apply`d to the cached clean activation, its change
    carried into the stream (as is for a write, through W_O for heads' z).

    A block order, or one removal edit in a block no user's hook sits in, enters as late as
    the layout allows (see engine.py), chosen by the edit's site and its intervention's
    class (`interventions.component`); anything else enters at the first block it touches
    with the variant's own hooks on, which is the naive loop's run from that block on."""
    first = min([e.site.layer for e in v.edits] + ([v.order.first] if v.order else []))
    generic = engine.Start(v.label, first, lambda c: c.entering(first), hooks=v.hooks())
    if v.order is not None:
        return (generic if v.edits or replay.hooked(model.blocks[first])
                else _arrangement(model, lay, v.label, v.order))
    if len(v.edits) > 1 and _skips_only(v) and not any(replay.hooked(b) for b in model.blocks):
        return _blocks_start(len(model.blocks), v, base)
    if len(v.edits) != 1 or replay.hooked(model.blocks[first]):
        return generic
    entry = _ENTRIES.get(component(v.edits[0]))
    return (entry(model, lay, v.label, v.edits[0]) if entry else None) or generic


def _arrangement(model, lay, label, order) -> engine.Start:
    """The window's output, its blocks run as the replay runs them."""
    k = order.first
    return engine.Start(label, order.last + 1, lambda c, plain: order.apply(
        c.entering(k), lambda j, x: steps.block_step(model, c, j, x, plain)),
        kind="rearranged", with_plain=True)


def _block(model, lay, label, e) -> engine.Start:
    """The block's output (its resid_post), from what it received (its resid_pre)."""
    k = e.site.layer
    return engine.Start(label, k + 1, lambda c: e.intervention.apply(c.entering(k + 1),
                                                                      c.pre[k]), kind="block")


def _write(model, lay, label, e) -> engine.Start | None:
    """A half's write to the stream (hook_attn_out / hook_mlp_out) replaced."""
    k, write = e.site.layer, e.site.point
    if lay.parallel:  # output + (write' - write)
        return engine.Start(label, k + 1, lambda c: c.entering(k + 1) + _change(
            e.intervention, c.act(write, k)), relies_on="halves", kind="half")
    if write == "hook_mlp_out":  # sequential: mid + write', the MLP's write being what it added
        def after_mlp(c):  # to the mid residual
            mid = c.act("hook_resid_mid", k)
            return mid + e.intervention.apply(c.entering(k + 1) - mid)

        return engine.Start(label, k + 1, after_mlp, kind="mlp")
    if not lay.mlp_alone:  # no entry at the mid residual
        return None
    def mid(c):  # the mid residual := input + write'
        return c.pre[k] + e.intervention.apply(c.act("hook_resid_mid", k) - c.pre[k])

    return engine.Start(label, k, mid, mid=True, kind="attn")


def _heads(model, lay, label, e) -> engine.Start | None:
    """Heads' z scaled, its change carried through W_O where the layout is linear in it."""
    if not (lay.mlp_alone and lay.linear_heads):
        return None
    k = e.site.layer
    delta = _heads_change(model, k, e.intervention)
    if lay.parallel:
        return engine.Start(label, k + 1, lambda c: c.entering(k + 1) + delta(c),
                            relies_on="heads", kind="heads")
    return engine.Start(label, k, lambda c: c.act("hook_resid_mid", k) + delta(c),
                        mid=True, relies_on="heads", kind="heads")


# The entry for one removal edit, by its component; any other edit enters with its hooks.
_ENTRIES = {"block": _block, "attn": _write, "mlp": _write, "heads": _heads}


def _skips_only(v: Variant) -> bool:
    return v.order is None and all(component(e) == "block" for e in v.edits)


def shared_skips(variants: Sequence[Variant]) -> tuple:
    """The skipped blocks (equal edits) that every variant removing several blocks holds:
    the engine runs the model without them once per window, and each variant from there."""
    sets = [v.edits for v in variants if len(v.edits) > 1 and _skips_only(v)]
    if len(sets) < 2:
        return ()
    return tuple(e for e in sets[0] if all(e in s for s in sets[1:]))


def _blocks_start(n_layers: int, v: Variant, base: tuple) -> engine.Start:
    """Several blocks skipped: enter after the first one `base` does not hold, from the
    input the model without `base`'s blocks gives it (`engine.pruned`), skipping the
    variant's later blocks on the way (`base` is a subset of the variant's edits)."""
    rest = [e for e in v.edits if e not in base]
    skip = {e.site.layer: e.intervention for e in v.edits}
    if not rest:  # the pruned model itself: straight to the unembedding
        return engine.Start(v.label, n_layers, lambda c: c.pre[n_layers], base=base,
                            kind="blocks")
    k = min(e.site.layer for e in rest)
    return engine.Start(v.label, k + 1, lambda c: skip[k].apply(c.pre[k + 1], c.pre[k]),
                        skips={j: s for j, s in skip.items() if j > k}, base=base,
                        kind="blocks" + "-shared" * bool(base))


def _change(intervention, activation: torch.Tensor) -> torch.Tensor:
    """What `intervention` adds to the stream where `activation` is written: apply(a) - a."""
    return intervention.apply(activation) - activation


def _heads_change(model, layer: int, e: ScaleHeads) -> Callable:
    """The change in layer `layer`'s attention write: (apply(z) - z) W_O, over the heads
    `e` changes only (the others' change is exactly 0)."""
    idx = (e.keep != 1).nonzero().flatten()
    changed = ScaleHeads(e.keep[idx], None if e.fill is None else e.fill[..., idx, :])

    def delta(clean: clean.Clean) -> torch.Tensor:
        z = clean.act("attn.hook_z", layer)[0][:, idx]  # (T, k, d_head)
        W_O = model.blocks[layer].attn.W_O[idx]  # (k, d_head, d_model)
        return torch.einsum("thd,hde->te", _change(changed, z), W_O.to(z))  # (T, d_model)

    return delta
