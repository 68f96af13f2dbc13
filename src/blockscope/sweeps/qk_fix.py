"""AtP*'s QK fix (Kramar et al. 2024): a variant that writes a block's queries or keys moves
that block's attention pattern through a softmax, which saturates. The pattern with the
edit is computed exactly, by the model's own attention in a forward stopped at the block
(`patched_pattern`), and only what follows the pattern is linearised:
estimate = (A_patched - A) . dM/dA (`terms`, per query head or key/value head)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from blockscope.interventions import applied, hooks
from blockscope.interventions.interchange import Edit, Site, heads_at
from blockscope.sweeps.interchange import Run
from blockscope.sweeps.variant import Variant


class _Stop(Exception):
    """Ends a forward once the pattern it was run for has been read."""


def patched_pattern(model, tokens: torch.Tensor, edit: Edit, sources: dict) -> torch.Tensor:
    """Block `edit`'s layer's attention pattern (n_heads, T, T) on the run of `tokens` (1, T)
    with `edit` written over the whole of its site (attn.hook_q or attn.hook_k: every head,
    every position), the forward stopped there, by the model's own attention (its scale,
    rotary, mask and softcap). A head's pattern depends on its own query and key alone: for
    an elementwise intervention, query head h's pattern is the one with only its query
    edited (or only its key/value head's key), so one forward serves every head."""
    seen = {}
    layer = edit.site.layer

    def read(act, hook=None):
        seen["pattern"] = act.detach()[0].clone()
        raise _Stop

    whole = Edit(Site(edit.site.point, layer), edit.intervention, edit.source)
    try:
        with torch.inference_mode(), applied(model, [*hooks([whole], None, sources), (
                f"blocks.{layer}.attn.hook_pattern", read)]):
            model(tokens.to(model.cfg.device), return_type="logits")
    except _Stop:
        pass
    return seen["pattern"]


QK = ("attn.hook_q", "attn.hook_k")


def deltas(model, base: Run, variants: Sequence[Variant], sources: dict,
               base_acts: dict) -> dict[tuple[str, str], torch.Tensor]:
    """The QK fix's exact change of each block's pattern (n_heads, T, T) when a source run's
    queries, or keys, are written at every position: (source, hook name) -> delta. The
    base run's patterns are in `base_acts` (what the probes saw)."""
    out = {}
    for v in variants:
        for e in v.edits:
            key = (e.intervention, e.source, e.site.name)
            if e.site.point not in QK or key in out:
                continue
            if e.site.positions is not None and set(e.site.positions) != set(
                    range(base.tokens.shape[-1])):
                raise ValueError(f"variant {v.label}: the QK fix takes queries and keys "
                                 "written at every position")
            if not (isinstance(e.source, str) and getattr(e.intervention, "elementwise",
                                                           False)):
                raise ValueError(f"variant {v.label}: the QK fix takes an elementwise "
                                 "intervention reading a source run")
            pattern = base_acts[f"blocks.{e.site.layer}.attn.hook_pattern"]
            out[key] = patched_pattern(model, base.tokens, e, sources) - pattern[0]
    return out


def terms(model, point: str, delta: torch.Tensor, grad: torch.Tensor) -> np.ndarray:
    """Per head of `point` (a query head, or a key head: the query heads that share it),
    the QK fix's term: delta . dM/dA over the query heads it reaches, (heads,)."""
    per_query = (delta.double() * grad[0].double()).flatten(1).sum(-1)  # (n_heads,)
    if point == "attn.hook_q":
        return per_query.cpu().numpy()
    n_kv = heads_at(model.cfg, "attn.hook_k")  # a key head serves n_heads / n_kv in order
    return per_query.view(n_kv, -1).sum(-1).cpu().numpy()
