"""The shape of every tensor through one block, read from a real forward pass with hooks.

The batch dimension (always 1 here) is left out, so GPT-2 small on a 5-token prompt shows the
stream as 5 x 768. `dims` names each axis with TransformerLens's config names; `expected` is
what those names give for this model's config, so a mismatch would show.
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue

# (tensor, hook under blocks.{b}., dims, note)
POINTS = [
    ("residual in", "hook_resid_pre", "pos d_model", "the stream entering the block"),
    ("ln1 out", "ln1.hook_out", "pos d_model", "{norm1}"),
    ("q", "attn.hook_q", "pos n_heads d_head", "a query per token per head"),
    ("k", "attn.hook_k", "pos n_heads d_head", "a key per token per head"),
    ("v", "attn.hook_v", "pos n_heads d_head", "a value per token per head"),
    ("attention scores", "attn.hook_attn_scores", "n_heads pos pos",
     "q.k / sqrt(d_head) per head, query x key, causal mask applied"),
    ("attention pattern", "attn.hook_pattern", "n_heads pos pos",
     "softmax of the scores: each query's row sums to 1"),
    ("z", "attn.hook_z", "pos n_heads d_head", "each head's pattern-weighted sum of values"),
    ("attention out", "hook_attn_out", "pos d_model",
     "the heads concatenated and projected by W_O"),
    ("residual mid", "hook_resid_mid", "pos d_model", "residual in + attention out"),
    ("ln2 out", "ln2.hook_out", "pos d_model", "{norm2}, on the mid stream"),
    ("MLP hidden, before activation", "mlp.hook_pre", "pos d_mlp", "{pre}"),
    ("MLP hidden, after activation", "mlp.hook_post", "pos d_mlp", "{post}"),
    ("MLP out", "hook_mlp_out", "pos d_model", "projected back to d_model by W_out"),
    ("residual out", "hook_resid_post", "pos d_model", "residual mid + MLP out"),
]


def points(model) -> list[tuple[str, str, str, str]]:
    """POINTS as this model's layout has them: a point it lacks is left out (a parallel block
    has no mid residual, OLMo 2 no pre-sublayer norms), an MoE's expert hidden states are
    not one tensor (left out), and grouped-query K/V have their own head count."""
    from blockscope.model.arch import block_parts, layout

    lay = layout(model)
    moe = type(model.blocks[0].mlp).__name__ == "MoEBridge"
    notes = _part_notes(block_parts(model))
    out = []
    for tensor, hook, dims, note in POINTS:
        note = note.format(**notes)
        if f"blocks.0.{hook}" not in model.hook_dict or (moe and hook.startswith("mlp.hook_")):
            continue
        if hook in ("attn.hook_k", "attn.hook_v") and lay.n_key_value_heads != model.cfg.n_heads:
            dims = "pos n_key_value_heads d_head"
            note += f" (shared by {model.cfg.n_heads // lay.n_key_value_heads} query heads)"
        out.append((tensor, hook, dims, note))
    return out


def _part_notes(parts: dict) -> dict:
    """The notes that depend on the norm and MLP the model has (`arch.block_parts`)."""
    width = f"{parts['width']:.3g} x d_model"
    name, what = (("layer norm", "centred, divided by the standard deviation, scaled and "
                   "shifted") if parts["norm"] == "LN" else
                  ("RMS norm", "divided by the root mean square and scaled (no centring, no "
                   "shift)"))
    if parts["gated"]:
        pre = f"the gate's projection, {width} wide (the up projection has the same shape)"
        post = f"act(gate) x up, act = {parts['act']}"
    else:
        pre = f"after W_in, {width} wide"
        post = f"after the activation ({parts['act']})"
    return {"norm1": f"{name} 1: {what}", "norm2": f"{name} 2: {what}", "pre": pre,
            "post": post}


def block_shapes(model, tokens: torch.Tensor, *, block: int = 0) -> pd.DataFrame:
    """One row per tensor: its hook, shape, axis names, the shape the config predicts, a note."""
    from blockscope.model.arch import layout

    cfg = model.cfg
    if not 0 <= block < cfg.n_layers:
        raise BadValue(f"`block` must be between 0 and {cfg.n_layers - 1}")
    lay = layout(model)
    sizes = {"pos": tokens.shape[-1], "d_model": cfg.d_model, "n_heads": cfg.n_heads,
             "d_head": cfg.d_head, "d_mlp": lay.d_mlp, "n_key_value_heads": lay.n_key_value_heads}
    kept = points(model)
    names = {f"blocks.{block}.{hook}" for _, hook, _, _ in kept}
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens.to(cfg.device), names_filter=names.__contains__)
    rows = []
    for tensor, hook, dims, note in kept:
        name = f"blocks.{block}.{hook}"
        expected = tuple(sizes[d] for d in dims.split())
        act = cache[name]
        # drop batch (1); a model that flattens batch and pos inside the block (OPT's MLP)
        # hands a tensor with one axis fewer, whose first axis is then batch x pos
        shape = tuple(act.shape[1:]) if act.dim() == len(expected) + 1 else tuple(act.shape)
        rows.append({"tensor": tensor, "hook": name, "shape": " x ".join(map(str, shape)),
                     "dims": " x ".join(dims.split()),
                     "expected": " x ".join(map(str, expected)),
                     "matches": shape == expected, "note": note})
    return pd.DataFrame(rows)
