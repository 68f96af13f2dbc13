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

Consecutive variants with no hooks run as one batch that grows block by block as each
joins at its own entry point. A block that holds a hook (a variant's or anyone's) runs as
the model's own TransformerLens bridge block, so its hook points fire; one that holds none
runs as plain torch calls on the same weights (`replay.py`: fused attention), once that
replay has matched the clean pass.
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
    pre, mid, z, args_of = [None] * (n + 1), [None] * n, [None] * n, [None] * n
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
            args_of[i] = (args[1:], {**kwargs, "use_cache": False})

        return pre_hook

    handles = [b.register_forward_pre_hook(record(i), with_kwargs=True)
               for i, b in enumerate(model.blocks)]
    try:
        with torch.inference_mode(), applied(model, hooks):
            if _last_logits_only(model):  # score from the final residual, chunked
                model(chunk, return_type="logits", logits_to_keep=1)
                nll = replay.final_nll(model, pre[n], chunk, w)[0]
            else:
                logits = model(chunk, return_type="logits")  # (1, T, d_vocab)
                nll = nll_from_logits(logits[0], chunk, w)
    finally:
        for h in handles:
            h.remove()
    return Clean(w, chunk, args_of, pre, mid, z, nll)


def _last_logits_only(model) -> bool:
    """Whether the clean pass may ask HF for the last position's logits only (the NLL then
    comes from the kept final residual, as in every variant): the HF model must take
    `logits_to_keep` and no hook may sit on the unembedding, which would see one position."""
    import inspect

    hf = getattr(model, "original_model", None)
    try:
        takes = "logits_to_keep" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return takes and not (model.unembed.hook_in.has_hooks() or model.unembed.hook_out.has_hooks())


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


def run_group(model, clean: Clean, entries: Sequence[tuple[int, bool, torch.Tensor]],
              plain: list[replay.Parts] | None = None) -> list[torch.Tensor]:
    """NLL rows (n_scored,) for variants entering the stack at `(layer, mid, x)`: block
    `layer` (its MLP half if `mid`) with residual x (1, T, d_model). They run as one batch
    that grows block by block as variants join it, then the final norm and unembedding.
    Blocks with no hooks run as plain torch calls if `plain` (`plain_blocks`) is given."""
    blocks, order = model.blocks, []

    def join(x, mid, j):
        idx = [i for i, (layer, m, _) in enumerate(entries) if (layer, m) == (j, mid)]
        order.extend(idx)
        new = [entries[i][2] for i in idx]
        return x if not new else torch.cat(([] if x is None else [x]) + new)  # (B, T, d)

    x = None
    with fused_gelu(model):
        for j in range(min(e[0] for e in entries), len(blocks)):
            x = join(x, False, j)
            p = plain[j] if plain is not None and not replay.hooked(blocks[j]) else None
            if p is not None:
                x = join(None if x is None else replay.attn_half(p, x), True, j)
                x = None if x is None else replay.mlp_half(p, x)
                continue
            if x is not None:
                args, kwargs = clean.replay[j]
                out = blocks[j](x, *args, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
            m = join(None, True, j)  # entering after attention: the MLP half only
            if m is not None:
                m = m + blocks[j].mlp(blocks[j].ln2(m))
                x = m if x is None else torch.cat([x, m])
        x = join(x, False, len(blocks))
        nll = replay.final_nll(model, x, clean.chunk, clean.window)  # (B, n_scored)
    rows: list = [None] * len(entries)
    for i, row in zip(order, nll, strict=True):
        rows[i] = row.double().cpu()
    return rows


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


CPU_BATCH = 6  # variants per batch on the CPU with the plain replay (see benchmarks/)


def default_batch_size(model, n_tokens: int, plain: bool = False) -> int:
    """Variants per batch. On the CPU: CPU_BATCH with the plain replay (batches of 3-6
    measured about 8% faster than one at a time on GPT-2 small), 1 through the bridge's
    blocks (stacking measured slower there). Elsewhere: as many as keep one batch's
    activations near BUDGET_BYTES; never more than that on the CPU either."""
    cfg = model.cfg
    per_token = 4 * (3 * cfg.n_heads * n_tokens + 2 * cfg.d_mlp + 6 * cfg.d_model)
    budget = max(1, min(16, BUDGET_BYTES // max(1, per_token * n_tokens)))
    if str(getattr(cfg, "device", "cpu")).startswith("cpu"):
        return min(budget, CPU_BATCH) if plain else 1
    return budget


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

    `on_clean` sees each window's clean pass (metrics at no extra forward cost). The
    result's `attrs["engine"]` says how it ran: the batch size and the blocks replayed
    ("plain", "bridge", or "plain+bridge" when windows differed)."""
    if progress:
        progress(total=len(variants) * len(wins) + 1)
    nlls: list[list[torch.Tensor]] = [[] for _ in variants]
    baseline, how = [], {"replay": set(), "batch_size": set()}
    for wi, w in enumerate(wins):
        clean = cleans[wi] if cleans is not None else clean_pass(model, tokens, w)
        if on_clean:
            on_clean(clean)
        baseline.append(clean.nll.double().cpu())
        plain = plain_blocks(model, clean)
        size = batch_size or default_batch_size(model, w.end - w.begin, plain is not None)
        how["replay"].add("bridge" if plain is None else "plain")
        how["batch_size"].add(size)
        for group in _groups(variants, size):
            with torch.inference_mode(), applied(model, variants[group[0]].hooks):
                entries = [(variants[i].layer, variants[i].mid, variants[i].resid(clean))
                           for i in group]
                rows = run_group(model, clean, entries, plain)
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
    df = with_change(records)
    df.attrs["engine"] = {"replay": "+".join(sorted(how["replay"], reverse=True)),
                          "batch_size": max(how["batch_size"])}
    return df


def _groups(variants: Sequence[Start], size: int) -> list[list[int]]:
    """Consecutive variants without hooks in batches of `size`; one with hooks alone."""
    groups: list[list[int]] = []
    for i, v in enumerate(variants):
        last = variants[groups[-1][0]] if groups else None
        if last is not None and not v.hooks and not last.hooks and len(groups[-1]) < size:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def heads_removed(model, layer: int, keep: torch.Tensor, fill: torch.Tensor | None) -> Callable:
    """Residual after layer `layer`'s attention with heads scaled by `keep` (n_heads,), the
    removed part replaced by `fill` (n_heads, d_head): mid - sum_h (1-keep_h)(z_h-fill_h) W_O[h]."""

    idx = (keep != 1).nonzero().flatten()  # only the changed heads: the rest add zero

    def resid(clean: Clean) -> torch.Tensor:
        z = clean.z[layer][0][:, idx]  # (T, k, d_head)
        W_O = model.blocks[layer].attn.W_O[idx]  # (k, d_head, d_model)
        gone = (1 - keep[idx]).to(z)  # (k,)
        diff = (fill[idx].to(z) if fill is not None else 0) - z  # (T, k, d_head)
        delta = torch.einsum("h,thd,hde->te", gone, diff, W_O.to(z))  # (T, d_model)
        return clean.mid[layer] + delta

    return resid
