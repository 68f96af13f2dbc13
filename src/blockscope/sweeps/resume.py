"""The position-limited resume: each variant from the first block and position it changes.

A variant whose edits start at block l (its `stage`: a block's output is the next block's
input) and position p (or the metric's position, where that comes first) runs blocks l.. at
positions p.. only, in plain torch calls
(`replay`, `replay_rotary`), attending to the base run's own keys and values at the
positions before p (the model is causal: nothing there changed). Variants of one start
position share a batch that grows block by block as they join it, through the one resume
loop (`loop.resume`) that the removal sweeps run through too.

Before any variant counts, the base run is replayed from the embeddings and held to the
bridge's pass, and the first variant of each kind to the naive loop; a mismatch beyond
float32 rounding means every variant runs naive, and `how["fallback"]` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from blockscope.interventions import Site
from blockscope.sweeps import engine, kept_attention, loop, replay, selfcheck, steps, unembed
from blockscope.sweeps.how import Fallback, How, fell_back, not_tried
from blockscope.sweeps.metrics import position_of
from blockscope.sweeps.variant import Variant

INSIDE = ("hook_resid_pre", "attn.hook_attn_scores", "attn.hook_z", "hook_attn_out",
          "hook_resid_mid", "hook_mlp_out")  # the sites a block step writes, in order


def stage(site: Site) -> int:
    """The block whose step writes or passes `site` (a block's output is written as the next
    block's input is read)."""
    return site.layer + 1 if site.point == "hook_resid_post" else site.layer


def _sites(e) -> list[Site]:
    """The sites edit `e` writes and reads in its own run (a skipped block's input)."""
    return [e.site, *([e.source] if isinstance(e.source, Site) else [])]


def entry(v: Variant) -> tuple[int, int]:
    """(block, position) the variant resumes at: the first block and position it changes
    or reads in its own run."""
    sites = [s for e in v.edits for s in _sites(e)]
    return min(stage(s) for s in sites), min(s.first for s in sites)


def kind(v: Variant) -> tuple:
    """What makes two variants' resumes differ in form, for the self-check: the sites they
    write, and the interventions' classes there."""
    return tuple(sorted({(e.site.point, type(e.intervention).__qualname__) for e in v.edits}))


def unsupported(model, plain, variants: Sequence[Variant]) -> str | None:
    """Why the cached engine cannot run these variants, or None."""
    if plain is None:
        return "this family has no plain replay"
    for v in variants:
        if not v.edits:
            return "a variant without edits"
        if v.order is not None:
            return "a variant with a block order"
        for e in v.edits:
            for s in _sites(e):
                if s.point == "mlp.hook_post":
                    return "an edit at mlp.hook_post (inside the MLP)"
                if s.point == "hook_embed" and s is not e.site:
                    return "an edit reading hook_embed of its own run"
            if isinstance(e.source, Site) and stage(e.source) > stage(e.site):
                return f"an edit at {e.site.name} reading the later {e.source.name}"
            if e.site.point == "hook_embed":
                return "an edit at hook_embed (before the position embeddings)"
            if e.site.point in ("attn.hook_q", "attn.hook_k", "attn.hook_v"):
                return f"an edit at {e.site.point} (inside the attention)"
            if e.site.point == "hook_resid_mid" and plain[e.site.layer].parallel:
                return "hook_resid_mid in a parallel block"
    return None


def cached(model, base, kept, variants: Sequence[Variant], sources: dict, metric,
           naive_logits: Callable, *, batch_size: int | None = None,
           progress: Callable | None = None):
    """Each variant's metric (S,) by the position-limited resume, and how it ran; raises
    `how.Fallback` where the engine cannot run them or its self-check fails.
    `naive_logits(variant)`: the naive loop's logits, that the first of each kind is held to."""
    plain = steps.plain_parts(model)
    why = unsupported(model, plain, variants)
    if why is not None:
        raise Fallback(How("naive", why_naive=not_tried(why)))
    T = kept.pre[0].shape[1]
    r = Resume(model, plain, kept, sources, base.samples, position_of(metric, T))
    tol = 10 * selfcheck.tolerance(kept.pre[0].dtype)
    with torch.inference_mode(), steps.fused_gelu(model):
        off = selfcheck._rel(r.replayed(), kept.pre[-1])
        if off > tol:
            raise _fallback(f"the replay of the base run is {off:.1e} off")
        firsts = {}
        for i, v in enumerate(variants):
            firsts.setdefault(kind(v), i)
        out: list = [None] * len(variants)
        work = 0
        for group in _groups(variants, r.start, r.max_rows(variants, batch_size)):
            logits, rows = r.run([variants[i] for i in group])
            for i, idx in zip(group, rows, strict=True):
                lg = logits[idx]  # (S, d_vocab): a view
                out[i] = metric(lg).cpu()  # a variant at a time: its rows stay in cache
                if i in firsts.values():
                    off = selfcheck._rel(lg, naive_logits(variants[i]))
                    if off > tol:
                        raise _fallback(f"variant {variants[i].label} is {off:.1e} off "
                                        "the naive loop's")
                if progress:
                    progress()
            work += sum(r.work(variants[i]) for i in group)
    n = len(plain)
    return out, How("cached", batch_size=r.max_rows(variants, batch_size), block_positions=work,
                    naive_block_positions=len(variants) * base.samples * n * T).record()


def _fallback(why: str) -> Fallback:
    return Fallback(How("naive", fallback=fell_back(why)))


def _groups(variants: Sequence[Variant], start: Callable[[Variant], int],
            size: int) -> list[list[int]]:
    """Variants of one start position (`start(v)`) together, in batches of at most `size`."""
    by: dict[int, list[int]] = {}
    for i, v in enumerate(variants):
        by.setdefault(start(v), []).append(i)
    return [idx[k : k + size] for _, idx in sorted(by.items()) for k in range(0, len(idx), size)]


class Resume:
    """The base run kept (block inputs, keys and values) and its replay from any block and
    position, with variants' edits carried out as the stream goes by, to the logits at
    `position` (0..T-1: the metric's)."""

    def __init__(self, model, plain: list, kept, sources: dict, samples: int, position: int):
        self.model, self.plain, self.kept = model, plain, kept
        self.sources, self.samples, self.position = sources, samples, position
        self.args = kept.block_args
        self._logits = self._zero_bias = None  # `last_logits`'s buffer, and its bias
        for p in plain:  # this sweep's own Parts: q/k/v and gate/up as one product each
            replay.join_products(p)
        with torch.inference_mode():  # each block's keys and values, (S, n_kv, T, d_head)
            self.kv = [p.project(p.attn_norm(x), self.args[j], 0)[1:]
                       for j, (p, x) in enumerate(zip(plain, kept.pre, strict=False))]

    def max_rows(self, variants: Sequence[Variant], batch_size: int | None) -> int:
        """Variants per batch: `batch_size`, or as many as keep a batch near the engine's
        activation budget: a row's block activations, and its logits (held for the sweep:
        `last_logits`)."""
        if batch_size:
            return batch_size
        cfg, T = self.model.cfg, self.kept.pre[0].shape[1]
        per_row = engine.row_bytes(cfg, T) + 4 * cfg.d_vocab
        return max(1, min(256, engine.BUDGET_BYTES // max(1, per_row * self.samples)))

    def start(self, v: Variant) -> int:
        """The first position the variant's replay computes: the first it changes, or the
        metric's position if that comes before (the metric reads it as the variant left
        it, and the variant leaves the positions before its first change as they were)."""
        return min(entry(v)[1], self.position)

    def work(self, v: Variant) -> int:
        """Block-positions the variant runs: samples x blocks x positions."""
        layer = entry(v)[0]
        return self.samples * (len(self.plain) - layer) * (self.kept.pre[0].shape[1]
                                                          - self.start(v))

    def replayed(self) -> torch.Tensor:
        """The base run replayed from the embeddings: its final residual (S, T, d_model)."""
        def entering(j, mid, keys):
            if (j, mid) != (0, False):
                return None
            return [(s, s) for s in range(self.samples)], self.kept.pre[0].clone()

        def unchanged(point, act):
            return act

        unchanged.knocks = lambda j: False
        x, _ = loop.resume(len(self.plain), 0, entering,
                           lambda j, x, keys, mid: self.block(j, x, 0, keys, unchanged))
        return x

    def run(self, variants: Sequence[Variant]) -> tuple[torch.Tensor, list]:
        """The logits (B, d_vocab) at `position` of every row (in a buffer the next call
        overwrites: `last_logits`), and each variant's rows (a slice: its S samples,
        consecutive as they join), for variants of one start position, through the one
        resume loop (`loop.resume`): rows (variant, sample) join at the variant's first
        changed block, from the base run's input to it at positions start..; its edits are
        written by the blocks as the stream goes by."""
        start = self.start(variants[0])
        firsts = [entry(v)[0] for v in variants]
        todo: dict = {}  # (block step, point) -> [(edit, its variant's first row)]
        reads: dict = {}  # (block step, point) -> name: the sites edits read in their run
        own: dict = {}  # name -> the batch's activation there, as it passed
        rows: list = [None] * len(variants)  # each variant's rows, as its edits write them

        def entering(j, mid, keys):
            joining = [i for i, e in enumerate(firsts) if e == j and not mid]
            if not joining:
                return None
            new: list = []  # (variant, sample) of each joining row
            for i in joining:
                first = len(keys) + len(new)  # its samples' rows: first, first + 1, ...
                new += [(i, s) for s in range(self.samples)]
                rows[i] = slice(first, first + self.samples)
                for e in variants[i].edits:
                    todo.setdefault((stage(e.site), e.site.point), []).append((e, first))
                    if isinstance(e.source, Site):
                        reads[stage(e.source), e.source.point] = e.source.name
            return new, self.kept.pre[j][:, start:].repeat(len(joining), 1, 1)  # (k S, Tq, d)

        def edits(j):
            def edit(point, act):
                for e, first in todo.get((j, point), ()):
                    e.write(act, first, self.samples, start, self.sources, own)
                if (j, point) in reads:  # kept as it passed, whatever later writes in place
                    own[reads[j, point]] = act.clone()
                return act

            edit.knocks = lambda j: (j, "attn.hook_attn_scores") in todo
            return edit

        def step(j, x, keys, mid):  # nothing enters mid-block: edits say where they write
            edit = edits(j)
            return self.block(j, edit("hook_resid_post", x), start, keys, edit)

        n = len(self.plain)
        x, _ = loop.resume(n, min(firsts), entering, step)
        x = edits(n)("hook_resid_post", x)  # the last block's output
        at = self.position - start
        final = x[:, at : at + 1]  # (B, 1, d_model): the position the metric reads
        return self.last_logits(self.model.ln_final(final)[:, 0]), rows

    def last_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The logits (B, d_vocab) of the normed final residuals h (B, d_model). Where the
        unembedding is a plain unhooked Linear, its product is written into one buffer held
        for the sweep: a fresh (B, d_vocab) output, 177 MB for 900 rows of smollm2-135m, took
        fresh pages from the system at every batch and its bias copy ran at a tenth of the
        copy bandwidth. A bias of zeros (the bridge's, where the checkpoint has none) is not
        added. Else the bridge's own call, hooks and all."""
        linear = unembed.linear_of(self.model)
        if linear is None:
            return self.model.unembed(h[:, None])[:, 0].float()
        if self._logits is None or self._logits.shape[0] < h.shape[0]:
            self._logits = h.new_empty(h.shape[0], linear.out_features)
        out = self._logits[: h.shape[0]]
        if self._zero_bias is None:
            self._zero_bias = linear.bias is None or not bool(linear.bias.any())
        if self._zero_bias:
            return torch.mm(h, linear.weight.t(), out=out).float()
        return torch.addmm(linear.bias, h, linear.weight.t(), out=out).float()

    def block(self, j: int, x: torch.Tensor, start: int, rows, edit) -> torch.Tensor:
        """Block j on the stream x (B, Tq, d_model) at positions start.., the base run's
        keys and values before; `edit(point, act)` writes the variants' edits."""
        p, ctx = self.plain[j], self.args[j]
        x = edit("hook_resid_pre", x)
        samples = torch.tensor([s for _, s in rows], device=x.device)
        kept = [t[samples, :, :start] for t in self.kv[j]]  # (B, n_kv, start, d_head)
        over = kept_attention.OverKept(p, kept, start, j, edit)
        a = edit("hook_attn_out", replay.attn_write(over, x, ctx))  # (B, Tq, d_model)
        if p.parallel:  # the sums in the outputs of attention and the MLP, fresh here
            return a.add_(x).add_(edit("hook_mlp_out", p.mlp_write(x)))
        mid = edit("hook_resid_mid", a.add_(x))
        return edit("hook_mlp_out", p.mlp_write(mid)).add_(mid)
