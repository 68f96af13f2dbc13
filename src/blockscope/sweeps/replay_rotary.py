"""Llama-family and GPT-NeoX blocks as plain torch calls, for the engine's replays.

The same idea as GPT-2's `replay.Parts`: the block's own weights and norms (through
TransformerLens's generic submodules, `model.adapters` for the rest), read at
every call, and torch's fused `scaled_dot_product_attention` in place of the bridge's
step-by-step attention (which exists so that `hook_attn_scores`, `hook_pattern`, `hook_rot_q`
... can fire). What a rotary block needs beyond its weights comes from the arguments the clean
pass recorded for that block (`ctx`): the rotary `position_embeddings` (cos, sin) and the
attention mask (causal, or a sliding window). The engine checks every replay against the
clean pass before it is used (`selfcheck`); a disagreement means the bridge's blocks run.

- Llama, Mistral, Qwen2: RMSNorm, rotary on every dimension, grouped-query attention
  (K/V heads shared by `n_heads / n_key_value_heads` query heads), SwiGLU MLP.
- GPT-NeoX / Pythia: LayerNorm, partial rotary (the first `rotary_ndims` of each head),
  attention and MLP in parallel (`use_parallel_residual`) or in sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockscope.model import adapters
from blockscope.model.adapters import generic
from blockscope.sweeps.replay import in_rows, products


class ReplayArgsMissing(RuntimeError):
    """The clean pass did not record what this block's replay needs (e.g. rotary cos/sin)."""


def _rope(ctx):
    """(cos, sin) from a block's recorded call `ctx`."""
    rope = (ctx[1] if ctx is not None else {}).get("position_embeddings")
    if rope is None:
        raise ReplayArgsMissing("no rotary position embeddings recorded for this block")
    return rope


def _mask_args(ctx, T: int) -> dict:
    """The SDPA mask arguments from a block's recorded call `ctx`: `is_causal=True` when
    the recorded mask is the plain causal one (the fast path), else that mask itself as
    booleans (True: may attend), broadcast over batch and heads."""
    mask = (ctx[1] if ctx is not None else {}).get("attention_mask")
    if mask is None:
        return {"is_causal": True}
    allowed = mask if mask.dtype == torch.bool else mask == 0  # (1, 1, T, T) or (B, 1, T, T)
    allowed = allowed[..., -T:, -T:]
    causal = torch.ones(T, T, dtype=torch.bool, device=allowed.device).tril()
    if bool((allowed == causal).all()):
        return {"is_causal": True}
    return {"attn_mask": allowed}


def _rope_at(ctx, start: int, T: int):
    """The recorded rotary (cos, sin) at positions start..start+T-1."""
    rope = (ctx[1] if ctx is not None else {}).get("position_embeddings")
    if rope is None:
        raise ReplayArgsMissing("no rotary position embeddings recorded for this block")
    return tuple(t[:1, start : start + T] for t in rope)


def _attend(q, k, v, scale: float, mask_args: dict) -> torch.Tensor:
    """Fused attention; q (B, n_heads, T, d_head), k/v (B, n_kv_heads, T, d_head)."""
    if k.shape[1] != q.shape[1]:  # grouped-query: each K/V head serves a group of query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **mask_args)


