"""The sweep engine: one clean pass, then every variant only from where it first differs.

The clean pass of each window keeps each block's input residual (`hook_resid_pre`), the
points the layout has between (mid residual, or each half's write in a parallel block), each
head's `z` when asked, and the arguments the model hands each block (mask, positions). The
variants are `variant.Variant`s: records of interventions, the same ones the naive loop
turns into hooks. `entries.start` derives from an edit and the architecture layer (`arch.py`)
where to enter the stack:

- skipping block k: at block k+1 from its cached input (+ its mean contribution);
- removing an MLP: at block k+1 from the output without that write;
- removing an attention half: at k's MLP half (sequential) or k+1 (parallel);
- removing heads of one layer whose writes are linear in the stream: subtract
  sum_h (1-keep_h)(z_h-fill_h) W_O[h] from the cached stream, entering as for its half;
- skipping several blocks: after the first, its later blocks skipped on the way (rows of
  the batch sit those blocks out); blocks every variant of the sweep skips run once per
  window as the model without them (`pruned`), and each variant enters from there;
- anything else (several layers, a post-norm head, a block a user's hook sits in): at the
  first block it touches, with the edit's own hooks on.

Before any variant of a window runs, `selfcheck.verify` replays the clean pass from every
entry kind the sweep will use, on one block of each kind; a mismatch beyond 1e-5 relative
raises `ReplayMismatch`, and `scoring.run` then scores every variant with the naive loop instead
and says why in `attrs["engine"]`. A block that holds a hook runs as the TransformerLens bridge
block, so its hook points fire; GPT-2 blocks without hooks run as plain torch calls
(`replay.py`) once those match the clean pass too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from blockscope.inputs.text import Window
from blockscope.interventions import Hook, applied
from blockscope.sweeps import loop, replay, steps
from blockscope.sweeps.clean import Clean, clean_pass, kept_names
from blockscope.sweeps.how import How
from blockscope.sweeps.metrics import NllKl

# A batch's block activations (`row_bytes` a row) are kept near this, by both engines.
BUDGET_BYTES = 768 * 2**20  # activations of one batch, so GPT-2 small stays under 3 GB RSS


@dataclass
class Start:
    """One variant as the engine runs it: the residual it enters the stack with, where,
    and any hooks."""

    label: dict  # columns of its result row
    layer: int  # first block to run (n_layers: straight to the unembedding)
    resid: Callable[[Clean], torch.Tensor]  # (1, T, d_model) residual entering there
    mid: bool = False  # enter block `layer` after its attention half (run only its MLP half)
    hooks: list[Hook] = field(default_factory=list)
    relies_on: str | None = None  # an identity the entry assumes, for selfcheck: "heads"
    #   (a layer's attention write = sum_h z_h W_O[h] + b_O) or "halves" (a parallel
    #   block's output = input + attention write + MLP write)
    kind: str = "hooked"  # the entry's form ("block", "blocks", "half", "mlp", "attn",
    #   "heads", "hooked"): selfcheck.check_variants holds the first of each to the hooked model
    skips: dict = field(default_factory=dict)  # layer -> Skip: later blocks this variant
    #   also skips (several blocks removed at once)
    base: tuple = ()  # skip_block edits the variant shares with the others of its sweep: `resid`
    #   reads the pass of the model without them (`pruned`), computed once per window
    with_plain: bool = False  # `resid(clean, plain)` runs blocks itself (a rearrangement)


def run_group(model, lay, clean: Clean, entries: Sequence[tuple], plain: list | None = None,
              metric=None, watch: Callable | None = None) -> list:
    """Score rows for variants entering the stack at `(layer, mid, x[, skips])`: block
    `layer` (its MLP half if `mid`) with residual x (1, T, d_model), then skipping the
    blocks in `skips` (layer -> Skip). They run through the one resume loop
    (`loop.resume`) as one batch that grows block by block as variants join it, then the
    metric reads the final residuals.

    metric: a `metrics` class, read off the final residuals x (B, T, d_model) by its
    `from_final` (default `NllKl`: per scored token, the NLL and the KL from the clean
    distribution).
    watch(j, x, order): called with every block's output, x (B, T, d_model) = what block
    j+1 receives, row r being entry order[r]."""
    skips = [e[3] if len(e) > 3 else {} for e in entries]

    def entering(j, mid, keys):
        idx = [i for i, e in enumerate(entries) if (e[0], e[1]) == (j, mid)]
        return (idx, torch.cat([entries[i][2] for i in idx])) if idx else None

    def step(j, x, keys, mid):
        if plain is not None and not replay.hooked(model.blocks[j]):
            p, ctx = plain[j], clean.block_args[j]
            if p.parallel:  # no mid point: nothing joins there
                return None if x is None else replay.block_forward(p, x, ctx)
            x = _cat(None if x is None else replay.attn_half(p, x, ctx), mid())
            return None if x is None else replay.mlp_half(p, x)
        if x is not None:
            x = steps.block_step(model, clean, j, x, None)
        m = mid()  # entering after attention: the MLP half only
        return _cat(x, None if m is None else steps.mlp_step(model, lay, j, m, None))

    with steps.fused_gelu(model):
        x, order = loop.resume(len(model.blocks), min(e[0] for e in entries), entering, step,
                               skipping=lambda i, j: skips[i].get(j), watch=watch)
        scored = (metric or NllKl(clean, lay.softcap)).from_final(model, x)
    rows: list = [None] * len(entries)
    for i, row in zip(order, scored, strict=True):
        rows[i] = row
    return rows


def _cat(x, new):
    """The batch x with the rows `new` at its end (either may be None)."""
    return new if x is None else x if new is None else torch.cat([x, new])


CPU_BATCH = 6  # variants per batch on the CPU with the plain replay (see benchmarks/)


def row_bytes(cfg, n_tokens: int) -> int:
    """One batch row's block activations over `n_tokens` positions, beyond the stream, in
    float32 bytes: attention scores, pattern and softmax scratch (3 n_heads T per position),
    the MLP's hidden activation twice, and q/k/v/z and the residuals (6 d_model)."""
    return 4 * n_tokens * (3 * cfg.n_heads * n_tokens + 2 * cfg.d_mlp + 6 * cfg.d_model)


