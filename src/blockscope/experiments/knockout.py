"""Attention knockout (Geva et al. 2023, "Dissecting recall of factual associations").

In a window of `window` consecutive blocks, the last position may not attend to a set of
positions: `-inf` in its attention scores there, in every head (the softmax renormalises
over the rest). The sets: the subject's tokens (`subject`), every other position before the
last (`non_subject`, the BOS included), and the last position itself (`last`). One row per
set and window start; the metric is P(target) at the last position, and its change relative
to the clean run. A BOS the prompt starts with is left out of `non_subject`: most models
park attention there (an attention sink), and knocking it out breaks every prediction, which
says nothing about where the fact moves.
"""

from __future__ import annotations

import warnings

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.interventions import applied
from blockscope.interventions import hooks as edit_hooks
from blockscope.interventions.interchange import Edit, Knockout, Site
from blockscope.sweeps.interchange import Run, sweep
from blockscope.sweeps.metrics import TargetProb
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

EDGES = ("subject", "non_subject", "last")


def keys(edge: str, span: tuple[int, int], n_tokens: int, bos: bool = False
         ) -> tuple[int, ...]:
    """The positions the last one may not attend to (`bos`: position 0 is a BOS)."""
    lo, hi = span
    last = n_tokens - 1
    if edge == "subject":
        return tuple(range(lo, hi))
    if edge == "last":
        return (last,)
    return tuple(i for i in range(int(bos), last) if not lo <= i < hi)


def variants(n_layers: int, n_tokens: int, span, window: int, bos: bool = False
             ) -> list[Variant]:
    w = min(window, n_layers)
    out = []
    for edge in EDGES:
        ks = keys(edge, span, n_tokens, bos)
        if not ks:
            continue
        for start in range(n_layers - w + 1):
            edits = tuple(Edit(Site("attn.hook_attn_scores", j, (n_tokens - 1,), keys=ks),
                               Knockout()) for j in range(start, start + w))
            out.append(Variant({"from": edge, "layer_start": start,
                                "layer_end": start + w - 1}, edits))
    return out


def knockout(model, tokens: torch.Tensor, span: tuple[int, int], *, target: int,
             window: int = 9, bos: bool = False, settings: RunSettings = RunSettings()
             ) -> pd.DataFrame:
    """One row per (edge set, window): `from, layer_start, layer_end, p_target,
    relative_change`. attrs: p_clean, how it ran."""
    if window < 1:
        raise BadValue("`window` must be at least 1")
    vs = variants(model.cfg.n_layers, tokens.shape[-1], span, window, bos)
    check_reaches_softmax(model, tokens, vs[0])
    res = sweep(model, Run(tokens), {}, vs, TargetProb(target), settings)
    clean = float(res.base[0])
    df = pd.DataFrame([{**v.label, "p_target": float(p[0]),
                        "relative_change": (float(p[0]) - clean) / clean}
                       for v, p in zip(vs, res.values, strict=True)])
    df.attrs.update(p_clean=clean, window=min(window, model.cfg.n_layers), how=res.how)
    return df


def check_reaches_softmax(model, tokens: torch.Tensor, v: Variant) -> None:
    """Refuse a model whose attention-score hook point does not feed its softmax (GPT-Neo,
    GPT-J and OPT through TransformerLens 4.3: writing `hook_attn_scores` changes nothing):
    one forward with `v`'s knockout, its attention pattern read where it knocks out."""
    e = v.edits[0]
    seen = {}

    def keep(pattern, hook=None):  # (batch, n_heads, query, key)
        seen["p"] = pattern.detach()

    hooks = edit_hooks(v.edits, 1) + [(f"blocks.{e.site.layer}.attn.hook_pattern", keep)]
    with torch.inference_mode(), applied(model, hooks), warnings.catch_warnings():
        # TransformerLens warns that the edit is discarded; the refusal below says so in
        # one line, so its multi-line warning would only repeat it on the user's stderr
        warnings.filterwarnings("ignore", message=r"A hook on \S*hook_attn_scores returned")
        model(tokens.to(model.cfg.device), return_type="logits")
    left = float(seen["p"][0][e.site.index()].abs().max()) if "p" in seen else float("nan")
    if not left == 0.0:
        from blockscope.model.arch import layout

        raise BlockscopeError(
            f"knockout cannot run on {layout(model).family}: writing its attention scores "
            f"does not reach the softmax (attention {left:.2g} remains on the knocked-out "
            "keys), so the numbers would be the clean run's")
