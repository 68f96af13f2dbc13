"""What heads do: TransformerLens's head-detector scores for every head, beside what
`prune-heads` says each head is worth.

Roles ("mul" measure: the share of a head's attention mass on the detection pattern's
entries, over its total mass):
- `previous_token`: on a text, each token attending to the one before it;
- `duplicate_token`: on random tokens repeated twice, each token of the second copy
  attending to its earlier occurrence;
- `induction`: on the same sequence, attending to the token *after* the earlier occurrence.

The patterns come from one forward of the bridge read at `attn.hook_pattern` (each query
head's own pattern, also where heads share K/V).
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.similarity import spearman

ROLES = ("previous_token", "duplicate_token", "induction")


MEASURE = ("mul: attention mass on the detection pattern / total mass "
           "(transformer_lens.head_detector), exclude_bos=False, exclude_current_token=False")

def patterns(model, tokens: torch.Tensor) -> torch.Tensor:
    """Attention patterns (n_layers, n_heads, T, T) of `tokens` (1, T), float32 on the CPU."""
    n = model.cfg.n_layers
    got: list = [None] * n

    def keep(i):
        def hook(pattern, hook=None):  # (1, n_heads, T, T)
            got[i] = pattern.detach()[0].float().cpu()

        return hook

    from blockscope.interventions import applied

    with torch.inference_mode(), applied(model, [(f"blocks.{i}.attn.hook_pattern", keep(i))
                                                 for i in range(n)]):
        model(tokens.to(model.cfg.device), return_type=None)
    if any(g is None for g in got):
        raise BlockscopeError("this model's attention does not expose hook_pattern: "
                              "no patterns to read")
    return torch.stack(got)


def repeated_random(model, n_random: int, seed: int) -> torch.Tensor:
    """BOS (as the loaded model prepends it) + n_random random token ids + the same again:
    (1, [1 +] 2 n_random). BOS is left out of the draw."""
    vocab = model.cfg.d_vocab
    bos = model.tokenizer.bos_token_id
    prepend = bool(getattr(model.cfg, "default_prepend_bos", True)) and bos is not None
    n_ctx = model.cfg.n_ctx
    if not 2 <= n_random <= (n_ctx - int(prepend)) // 2:
        raise BadValue(f"`n_random` must be between 2 and half the context "
                       f"({(n_ctx - int(prepend)) // 2}), got {n_random}")
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, vocab - (bos is not None and bos < vocab), (n_random,),
                         generator=gen)
    if bos is not None and bos < vocab:
        draw = draw + (draw >= bos).long()  # every id but BOS, uniformly
    ids = torch.cat([draw, draw])
    if prepend:
        ids = torch.cat([torch.tensor([bos]), ids])
    return ids[None]


def role_scores(model, text_tokens: torch.Tensor, random_tokens: torch.Tensor) -> pd.DataFrame:
    """One row per head: layer, head and the three role scores."""
    # TransformerLens's `detect_head` takes a string and re-tokenizes it, so a sequence of
    # random token ids (which do not survive a decode/encode round trip) or a text cut at
    # --max-tokens cannot go through it. Its detection patterns and scoring function are
    # what it uses inside; they are called here on the bridge's own patterns.
    from transformer_lens.head_detector import (
        compute_head_attention_similarity_score,
        get_duplicate_token_head_detection_pattern,
        get_induction_head_detection_pattern,
        get_previous_token_head_detection_pattern,
    )

    text_p, rand_p = patterns(model, text_tokens), patterns(model, random_tokens)
    detect = {
        "previous_token": (text_p, get_previous_token_head_detection_pattern(text_tokens.cpu())),
        "duplicate_token": (rand_p,
                            get_duplicate_token_head_detection_pattern(random_tokens.cpu())),
        "induction": (rand_p, get_induction_head_detection_pattern(random_tokens.cpu())),
    }
    rows = []
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            row = {"layer": layer, "head": head}
            for role, (pats, pattern) in detect.items():
                row[role] = compute_head_attention_similarity_score(
                    pats[layer, head], pattern, exclude_bos=False, exclude_current_token=False,
                    error_measure="mul")
            rows.append(row)
    return pd.DataFrame(rows)


def join_importance(roles: pd.DataFrame, per_head: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Join prune-heads' per-head table (its `delta` as `ablation_delta`, and
    `gradient_importance`) by layer and head; Spearman correlation of each role score
    with each importance, over the heads both have."""
    need = {"layer", "head", "delta", "gradient_importance"}
    if not need <= set(per_head.columns):
        raise BlockscopeError("the prune-heads CSV lacks columns: "
                              + ", ".join(sorted(need - set(per_head.columns))))
    cols = per_head[["layer", "head", "delta", "gradient_importance"]].rename(
        columns={"delta": "ablation_delta"})
    df = roles.merge(cols, on=["layer", "head"], how="left")
    both = df.dropna(subset=["ablation_delta", "gradient_importance"])
    corr = {f"{role} ~ {imp}": spearman(both[role], both[imp])
            for role in ROLES for imp in ("ablation_delta", "gradient_importance")}
    return df, corr


def top_heads(df: pd.DataFrame, role: str, k: int = 5) -> list[tuple[int, int, float]]:
    """The k heads with the highest `role` score: (layer, head, score)."""
    top = df.sort_values(role, ascending=False, kind="stable").head(k)
    return [(int(r.layer), int(r.head), float(getattr(r, role))) for r in top.itertuples()]
