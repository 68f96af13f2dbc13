"""The sweep engine: one clean pass, then every variant only from the first block it changes.

The clean pass of each window keeps each block's input residual (`hook_resid_pre`), its
mid-block residual (`hook_resid_mid`), each head's `z`, and the arguments the model hands
each block (causal mask, positions). A variant then enters the stack where it first differs:

- skipping block k (or its MLP) starts at block k+1 from a cached residual;
- removing block k's attention starts at block k's MLP half;
- removing heads of layer L starts at L's MLP half too: the heads' own layer does not
  recompute queries, keys or values, only subtracts (z_h - fill_h) @ W_O[h] from the cached
  mid residual;
- any other intervention (a hook list) runs from a given layer with its hooks on.

Variants that start at the same point with no hooks are stacked into one batch. A block
that holds a hook (a variant's or anyone's) runs as the model's own TransformerLens bridge
block, so its hook points fire; one that holds none runs as plain torch calls on the same
weights (`replay.py`: fused attention), once that replay has matched the clean pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch

from blockscope import replay
from blockscope.interventions import Hook, applied
from blockscope.sweep import nll_from_logits, perplexity_row, with_change
from blockscope.text import Window

# Activation bytes per batch element and token for GPT-2-like blocks, beyond the stream:
# attention scores + pattern + softmax scratch (3 n_heads T), MLP hidden x2, q/k/v/z.
BUDGET_BYTES = 768 * 2**20  # activations of one batch, so GPT-2 small stays under 3 GB RSS


@dataclass
class Clean:
    """What the clean pass of one window keeps (batch of 1, on the model's device)."""

    window: Window
    chunk: torch.Tensor  # (1, T) token ids fed
    replay: list[tuple[tuple, dict]]  # per block: the args the model passed it, cache removed
    pre: list[torch.Tensor]  # n_layers + 1 of (1, T, d_model); pre[n_layers] enters ln_final
    mid: list[torch.Tensor]  # n_layers of (1, T, d_model)
    z: list[torch.Tensor]  # n_layers of (1, T, n_heads, d_head)
    nll: torch.Tensor  # (n_scored,) clean next-token NLL


@dataclass
class Start:
    """One variant: the residual it enters the stack with, where, and any hooks."""

    label: dict  # columns of its result row
    layer: int  # first block to run (n_layers: straight to the unembedding)
    resid: Callable[[Clean], torch.Tensor]  # (1, T, d_model) residual entering there
    mid: bool = False  # enter block `layer` after its attention half (run only its MLP half)
    hooks: list[Hook] = field(default_factory=list)


def clean_pass(model, tokens: torch.Tensor, w: Window, keep_z: bool = True) -> Clean:
    """One hooked forward of window `w`, keeping what the variants start from (z if asked)."""
    n = model.cfg.n_layers
    chunk = tokens[:, w.begin : w.end].to(model.cfg.device)
    pre, mid, z, replay = [None] * (n + 1), [None] * n, [None] * n, [None] * n
    kept = (("hook_resid_pre", pre), ("hook_resid_mid", mid)) + ((("attn.hook_z", z),)
                                                                  if keep_z else ())

    def keep(store, i):
        def hook(act, hook=None):
            store[i] = act.detach()

        return hook

    hooks = [(f"blocks.{i}.{name}", keep(store, i)) for i in range(n) for name, store in kept]
    hooks.append(("ln_final.hook_in", keep(pre, n)))

    def record(i):
        def pre_hook(module, args, kwargs):
            args = tuple(None if type(a).__name__.endswith("Cache") else a for a in args)
            replay[i] = (args[1:], {**kwargs, "use_cache": False})

        return pre_hook

    handles = [b.register_forward_pre_hook(record(i), with_kwargs=True)
               for i, b in enumerate(model.blocks)]
    try:
        with torch.inference_mode(), applied(model, hooks):
            logits = model(chunk, return_type="logits")  # (1, T, d_vocab)
            nll = nll_from_logits(logits[0], chunk, w)
    finally:
        for h in handles:
            h.remove()
    return Clean(w, chunk, replay, pre, mid, z, nll)


@contextmanager
def fused_gelu(model) -> Iterator[None]:
    """Swap GPT-2's NewGELUActivation (seven elementwise passes in Python) for transformers'
    GELUTanh (torch's fused tanh GELU): the same function, about 3x faster on the CPU, equal
    to within float rounding (~5e-7). Always restored."""
    from transformers.activations import GELUTanh, NewGELUActivation

    swapped = []
    for block in model.blocks:
        mlp = getattr(block.mlp, "original_component", None)
        if isinstance(getattr(mlp, "act", None), NewGELUActivation):
            swapped.append((mlp, mlp.act))
            mlp.act = GELUTanh()
    try:
        yield
    finally:
        for mlp, act in swapped:
            mlp.act = act


def plain_blocks(model, clean: Clean) -> list[replay.Parts] | None:
    """Each block's modules for the plain replay, if every block is one `replay` knows and
    the last block's plain replay of the clean pass gives the clean output; else None."""
    found = [replay.parts(b) for b in model.blocks]
    if any(p is None for p in found):
        return None
    with torch.inference_mode():
        if not replay.agrees(found[-1], clean.pre[-2], clean.pre[-1]):
            return None
    return found


def run_from(model, clean: Clean, x: torch.Tensor, layer: int, mid: bool = False,
             plain: list[replay.Parts] | None = None) -> list:
    """NLL rows for a batch `x` (B, T, d_model) entering block `layer` (after attention if
    `mid`), through the rest of the stack, the final norm and the unembedding. Blocks with
    no hooks run as plain torch calls if `plain` (from `plain_blocks`) is given."""
    with fused_gelu(model):
        return _run_from(model, clean, x, layer, mid, plain)


def _run_from(model, clean: Clean, x: torch.Tensor, layer: int, mid: bool, plain) -> list:
    blocks = model.blocks

    def fast(j):
        return plain[j] if plain is not None and not replay.hooked(blocks[j]) else None

    if mid:  # the MLP half of block `layer`
        block, p = blocks[layer], fast(layer)
        x = replay.mlp_half(p, x) if p else x + block.mlp(block.ln2(x))
        layer += 1
    for j in range(layer, len(blocks)):
        if p := fast(j):
            x = replay.block_forward(p, x)
            continue
        args, kwargs = clean.replay[j]
        out = blocks[j](x, *args, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
    rows = []
    for b in range(x.shape[0]):  # one element at a time: the logits are T x d_vocab each
        rows.append(_final_nll(model, x[b : b + 1], clean).double().cpu())
    return rows


VOCAB_CHUNK = 4096  # unembedding rows per matmul: the logits chunk stays in cache


def _final_nll(model, x: torch.Tensor, clean: Clean) -> torch.Tensor:
    """NLL from the final residual `x` (1, T, d_model): ln_final, then the unembedding in
    vocabulary chunks with a running logsumexp, never materialising T x d_vocab logits.
    Falls back to the bridge's own unembed when hooks sit on it."""
    normed = model.ln_final(x)[0]  # (T, d_model)
    unembed = model.unembed
    linear = getattr(unembed, "original_component", None)
    if (not isinstance(linear, torch.nn.Linear) or unembed.hook_in.has_hooks()
            or unembed.hook_out.has_hooks()):
        return nll_from_logits(unembed(normed[None])[0], clean.chunk, clean.window)
    w = clean.window
    lo = w.first_target - w.begin
    h = normed[lo - 1 : -1]  # (n_scored, d_model): positions that predict the targets
    targets = clean.chunk[0, lo:]  # (n_scored,)
    weight, bias = linear.weight, linear.bias  # (d_vocab, d_model), (d_vocab,) or None
    lse = None
    for s in range(0, weight.shape[0], VOCAB_CHUNK):
        part = h @ weight[s : s + VOCAB_CHUNK].T  # (n_scored, chunk)
        if bias is not None:
            part += bias[s : s + VOCAB_CHUNK]
        chunk_lse = torch.logsumexp(part.float(), dim=-1)
        lse = chunk_lse if lse is None else torch.logaddexp(lse, chunk_lse)
    target = (h * weight[targets]).sum(-1)  # (n_scored,) the target logits
    if bias is not None:
        target = target + bias[targets]
    return lse - target.float()


def cached_means(clean: Clean) -> dict[str, torch.Tensor]:
    """The clean means over positions that `sweep.clean_means` hooks for, from one window's
    cache: the stream before/after each block, each half's output, each head's z."""
    out = {}

    def mean(t: torch.Tensor) -> torch.Tensor:
        return t.double().mean(dim=(0, 1)).float()

    for k in range(len(clean.mid)):
        out[f"blocks.{k}.hook_resid_pre"] = mean(clean.pre[k])
        out[f"blocks.{k}.hook_resid_post"] = mean(clean.pre[k + 1])
        out[f"blocks.{k}.hook_attn_out"] = mean(clean.mid[k] - clean.pre[k])
        out[f"blocks.{k}.hook_mlp_out"] = mean(clean.pre[k + 1] - clean.mid[k])
        if clean.z[k] is not None:
            out[f"blocks.{k}.attn.hook_z"] = mean(clean.z[k])
    return out


def default_batch_size(model, n_tokens: int) -> int:
    """Variants per batch: 1 on the CPU, where stacking variants measured no faster (the
    matmuls are already large; see benchmarks/); elsewhere as many as keep one batch's
    activations near BUDGET_BYTES."""
    cfg = model.cfg
    if str(getattr(cfg, "device", "cpu")).startswith("cpu"):
        return 1
    per_token = 4 * (3 * cfg.n_heads * n_tokens + 2 * cfg.d_mlp + 6 * cfg.d_model)
    return max(1, min(16, BUDGET_BYTES // max(1, per_token * n_tokens)))


def engine_sweep(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Start],
    *,
    wins: Sequence[Window],
    cleans: Sequence[Clean] | None = None,
    batch_size: int | None = None,
    progress=None,
    on_clean: Callable[[Clean], None] | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per variant: the same table `sweep.sweep` gives.

    `on_clean` sees each window's clean pass (metrics at no extra forward cost)."""
    if progress:
        progress(total=len(variants) * len(wins) + 1)
    nlls: list[list[torch.Tensor]] = [[] for _ in variants]
    baseline = []
    for wi, w in enumerate(wins):
        clean = cleans[wi] if cleans is not None else clean_pass(model, tokens, w)
        if on_clean:
            on_clean(clean)
        baseline.append(clean.nll.double().cpu())
        plain = plain_blocks(model, clean)
        size = batch_size or default_batch_size(model, w.end - w.begin)
        for group in _groups(variants, size):
            with torch.inference_mode():
                first = variants[group[0]]
                with applied(model, first.hooks):
                    x = torch.cat([variants[i].resid(clean) for i in group])  # (B, T, d)
                    rows = run_from(model, clean, x, first.layer, first.mid, plain)
            for i, row in zip(group, rows, strict=True):
                nlls[i].append(row)
            if progress:
                for _ in group:
                    progress()
    if progress:
        progress()
    records = [{"variant": "baseline", **perplexity_row(torch.cat(baseline))}]
    records += [{"variant": "ablated", **v.label, **perplexity_row(torch.cat(n))}
                for v, n in zip(variants, nlls, strict=True)]
    return with_change(records)


def _groups(variants: Sequence[Start], size: int) -> list[list[int]]:
    """Consecutive variants with one entry point and no hooks, in batches of `size`."""
    groups: list[list[int]] = []
    for i, v in enumerate(variants):
        last = variants[groups[-1][0]] if groups else None
        if (last is not None and not v.hooks and not last.hooks and len(groups[-1]) < size
                and (v.layer, v.mid) == (last.layer, last.mid)):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def heads_removed(model, layer: int, keep: torch.Tensor, fill: torch.Tensor | None) -> Callable:
    """Residual after layer `layer`'s attention with heads scaled by `keep` (n_heads,), the
    removed part replaced by `fill` (n_heads, d_head): mid - sum_h (1-keep_h)(z_h-fill_h) W_O[h]."""

    def resid(clean: Clean) -> torch.Tensor:
        z = clean.z[layer][0]  # (T, n_heads, d_head)
        W_O = model.blocks[layer].attn.W_O  # (n_heads, d_head, d_model)
        gone = (1 - keep).to(z)  # (n_heads,)
        diff = (fill.to(z) if fill is not None else 0) - z  # (T, n_heads, d_head)
        delta = torch.einsum("h,thd,hde->te", gone, diff, W_O.to(z))  # (T, d_model)
        return clean.mid[layer] + delta

    return resid
