"""Attention patterns of chosen heads on a prompt, in long format, read at `hook_pattern`."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.experiments.head_roles import patterns
from blockscope.inputs.text import token_text, visible


def check_heads(sizes: dict, layers: Sequence[int], heads: Sequence[int] | None) -> list[int]:
    """Refuse a layer or head out of range for `sizes` (n_layers, n_heads); the heads asked
    for (default: all)."""
    n_layers, n_heads = sizes["n_layers"], sizes["n_heads"]
    for layer in layers:
        if not 0 <= layer < n_layers:
            raise BadValue(f"`layer` {layer} is out of range: 0 to {n_layers - 1}")
    heads = list(range(n_heads)) if heads is None else list(heads)
    for head in heads:
        if not 0 <= head < n_heads:
            raise BadValue(f"`head` {head} is out of range: 0 to {n_heads - 1}")
    return heads


def attention_table(model, tokens: torch.Tensor, *, layers: Sequence[int],
                    heads: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per (layer, head, query position, key position), every key position
    included (zero above the diagonal): `layer, head, query_pos, query_token, key_pos,
    key_token, weight`, each token as its own text (a prepended BOS as the BOS token's)."""
    heads = check_heads({"n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads},
                        layers, heads)
    pats = patterns(model, tokens)  # (n_layers, n_heads, T, T)
    labels = [token_text(model.tokenizer, i) for i in tokens[0].tolist()]  # the real text
    T = tokens.shape[-1]
    q = torch.arange(T).repeat_interleave(T)  # (T*T,)
    k = torch.arange(T).repeat(T)
    frames = []
    for layer in layers:
        for head in heads:
            frames.append(pd.DataFrame({
                "layer": layer, "head": head, "query_pos": q.numpy(),
                "query_token": [labels[i] for i in q.tolist()], "key_pos": k.numpy(),
                "key_token": [labels[i] for i in k.tolist()],
                "weight": pats[layer, head].flatten().numpy()}))
    return pd.concat(frames, ignore_index=True)


def top_keys(df: pd.DataFrame, layer: int, head: int, k: int = 3) -> list[tuple[str, list]]:
    """Per query token of one head: its k most attended (key label, weight), among the keys
    it can see (a causal mask hides the later ones)."""
    one = df[(df["layer"] == layer) & (df["head"] == head) & (df["key_pos"] <= df["query_pos"])]
    out = []
    for (_, label), rows in one.groupby(["query_pos", "query_token"], sort=True):
        best = rows.sort_values("weight", ascending=False, kind="stable").head(k)
        out.append((visible(label), [(f"{r.key_pos}:{visible(r.key_token)}", float(r.weight))
                            for r in best.itertuples()]))
    return out
