"""Blocks as plain torch calls, for the engine's replays.

The bridge's attention computes scores, mask, softmax and pattern one step at a time so that
its hook points (`hook_attn_scores`, `hook_pattern`, ...) can fire. When none of a block's
hook points holds a hook, the engine runs the same function here instead: the bridge's own
weights (read at every call, so nothing goes stale) and torch's fused
`scaled_dot_product_attention` (causal): faster a block (docs/performance.md, "Design
choices, measured"), equal to float rounding; the engine checks the agreement on every
clean pass (`selfcheck`) and otherwise keeps the bridge. GPT-2's blocks are here; the Llama
family's and GPT-NeoX's in `replay_rotary`, behind the same `parts`; the final norm and
unembedding in `unembed`. `masked_nll` is the whole model with a head mask, differentiable,
for the pruning curve."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from blockscope.interventions import ScaleHeads
from blockscope.model import adapters
from blockscope.sweeps import unembed
from blockscope.sweeps.naive import nll_of


@dataclass
class Parts:
    """One GPT-2 block's modules, as the bridge calls them."""

    ln_1: torch.nn.LayerNorm
    q: torch.nn.Linear  # (d_model -> n_heads * d_head), as are k and v
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Module  # HF Conv1D (n_heads * d_head -> d_model)
    scale: float  # attention scores are multiplied by this
    n_heads: int
    ln_2: torch.nn.LayerNorm
    c_fc: torch.nn.Module  # HF Conv1D (d_model -> d_mlp)
    mlp: torch.nn.Module  # the HF MLP: its `act` is read at each call (see mlp_write)
    c_proj: torch.nn.Module  # HF Conv1D (d_mlp -> d_model)
    parallel = False  # attention then MLP

    @property
    def d_head(self) -> int:
        return self.q.out_features // self.n_heads

    @property
    def head_width(self) -> int:
        """Features per head in the q/k/v projections' outputs (`kept_heads`)."""
        return self.d_head

    def kept_qkv(self, h: torch.Tensor, ctx, idx, rows):
        """q, k, v (B, k, T, d_head) of the heads `idx` (all if None), their features
        `rows`, from the normed stream h (B, T, d_model)."""
        B, T, _ = h.shape
        k = self.n_heads if idx is None else len(idx)

        def heads(linear):  # (B, k, T, d_head): the kept heads
            return in_rows(linear, h, rows).view(B, T, k, self.d_head).transpose(1, 2)

        return heads(self.q), heads(self.k), heads(self.v)

    def attend(self, q, k, v, ctx) -> torch.Tensor:
        """z (B, k, T, d_head): causal attention (GPT-2's positions are in the stream)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(self.ln_1, x)

    def project(self, h: torch.Tensor, ctx=None, start: int = 0):
        """q, k, v (B, n_heads, T, d_head) of the normed stream h (B, T, d_model) at
        positions start.. (GPT-2's positions are in the stream already)."""
        B, T, _ = h.shape
        return tuple(t.view(B, T, self.n_heads, self.d_head).transpose(1, 2)
                     for t in products(self, ("q", "k", "v"), h))

    def mlp_write(self, x: torch.Tensor) -> torch.Tensor:
        """mlp(ln_2(x)), with the MLP's activation as it is at the call: inside the
        engine's `fused_gelu`, torch's fused tanh GELU (`adapters.fast_activations`)."""
        hidden = self.c_fc(_layer_norm(self.ln_2, x))  # (B, T, d_mlp)
        return self.c_proj(self.mlp.act(hidden))


class Joined:
    """Several nn.Linear read from the same input as one product, their weights
    concatenated once (the resume's per-sweep copy: a wider product runs nearer the
    matmul rate); the outputs split back."""

    def __init__(self, linears):
        self.sizes = [m.out_features for m in linears]
        self.weight = torch.cat([m.weight for m in linears])
        biases = [m.bias for m in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat([
            b if b is not None else m.weight.new_zeros(m.out_features)
            for m, b in zip(linears, biases, strict=True)])

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(h, self.weight, self.bias).split(self.sizes, -1)


def products(parts, names: tuple[str, ...], h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The Linears `names` of `parts` applied to h: as one product where `parts.joined`
    holds them joined (`Joined`), else one by one."""
    joined = getattr(parts, "joined", {}).get(names)
    return joined(h) if joined is not None else tuple(getattr(parts, n)(h) for n in names)


def join_products(parts) -> None:
    """Join each block's q/k/v and gate/up products (where they are separate Linears) for
    the rest of this Parts object's life: the resume's sweep."""
    groups = [("q", "k", "v"), ("gate", "up")]
    parts.joined = {names: Joined([getattr(parts, n) for n in names]) for names in groups
                    if all(isinstance(getattr(parts, n, None), torch.nn.Linear)
                           for n in names)}


def scaled(z: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """z (B, n_heads, T, d_head) with each head scaled by `keep` (n_heads,): the heads
    intervention's own `apply` (without a fill) on this layout (selfcheck holds the
    replay to the hooked model)."""
    if keep is None:
        return z
    return ScaleHeads(keep).apply(z.transpose(1, 2)).transpose(1, 2)


def kept_heads(keep: torch.Tensor | None, width: int):
    """(idx, rows): the heads `keep` (n_heads,) leaves in (k,) and their features (k width,)
    in a layout of `width` features per head; (None, None) when no head is removed. A head
    scaled by exactly 0 writes nothing, so a replay need not compute its query, key and
    value: in most of the pruning curve's steps most heads are gone."""
    if keep is None or bool((keep.detach() != 0).all()):
        return None, None
    idx = (keep.detach() != 0).nonzero().flatten()
    return idx, head_rows(idx, width)


def head_rows(idx: torch.Tensor, width: int) -> torch.Tensor:
    """The features (k width,) of heads `idx` (k,) in a layout of `width` per head."""
    return (idx[:, None] * width + torch.arange(width, device=idx.device)).flatten()


def in_rows(linear: torch.nn.Linear, h: torch.Tensor, rows) -> torch.Tensor:
    """linear(h), only its output features `rows` (all if None)."""
    if rows is None:
        return linear(h)
    return F.linear(h, linear.weight[rows], None if linear.bias is None else linear.bias[rows])


def heads_out(o: torch.nn.Module, z: torch.Tensor, keep, idx) -> torch.Tensor:
    """The output projection `o` (nn.Linear or HF Conv1D) of z (B, k, T, d_head), the heads
    `idx` (all if None) scaled by `keep` (n_heads,): (B, T, d_model). With heads removed, only
    the kept heads' rows of W_O enter: the removed ones would add exact zeros."""
    B, _, T, d_head = z.shape
    if idx is None:
        return o(scaled(z, keep).transpose(1, 2).reshape(B, T, -1))
    rows = head_rows(idx, d_head)
    flat = scaled(z, keep[idx]).transpose(1, 2).reshape(B, T, -1)  # (B, T, k d_head)
    if isinstance(o, torch.nn.Linear):
        return F.linear(flat, o.weight[:, rows], o.bias)
    out = flat @ o.weight[rows]  # HF Conv1D: weight (n_in, n_out)
    return out if o.bias is None else out + o.bias


def parts(block):
    """The plain parts (`Parts`) of a bridged GPT-2 block in eval mode, read through
    TransformerLens's generic submodules; None where the block is not the layout they read
    (`steps.plain_parts` picks the family's replay)."""
    facts = None if block.training else adapters.gpt2_facts(block)
    if facts is None:
        return None
    mods = [adapters.generic(block, n) for n in ("attn.q", "attn.k", "attn.v", "attn.o", "ln1",
                                                 "ln2", "mlp.in", "mlp.out")]
    if any(m is None for m in mods) or not all(isinstance(m, torch.nn.Linear) for m in mods[:3]):
        return None
    if not all(isinstance(m, torch.nn.LayerNorm) for m in mods[4:6]):
        return None
    q, k, v, o, ln_1, ln_2, c_fc, c_proj = mods
    return Parts(ln_1, q, k, v, o, facts["scale"], facts["n_heads"], ln_2, c_fc, facts["mlp"],
                 c_proj)


def hooked(block) -> bool:
    """Whether a hook would fire inside `block`: one on any of its TransformerLens hook
    points (however it was added: `model.hooks`, `run_with_hooks`, `add_hook`), or a global
    torch module hook. The bridge's own capture pre-hooks on its norms do not count: they
    only feed hook points."""
    from transformer_lens.hook_points import HookPoint

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks
               for m in block.modules() if isinstance(m, HookPoint))


def _layer_norm(ln: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def attn_write(p, x: torch.Tensor, ctx=None, keep=None) -> torch.Tensor:
    """attention(norm(x)) for x (B, T, d_model), as nanoGPT writes it, once for every family:
    norm, project, attend, heads out. Each head's z is scaled by `keep` (n_heads,) if given,
    and the heads it sets to 0 are left out (`kept_heads`). `p` gives the family's norm,
    projection (`kept_qkv`, rotary included), attention (`attend`: the recorded mask) and
    output `o`: a family's `Parts`, or the position-limited resume's
    (`kept_attention.OverKept`); `ctx` is the block's recorded call."""
    idx, rows = kept_heads(keep, p.head_width)
    q, k, v = p.kept_qkv(p.attn_norm(x), ctx, idx, rows)  # (B, k, T, d_head) each
    z = p.attend(q, k, v, ctx)  # (B, k, T, d_head)
    return heads_out(p.o, z, keep, idx)  # (B, T, d_model)


def attn_half(p, x: torch.Tensor, ctx=None, keep=None) -> torch.Tensor:
    """x + attention(norm(x)) for x (B, T, d_model); `ctx` the block's recorded call."""
    return x + attn_write(p, x, ctx, keep)


def mlp_half(p, x: torch.Tensor) -> torch.Tensor:
    """x + mlp(norm(x)) for a sequential block's mid residual x (B, T, d_model)."""
    return x + p.mlp_write(x)


def block_forward(p, x: torch.Tensor, ctx=None, keep=None) -> torch.Tensor:
    """One whole block: (B, T, d_model) -> (B, T, d_model), parallel or in sequence; heads
    scaled by `keep` (n_heads,) if given."""
    if p.parallel:
        return x + attn_write(p, x, ctx, keep) + p.mlp_write(x)
    return mlp_half(p, attn_half(p, x, ctx, keep))


def masked_nll(model, plain: list, clean, mask: torch.Tensor,
               softcap: float | None = None) -> torch.Tensor:
    """NLL (n_scored,) of `clean`'s window with each layer's heads scaled by `mask`
    (n_layers, n_heads), replayed plainly from the embeddings and differentiable (for the
    gradient of the head mask): the scored rows' NLL in vocabulary blocks, or from their
    full logits (`naive.nll_of`) where softcapping or half precision rules that out."""
    x = _trackable(clean.pre[0])  # (1, T, d_model) what block 0 received
    for j, p in enumerate(plain):
        x = block_forward(p, x, _trackable(clean.block_args[j]), mask[j])
    w = clean.window
    lo = w.offset
    normed = model.ln_final(x)[0, lo - 1 : -1]  # (n_scored, d_model): the predicting rows
    linear, targets = model.unembed.original_component, clean.chunk[0, lo:]
    if softcap is None and isinstance(linear, torch.nn.Linear) and normed.dtype == torch.float32:
        return unembed.ChunkedNLL.apply(normed, linear.weight, linear.bias, targets)
    return nll_of(unembed.softcapped(linear(normed), softcap), targets)


def _trackable(value):
    """`value` (a tensor, or tuples, lists and dicts of them) with every tensor made in
    inference mode (the clean pass's) cloned into one autograd may save for backward."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_trackable(v) for v in value)
    if isinstance(value, dict):
        return {k: _trackable(v) for k, v in value.items()}
    return value
