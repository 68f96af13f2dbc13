"""What each removal does to the residual stream, read through a linear readout: the
sweep behind `ablate --decompose`.

For a window, a `Reader` r (built from the clean run's final residual, the positions that
predict the scored tokens and those tokens: a linear map of a stream point to one value per
scored token, and `final`, the metric of a final residual)
reads, for the clean run and for each variant (one removal each):

- `stream` (n_layers + 1, n_scored): r of every block's input and of the final residual;
- `change` (n_scored,): r of what the removed component writes, variant minus clean (for a
  skipped block, its output);
- `final` (n_scored,): the reader's metric of the final residual (its own norm scale);
- `logit` (n_scored,): the correct token's centred logit: from the model's own logits in
  the naive loop, from `final` and the unembedding's linear map in the cached engine (the
  self-check holds the two together).

Two engines give the same reads:
- naive: one hooked forward per variant, each block's input captured as it goes by;
- cached: each variant from the block it changes (`entries.start`), batched through the
  engine's one loop (`engine.run_group`), the reader applied to every block's output as the
  batch passes it. Before a window counts, the first variant of each entry kind is held to
  the naive reads; a mismatch beyond float32 rounding sends every variant to the naive loop,
  and `how["fallback"]` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from blockscope.interventions import applied, component, hooks
from blockscope.model import arch
from blockscope.sweeps import engine, selfcheck, steps
from blockscope.sweeps.clean import Clean, clean_pass, kept_names
from blockscope.sweeps.entries import start
from blockscope.sweeps.how import Engine, Fallback, How, fell_back, not_tried
from blockscope.sweeps.variant import Variant

KINDS = ("block", "half", "mlp", "attn")  # the entries a single removal takes


class Reader(Protocol):
    rows: torch.Tensor  # (n_scored,) the positions predicting the scored tokens
    offset: torch.Tensor  # (n_scored,) float64: centred logit = final(h) + offset, where the
    #   logits are the unembedding's linear map of the final norm's output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """r(x) (..., n_scored) float64 of stream points x (..., T, d_model)."""

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The metric (n_scored,) float64 of a final residual x (T, d_model)."""


def reads(model, ids: torch.Tensor, w, variants: Sequence[Variant],
          reader: Callable[..., Reader], *, engine_name: str = "cached",
          clean: Clean | None = None, batch_size: int | None = None,
          progress: Callable[[], None] | None = None) -> tuple[dict, list[dict], dict]:
    """(the clean run's reads, each variant's, how it ran) for window `w` of `ids` (1, pos).
    `reader(h, rows, targets)` builds the readout from the clean run's final residual h
    (T, d_model), the positions predicting the scored tokens (n_scored,) and those tokens;
    `clean`: this window's clean pass, if at hand (cached); `progress()` is called as each
    variant is read (a fallback's naive reads are not counted again)."""
    chunk = ids[:, w.begin : w.end].to(model.cfg.device)
    targets = chunk[0, w.offset:]
    rows = torch.arange(w.offset - 1, chunk.shape[-1] - 1, device=chunk.device)

    def made(h):
        return reader(h, rows, targets)

    got, how = Engine(engine_name).run(
        lambda: (_cached(model, ids, w, chunk, targets, variants, made, clean, batch_size,
                         progress), How().record()),
        lambda how: _naive(model, chunk, targets, variants, made,  # a fallback's reads are
                           progress=None if how.fallback else progress))  # not counted again
    return (*got, how)


def _site(e) -> str | None:
    """Where a removal's write is captured: a half's hook point; None for a skipped block,
    whose output is the next block's input."""
    return None if component(e) == "block" else e.site.name


def _naive(model, chunk, targets, variants, reader, base: tuple | None = None,
           progress: Callable[[], None] | None = None):
    """Reads by one hooked forward per variant (the reference), the centred logit from the
    model's own logits. `base`: (the clean forward's kept points, its reader), if at hand;
    `progress()` after each variant."""
    sites = sorted({_site(e) for v in variants for e in v.edits} - {None})
    if base is None:
        run = _forward(model, chunk, (), sites)
        r = reader(run["stream"][-1])
        base = (run, r)
    run0, r = base
    clean = _read(r, run0, targets)
    out = []
    for v in variants:
        run = _forward(model, chunk, v.edits, sites)
        got = _read(r, run, targets)
        (e,) = v.edits
        if _site(e) is not None:  # a half's write, captured where the edit wrote it
            got["change"] = r(run["acts"][_site(e)] - run0["acts"][_site(e)])
        else:  # a skipped block: its output, which the next block receives
            k = e.site.layer
            got["change"] = got["stream"][k + 1] - clean["stream"][k + 1]
        out.append(got)
        if progress is not None:
            progress()
    return clean, out


def _forward(model, chunk, edits, sites: Sequence[str]) -> dict:
    """One forward with `edits`' hooks: each block's input and the final residual (n + 1 of
    (T, d_model)), the activations at `sites` (as edited), the logits (T, d_vocab)."""
    n = model.cfg.n_layers
    names = [f"blocks.{j}.hook_resid_pre" for j in range(n)] + ["ln_final.hook_in", *sites]
    kept: dict = {}

    def keep(name):
        def hook(act, hook=None):
            kept[name] = act[0].detach()

        return hook

    with torch.inference_mode(), applied(model, hooks(edits) + [(m, keep(m)) for m in names]):
        logits = model(chunk, return_type="logits")[0]
    stream = [kept[f"blocks.{j}.hook_resid_pre"] for j in range(n)] + [kept["ln_final.hook_in"]]
    return {"stream": stream, "acts": {s: kept[s] for s in sites}, "logits": logits}