def default_batch_size(model, n_tokens: int, plain: bool = False) -> int:
    """Variants per batch. On the CPU: CPU_BATCH with the plain replay (faster than one at a
    time), 1 through the bridge's blocks (where stacking is slower: both in docs/performance.md's
    "Design choices, measured"). Elsewhere: as many as keep one batch's activations near
    BUDGET_BYTES; never more than that on the CPU either."""
    cfg = model.cfg
    budget = max(1, min(16, BUDGET_BYTES // max(1, row_bytes(cfg, n_tokens))))
    if str(getattr(cfg, "device", "cpu")).startswith("cpu"):
        return min(budget, CPU_BATCH) if plain else 1
    return budget


def engine_nlls(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Start],
    *,
    wins: Sequence[Window],
    cleans: Sequence[Clean] | None = None,
    names: Sequence[str] = (),
    batch_size: int | None = None,
    progress=None,
) -> tuple[list[torch.Tensor], dict]:
    """Per-token scores `(2, n_scored)` float64 (row 0 the NLL, row 1 the KL divergence from
    the clean distribution: `unembed.final_nll`) of the clean pass, then of each variant,
    and how they ran: the batch size and the blocks replayed ("plain", "bridge" or "plain+bridge").

    Each window's clean pass (kept hook points: `names`) is checked by `selfcheck.verify`
    first (`ReplayMismatch` if the replay does not reproduce it)."""
    from blockscope.model import arch
    from blockscope.sweeps import selfcheck

    lay = arch.layout(model)
    if progress:
        progress(total=len(variants) * len(wins) + 1)
    nlls: list[list[torch.Tensor]] = [[] for _ in variants]
    baseline, how = [], {"replay": set(), "batch_size": set()}
    for wi, w in enumerate(wins):
        clean = cleans[wi] if cleans is not None else clean_pass(
            model, tokens, w, [*kept_names(lay, len(model.blocks), z=False), *names])
        base = clean.nll.double().cpu()
        baseline.append(torch.stack([base, torch.zeros_like(base)]))
        plain = selfcheck.verify(model, lay, clean, variants, steps.plain_parts(model))
        size = (batch_size or default_batch_size(model, w.end - w.begin, True)) if plain else 1
        how["replay"].add("bridge" if plain is None else "plain")
        how["batch_size"].add(size)
        for group in _groups(variants, size):
            with torch.inference_mode(), applied(model, variants[group[0]].hooks):
                entries = [(variants[i].layer, variants[i].mid,
                            _entering(variants[i], pruned(model, clean, variants[i].base,
                                                          plain), plain),
                            variants[i].skips) for i in group]
                rows = run_group(model, lay, clean, entries, plain)
            for i, row in zip(group, rows, strict=True):
                nlls[i].append(row)
            if progress:
                for _ in group:
                    progress()
    if progress:
        progress()
    return [torch.cat(baseline, 1)] + [torch.cat(n, 1) for n in nlls], How(
        "cached", "+".join(sorted(how["replay"], reverse=True)),
        max(how["batch_size"])).record()


def _entering(v: Start, clean: Clean, plain) -> torch.Tensor:
    """The residual variant `v` enters with (its blocks run plainly where it runs any)."""
    return v.resid(clean, plain) if v.with_plain else v.resid(clean)


def pruned(model, clean: Clean, base: tuple, plain) -> Clean:
    """`clean` as the model without the blocks `base` skips (skip_block edits) would have run it:
    `pre` holds that model's block inputs (the rest is the clean pass's). Computed once per
    window and base (kept on `clean`), from the first skipped block on; `clean` if no base."""
    if not base:
        return clean
    held = clean.views.get("pruned")  # (base, plain?, view) of the last base asked for
    if held is not None and len(held[0]) == len(base) and held[1] == (plain is not None) and all(
            a == b for a, b in zip(held[0], base, strict=True)):
        return held[2]
    skip = {e.site.layer: e.intervention for e in base}
    lo = min(skip)
    pre = list(clean.pre)

    def keep(j, x, keys):  # what block j+1 receives
        pre[j + 1] = x

    with torch.inference_mode(), steps.fused_gelu(model):  # one row, through the one loop
        loop.resume(len(model.blocks), lo,
                    lambda j, mid, keys: ([0], clean.pre[lo]) if (j, mid) == (lo, False) else None,
                    lambda j, x, keys, mid: None if x is None else steps.block_step(
                        model, clean, j, x, plain),
                    skipping=lambda k, j: skip.get(j), watch=keep)
    view = dataclasses.replace(clean, pre=pre, raw={}, checked={}, views={})
    clean.views["pruned"] = (base, plain is not None, view)
    return view


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
