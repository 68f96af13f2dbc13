"""How long the residual stream grows: its L2 norm after the embeddings and every half-block.

Rows follow the stream: the embeddings (token + position, `blocks.0.hook_resid_pre`), then for
each block the stream after its attention half (`hook_resid_mid`) and after the whole block
(`hook_resid_post`). `after` counts blocks from 1, as the article does; `layer` is 0-based.
A parallel block (GPT-J, GPT-NeoX, Phi, Falcon) has no point between its halves: its rows
are the block's output only (`arch.stream_points`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.arch import layout, stream_points
from blockscope.errors import BlockscopeError
from blockscope.text import token_label


def resid_norms(
    model, tokens: torch.Tensor, *, positions: Sequence[int] | None = None
) -> pd.DataFrame:
    """Norm of the residual stream at `positions` (default: the last token) at every point.

    Args:
        tokens: `(1, pos)` token ids.
        positions: token indices, negative from the end; None for the last token only.
    """
    n_pos = tokens.shape[-1]
    positions = [-1] if positions is None else list(positions)
    for p in positions:
        if not -n_pos <= p < n_pos:
            raise BlockscopeError(f"--position {p} is outside the {n_pos} tokens")
    idx = [p % n_pos for p in positions]
    points = stream_points(layout(model), model.cfg.n_layers)
    names = {name for name, _, _ in points}
    with torch.inference_mode():
        _, cache = model.run_with_cache(
            tokens.to(model.cfg.device), names_filter=names.__contains__
        )
    rows = []
    for name, layer, label in points:
        norms = cache[name][0, idx].float().norm(dim=-1)  # (n_positions,)
        for p, norm in zip(idx, norms.tolist(), strict=True):
            rows.append({"after": label, "layer": layer, "hook": name, "position": p,
                         "token": token_label(model.tokenizer, int(tokens[0, p])),
                         "norm": norm})
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    embed = df[df["after"] == "embeddings"].set_index("position")["norm"]
    df["ratio_to_embed"] = df["norm"] / df["position"].map(embed)
    return df