def _read(r: Reader, run: dict, targets) -> dict:
    """The reads of a run (its stream, and the metric `Readings`: from the model's own logits
    where the run kept them, else from its final residual)."""
    metric = Readings(r, targets)
    with torch.inference_mode():
        stream = torch.stack(run["stream"])  # (n + 1, T, d_model)
        if run.get("logits") is not None:  # the model's own, at the scored positions
            got = metric.of_logits(stream[-1], run["logits"])
        else:
            got = metric.of_final(stream[-1])
        return {"stream": r(stream), **got}


def _cached(model, ids, w, chunk, targets, variants, reader, clean, batch_size,
            progress=None):
    """(the clean reads, each variant's) by the engine; raises `how.Fallback` (`why_naive`)
    where the engine has no entry for them, or (`fallback`) where it fails its self-check."""
    lay = arch.layout(model)
    n = model.cfg.n_layers
    starts = [start(model, lay, v) for v in variants]
    if any(s.hooks or s.skips or s.base or s.kind not in KINDS for s in starts):
        raise Fallback(How("naive", why_naive=not_tried(
            "these removals here (a hook sits in a block, or the layout's half writes cannot "
            "be entered)")))
    sites = sorted({_site(v.edits[0]) for v in variants} - {None})
    if clean is None or any(name not in clean.acts for name in sites):
        clean = clean_pass(model, ids, w, {*kept_names(lay, n, z=False), *sites})
    plain = selfcheck.verify(model, lay, clean, starts, steps.plain_parts(model))  # or raises
    r = reader(clean.pre[-1][0])
    kept = {"stream": [p[0] for p in clean.pre], "acts": {s: clean.acts[s][0] for s in sites}}
    with torch.inference_mode():
        base = _read(r, kept, targets)
        out = _resumed(model, lay, clean, starts, Readings(r, targets), base, plain,
                       batch_size, progress)
    firsts: dict = {}
    for i, s in enumerate(starts):
        firsts.setdefault(s.kind, i)
    idx = sorted(firsts.values())  # the first variant of each kind, by one hooked forward
    _, want = _naive(model, chunk, targets, [variants[i] for i in idx], reader, (kept, r))
    tol = 10 * selfcheck.tolerance(clean.pre[0].dtype)
    for i, ref in zip(idx, want, strict=True):
        scale = max(1.0, float(ref["logit"].abs().max()), float(ref["stream"].abs().max()))
        for key in ("stream", "change", "final", "logit"):
            off = float((out[i][key] - ref[key]).abs().max()) / scale
            if off > tol:
                raise Fallback(How("naive", fallback=fell_back(
                    f"variant {variants[i].label}'s {key} is {off:.1e} off the naive "
                    "loop's")))
    return base, out


def _resumed(model, lay, clean: Clean, starts, metric: Readings, base: dict, plain,
             batch_size: int | None, progress=None) -> list[dict]:
    """Each variant's reads, batched through the engine's loop from where it departs, the
    stream read by the metric's reader as it goes by (`progress()` once per variant, as its
    batch finishes)."""
    r = metric.r
    size = 1 if plain is None else (  # through the bridge's blocks: one at a time
        batch_size or engine.default_batch_size(model, clean.pre[0].shape[1], True))
    out: list = [None] * len(starts)
    for lo in range(0, len(starts), size):
        group = list(range(lo, min(len(starts), lo + size)))
        streams = {}
        for i in group:
            s = starts[i]
            x = s.resid(clean)  # (1, T, d_model)
            at = clean.act("hook_resid_mid", s.layer) if s.mid else clean.pre[s.layer]
            stream = base["stream"].clone()  # (n + 1, n_scored): the clean reads before
            if not s.mid:
                stream[s.layer] = r(x[0])
            streams[i] = (x, stream, r(x[0]) - r(at[0]))

        def watch(j, x, order, group=group, streams=streams):  # x (B, T, d_model): what
            for i, value in zip(order, r(x), strict=True):  # block j + 1 receives
                streams[group[i]][1][j + 1] = value

        entries = [(starts[i].layer, starts[i].mid, streams[i][0]) for i in group]
        scored = engine.run_group(model, lay, clean, entries, plain, metric=metric,
                                  watch=watch)
        for k, i in enumerate(group):
            out[i] = {"stream": streams[i][1], "change": streams[i][2], **scored[k]}
            if progress is not None:
                progress()
    return out


class Readings:
    """`--decompose`'s metric of a run, read by both loops: the reader's `final` (n_scored,)
    and the correct token's centred logit (n_scored,), off the final residual by the cached
    engine (`from_final`: the logit is linear in the final norm's output, `Reader.offset`),
    and off the model's own logits by the naive loop (`of_logits`)."""

    def __init__(self, r: Reader, targets: torch.Tensor):
        self.r, self.targets = r, targets  # targets (n_scored,): the scored tokens

    def of_final(self, x: torch.Tensor) -> dict:
        """The readings of one final residual x (T, d_model)."""
        f = self.r.final(x)
        return {"final": f, "logit": f + self.r.offset}

    def of_logits(self, x: torch.Tensor, logits: torch.Tensor) -> dict:
        """The readings of one final residual x (T, d_model), the centred logit from the
        model's own logits (T, d_vocab) at the scored positions."""
        z = logits[self.r.rows].double()  # (n_scored, d_vocab)
        return {"final": self.r.final(x),
                "logit": z.gather(-1, self.targets[:, None])[:, 0] - z.mean(-1)}

    def from_final(self, model, x: torch.Tensor) -> list[dict]:
        """One dict per row of x (B, T, d_model)."""
        return [self.of_final(x[b]) for b in range(x.shape[0])]