class LlamaParts:
    """One Llama/Mistral/Qwen2 decoder layer's modules, called plainly."""

    parallel = False
    LINEARS = ("q", "k", "v", "o", "gate", "up", "down")

    def __init__(self, block, facts: dict):
        self.ln1, self.ln2 = generic(block, "ln1"), generic(block, "ln2")
        self.q, self.k, self.v, self.o = (generic(block, f"attn.{n}") for n in "qkvo")
        self.gate, self.up, self.down = (generic(block, f"mlp.{n}")
                                         for n in ("gate", "in", "out"))
        self.act, self.d_head, self.scale = facts["act"], facts["d_head"], facts["scale"]
        self.rotary = facts["rotary"]

    @property
    def head_width(self) -> int:
        return self.d_head

    def kept_qkv(self, h: torch.Tensor, ctx, idx, rows):
        """q, k, v (B, k, T, d_head) of the query heads `idx` (all if None), their
        features `rows`, and of the K/V heads each reads (the others left out), rotated."""
        B, T, _ = h.shape
        cos, sin = _rope(ctx)
        n_heads = self.q.out_features // self.d_head
        n_kv = self.k.out_features // self.d_head
        q = in_rows(self.q, h, rows).view(B, T, -1 if idx is None else len(idx), self.d_head)
        k, v = (m(h).view(B, T, n_kv, self.d_head) for m in (self.k, self.v))
        if idx is not None:  # the K/V head each kept query head reads: (B, T, k, d_head)
            group = idx // (n_heads // n_kv)
            k, v = k[:, :, group], v[:, :, group]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d_head)
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v

    def attend(self, q, k, v, ctx) -> torch.Tensor:
        return _attend(q, k, v, self.scale, _mask_args(ctx, q.shape[2]))

    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln1(x)

    def project(self, h: torch.Tensor, ctx, start: int = 0):
        """q (B, n_heads, T, d_head) and k, v (B, n_kv_heads, T, d_head) of the normed
        stream h (B, T, d_model) at positions start.., rotated for those positions."""
        B, T, _ = h.shape
        cos, sin = _rope_at(ctx, start, T)
        q, k, v = (t.view(B, T, -1, self.d_head).transpose(1, 2)
                   for t in products(self, ("q", "k", "v"), h))
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v

    def mlp_write(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln2(x)
        gate, up = products(self, ("gate", "up"), h)
        return self.down(self.act(gate).mul_(up))  # SwiGLU, in the activation's own output


class NeoXParts:
    """One GPT-NeoX layer's modules, called plainly."""

    LINEARS = ("qkv", "o", "fc_in", "fc_out")

    def __init__(self, block, facts: dict):
        self.parallel = bool(facts["parallel"])
        self.ln1, self.ln2 = generic(block, "ln1"), generic(block, "ln2")
        self.qkv, self.o = generic(block, "attn.qkv"), generic(block, "attn.o")
        self.fc_in, self.fc_out = generic(block, "mlp.in"), generic(block, "mlp.out")
        self.act, self.d_head, self.scale = facts["act"], facts["d_head"], facts["scale"]
        self.rotary = facts["rotary"]

    @property
    def head_width(self) -> int:
        return 3 * self.d_head  # each head's q, k, v side by side

    def kept_qkv(self, h: torch.Tensor, ctx, idx, rows):
        """q, k, v (B, k, T, d_head) of the heads `idx` (all if None), their features
        `rows`, rotated."""
        B, T, _ = h.shape
        cos, sin = _rope(ctx)
        n = self.qkv.out_features // (3 * self.d_head) if idx is None else len(idx)
        qkv = in_rows(self.qkv, h, rows).view(B, T, n, 3 * self.d_head)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)  # each (B, n, T, d_head)
        q, k = self.rotary(q, k, cos, sin)  # rotates the first cos.shape[-1] dims only
        return q, k, v

    def attend(self, q, k, v, ctx) -> torch.Tensor:
        return _attend(q, k, v, self.scale, _mask_args(ctx, q.shape[2]))

    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln1(x)

    def project(self, h: torch.Tensor, ctx, start: int = 0):
        """q, k, v (B, n_heads, T, d_head) of the normed stream h (B, T, d_model) at
        positions start.., rotated for those positions."""
        B, T, _ = h.shape
        cos, sin = _rope_at(ctx, start, T)
        qkv = self.qkv(h).view(B, T, -1, 3 * self.d_head)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v

    def mlp_write(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(self.ln2(x))))


def parts(block, kind: str):
    """A Llama-family ("llama") or GPT-NeoX ("neox") block's plain parts, read through
    TransformerLens's generic submodules, or None where the block is not that layout."""
    facts = None if block.training else adapters.rotary_facts(block, kind)
    if facts is None:
        return None
    found = (LlamaParts if kind == "llama" else NeoXParts)(block, facts)
    linears = [getattr(found, n) for n in found.LINEARS]
    if not all(isinstance(m, torch.nn.Linear) for m in linears) or None in (found.ln1,
                                                                              found.ln2):
        return None
    return found
