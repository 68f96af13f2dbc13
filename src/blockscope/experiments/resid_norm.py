"""How long the residual stream grows: its L2 norm after the embeddings and every half-block.

Rows follow the stream: the embeddings (token + position, `blocks.0.hook_resid_pre`), then for
each block the stream after its attention half (`hook_resid_mid`) and after the whole block
(`hook_resid_post`). `after` names the block, counted from 0 like `layer` (the article
counts from 1).
A parallel block (GPT-J, GPT-NeoX, Phi, Falcon) has no point between its halves: its rows
are the block's output only (`arch.stream_points`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.inputs.text import token_text
from blockscope.model.arch import layout, stream_points


def check_positions(positions: Sequence[int], n_pos: int) -> None:
    """Refuse a position outside the prompt's `n_pos` tokens (negative: from the end)."""
    for p in positions:
        if not -n_pos <= p < n_pos:
            raise BadValue(f"`position` {p} is outside the {n_pos} tokens")


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
    check_positions(positions, n_pos)
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
                         "token": token_text(model.tokenizer, int(tokens[0, p])),
                         "norm": norm})
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    embed = df[df["after"] == "embeddings"].set_index("position")["norm"]
    df["ratio_to_embed"] = df["norm"] / df["position"].map(embed)
    return df


def norm_distribution(model, tokens, *, stride: int | None = None) -> pd.DataFrame:
    """Over the tokens of a corpus (`corpus.Docs`, every process): the median, 10th and 90th
    percentile and mean of the residual norm at every point of the stream, leaving out each
    document's first position (BOS, or the first token: an outlier in every model).

    A document longer than the context is read in the sliding windows of `ablate`, each
    token once, with the context those windows give it."""
    import numpy as np

    from blockscope.inputs.corpus import as_docs
    from blockscope.inputs.parallel import in_order
    from blockscope.sweeps.clean import drop_patterns
    from blockscope.sweeps.naive import model_windows

    docs = as_docs(tokens)
    points = stream_points(layout(model), model.cfg.n_layers)
    names = {name for name, _, _ in points}
    norms = []  # per window: (document, (n_points, n_new) float32)
    with torch.inference_mode():
        for index, ids in zip(docs.index, docs.ids, strict=True):
            for w in model_windows(model, ids, stride):
                chunk = ids[:, w.begin : w.end].to(model.cfg.device)
                _, cache = model.run_with_cache(chunk, names_filter=names.__contains__)
                lo = w.offset  # positions not read in an earlier window
                norms.append((index, torch.stack([cache[name][0, lo:].float().norm(dim=-1)
                                                  for name, _, _ in points]).cpu().numpy()))
                del cache
                drop_patterns(model)
    parts = in_order(docs.comm, norms)  # corpus order (a stable sort keeps the windows')
    if not parts or sum(p.shape[1] for p in parts) == 0:
        raise BlockscopeError("no positions to measure: every document is a single token")
    every = np.concatenate(parts, axis=1)  # (n_points, n_tokens)
    p10, median, p90 = np.percentile(every, [10, 50, 90], axis=1)
    df = pd.DataFrame({"after": [label for _, _, label in points],
                       "layer": [layer for _, layer, _ in points],
                       "hook": [name for name, _, _ in points],
                       "n_tokens": every.shape[1], "median": median, "p10": p10, "p90": p90,
                       "mean": every.mean(axis=1)})
    df["layer"] = df["layer"].astype("Int64")
    df["median_ratio_to_embed"] = df["median"] / df.loc[0, "median"]
    return df
