"""The shape of every tensor through one block, read from a real forward pass with hooks.

The batch dimension (always 1 here) is left out, so GPT-2 small on a 5-token prompt shows the
stream as 5 x 768. `dims` names each axis with TransformerLens's config names; `expected` is
what those names give for this model's config, so a mismatch would show.
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BlockscopeError

# (tensor, hook under blocks.{b}., dims, note)
POINTS = [
    ("residual in", "hook_resid_pre", "pos d_model", "the stream entering the block"),
    ("ln1 out", "ln1.hook_out", "pos d_model", "layer norm 1: normalized, scaled, shifted"),
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
    ("ln2 out", "ln2.hook_out", "pos d_model", "layer norm 2 on the mid stream"),
    ("MLP hidden, before activation", "mlp.hook_pre", "pos d_mlp", "after W_in (4 x wider)"),
    ("MLP hidden, after activation", "mlp.hook_post", "pos d_mlp", "after the GELU"),
    ("MLP out", "hook_mlp_out", "pos d_model", "projected back to d_model by W_out"),
    ("residual out", "hook_resid_post", "pos d_model", "residual mid + MLP out"),
]


def block_shapes(model, tokens: torch.Tensor, *, block: int = 0) -> pd.DataFrame:
    """One row per tensor: its hook, shape, axis names, the shape the config predicts, a note."""
    cfg = model.cfg
    if not 0 <= block < cfg.n_layers:
        raise BlockscopeError(f"--block must be between 0 and {cfg.n_layers - 1}")
    sizes = {"pos": tokens.shape[-1], "d_model": cfg.d_model, "n_heads": cfg.n_heads,
             "d_head": cfg.d_head, "d_mlp": cfg.d_mlp}
    names = {f"blocks.{block}.{hook}" for _, hook, _, _ in POINTS}
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens.to(cfg.device), names_filter=names.__contains__)
    rows = []
    for tensor, hook, dims, note in POINTS:
        name = f"blocks.{block}.{hook}"
        shape = tuple(cache[name].shape[1:])  # drop batch
        expected = tuple(sizes[d] for d in dims.split())
        rows.append({"tensor": tensor, "hook": name, "shape": " x ".join(map(str, shape)),
                     "dims": " x ".join(dims.split()),
                     "expected": " x ".join(map(str, expected)),
                     "matches": shape == expected, "note": note})
    return pd.DataFrame(rows)
