"""The position-limited resume's attention (`resume.Resume.block`): a block's queries at the
positions it computes over the base run's kept keys and values before them, under the
recorded mask, as parts for `replay.attn_write`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class OverKept:
    """Block j's attention parts for the resume, in `replay.attn_write`'s one statement of
    the attention (norm, project, attend, heads out): the family's norm, projection (at
    positions start..) and output; the base run's keys and values `kept` (B, n_kv, start,
    d_head) before `start`; the recorded mask; and the edits at `attn.hook_attn_scores`
    (a knockout) and `attn.hook_z`, written as the attention goes by."""

    def __init__(self, p, kept: list[torch.Tensor], start: int, j: int, edit):
        self.p, self.kept, self.start, self.j, self.edit = p, kept, start, j, edit
        self.o, self.head_width, self.attn_norm = p.o, p.head_width, p.attn_norm

    def kept_qkv(self, h: torch.Tensor, ctx, idx, rows):
        """q (B, n_heads, Tq, d_head) of the normed stream h (B, Tq, d_model) at positions
        start..; k, v (B, n_kv, T, d_head): the kept ones, then h's (every head: the resume
        removes none here)."""
        assert idx is None and rows is None
        q, k, v = self.p.project(h, ctx, self.start)
        kp, vp = self.kept
        return q, torch.cat([kp, k], 2), torch.cat([vp, v], 2)

    def attend(self, q, k, v, ctx) -> torch.Tensor:
        """z (B, n_heads, Tq, d_head), as `attn.hook_z`'s edits left it."""
        B, H, Tq, _ = q.shape
        T = self.start + Tq
        allowed = _allowed(ctx, self.start, T, q.device)  # (Tq, T)
        if self.edit.knocks(self.j):  # an additive mask per row and head: a knockout's -inf
            mask = torch.zeros(B, H, Tq, T, dtype=q.dtype, device=q.device)
            mask = self.edit("attn.hook_attn_scores",
                             mask.masked_fill_(~allowed, float("-inf")))
        else:
            mask = allowed
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.p.scale,
                                           enable_gqa=k.shape[1] != H)
        # (B, Tq, n_heads, d_head) as the site holds it, edited, and back
        return self.edit("attn.hook_z", z.transpose(1, 2).contiguous()).transpose(1, 2)


def _allowed(ctx, start: int, T: int, device) -> torch.Tensor:
    """Which keys 0..T-1 each query start..T-1 may attend to (Tq, T): the block's recorded
    mask (causal, or a sliding window), else causal."""
    mask = (ctx[1] if ctx is not None else {}).get("attention_mask")
    if isinstance(mask, torch.Tensor):
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return allowed.reshape(-1, *allowed.shape[-2:])[0, start:T, :T].to(device)
    return (torch.arange(T, device=device)[None, :]
            <= torch.arange(start, T, device=device)[:, None])
