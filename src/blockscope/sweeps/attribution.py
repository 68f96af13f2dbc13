"""Attribution patching: every patch variant's effect on the metric estimated from gradients,
in a few passes instead of one forward per variant.

A variant writes `apply(base, source)` at each edit's site (`patch` writes the clean run's
activation into the corrupted run: `Patch`). Its effect on the metric M is estimated to first
order, at each edit's selected values a (its positions, and head):

    estimate = sum over edits of  (apply(a_base, source) - a_base) . g

which for a patch is (a_source - a_base) . g. An intervention that declares `elementwise`
(each value written from its own base and source value alone, as `Patch` and `AddNoise`)
with a named source run is applied once to the whole site and each variant reads its
selection; any other is applied to each edit's own selection.

- `atp` (attribution patching, Nanda 2023): g = dM/da on the base run itself. Two forwards
  (the source run; the base run) and one backward.
- `ig` (integrated gradients along the input, as EAP-IG takes them: Hanna et al. 2024):
  g is the mean of dM/da over m points of the straight path from the base run to the
  source run, interpolated at block 0's input: alpha = k/m for k = 0..m-1 (the left Riemann
  sum, so that one step is AtP). Summed over every position of block 0's input, the
  estimates tend to M(source) - M(base) as m grows (completeness).
- `atp-star` (AtP*, Kramar et al. 2024), AtP with its two fixes:
  - the QK fix (`qk_fix`): a variant that writes a block's queries or keys (every position,
    one head) changes that block's attention pattern A nonlinearly, through the softmax.
    The patched pattern is computed exactly (the model's own attention), and only what
    follows it is linearised: estimate = (A_patched - A) . dM/dA;
  - GradDrop: for each block l, the estimates with no gradient through block l's writes to
    the residual stream (its attention and MLP outputs detached: the gradient passes block
    l by the skip connection alone, and a site of block l's own gets none); `bound` is the
    sum of the L absolute estimates over L - 1 (the paper's mean: each head's or MLP's own
    block gives 0), a bound against cancellation, not a signed effect. It needs two
    blocks or more.

The gradient is read at a `Probe` at each site: base + 0, the 0 a leaf autograd
differentiates M by, so that the model's own forward, hooks and all, gives dM/da. Only the
probes' gradients are asked for (`torch.autograd.grad`), none of the weights'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from blockscope.errors import BlockscopeError
from blockscope.interventions import applied, hooks
from blockscope.interventions.interchange import Edit, Patch, Site
from blockscope.sweeps import qk_fix
from blockscope.sweeps.interchange import Run, capture
from blockscope.sweeps.variant import Variant

METHODS = ("atp", "ig", "atp-star")
SIGN = ("estimate of M(base run with the source's activation written at the row's site) - "
        "M(base run): positive where the patch moves the metric up; the gradient is taken "
        "on the base run (the corrupted prompt), the difference points to the source run "
        "(the clean prompt)")


class Probe:
    """base + 0, the 0 a leaf of the activation's shape (batch 1: one gradient for every
    row, summed over them) that the metric is differentiated by. Holds the leaf and the
    base it was added to, as the forward passed."""

    def __init__(self):
        self.zero: torch.Tensor | None = None
        self.base: torch.Tensor | None = None

    def apply(self, base: torch.Tensor, source=None) -> torch.Tensor:
        self.base = base.detach()
        self.zero = torch.zeros_like(base[:1]).requires_grad_()
        return base + self.zero


@dataclass(frozen=True)
class Detach:
    """The activation with no gradient through it (GradDrop's dropped block write): the
    same values, the backward stops here."""

    def apply(self, base: torch.Tensor, source=None) -> torch.Tensor:
        return base.detach()


@dataclass
class Estimates:
    """Each variant's estimated change of the metric, and what the passes measured."""

    values: np.ndarray  # (V,) the estimated M(variant) - M(base)
    inert: np.ndarray  # (V,) bool: the variant writes the values already there (its
    #   sources equal the base run at every selected value), so its change is exactly 0
    base: float  # M(base run)
    sources: dict[str, float]  # M(each source run)
    how: dict = field(default_factory=dict)  # method, steps, passes, seconds
    bound: np.ndarray | None = None  # (V,) atp-star's GradDrop: the mean |estimate| with
    #   one block's gradient dropped at a time, a bound against cancellation


def metric_of(metric, logits: torch.Tensor) -> torch.Tensor:
    """The metric's values (B,) at the last position's logits (B, d_vocab): one column."""
    if getattr(metric, "position", -1) != -1:  # the passes unembed the last position alone
        raise ValueError(f"attribution reads the last position's logits; this metric reads "
                         f"position {metric.position}")
    values = metric(logits)
    if values.dim() != 1:
        raise ValueError("attribution needs a metric of one column, one value per row")
    return values


def gradients(model, tokens: torch.Tensor, names: Sequence[str], metric, *,
              path: tuple[torch.Tensor, torch.Tensor] | None = None, steps: int = 1,
              drop: int | None = None, rows: int = 8, patterns: Sequence[int] = ()
              ) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    """(dM/da at each hook point of `names` (1, ...) as the metric's mean over the points, M
    at the first point, the activations there as the first forward passed them (rows, ...))
    on the run of `tokens` (1, T). With `path` = (block 0's input on the base run, on the
    source run), each (1, T, d_model), block 0's input is instead each of the `steps` points
    base + alpha (source - base), alpha = k/steps for k = 0..steps-1, one per batch row,
    `rows` points a forward and backward. With `drop`, block `drop`'s attention and MLP
    writes are detached. `patterns`: blocks whose attention pattern (attn.hook_pattern,
    (n_heads, T, T) a row) is probed too, under its hook name."""
    alphas = torch.arange(steps if path is not None else 1, dtype=torch.float64) / steps
    total: dict[str, torch.Tensor] = {}
    first = None
    for chunk in alphas.split(rows):
        names_here = [*names, *[f"blocks.{j}.attn.hook_pattern" for j in patterns]]
        probes = {name: Probe() for name in names_here}
        path_edits, drop_edits = [], []
        if path is not None:
            lo, hi = path
            alpha = chunk.to(lo.dtype).to(lo.device)[:, None, None]
            path_edits.append(Edit(Site("hook_resid_pre", 0), Patch(), lo + alpha * (hi - lo)))
        if drop is not None:  # after any probe there: block `drop`'s own writes get no gradient
            drop_edits = [Edit(Site(point, drop), Detach())
                          for point in ("hook_attn_out", "hook_mlp_out")]
        # each probe a hook of its own (any hook point, an edit's site or not), after the
        # path's write at its point and before a dropped write's detach
        raw = [(name, lambda act, hook=None, p=p: p.apply(act)) for name, p in probes.items()]
        if LAST in model.hook_dict:  # the unembedding, forward and backward, at the last
            raw.append((LAST, _last))  # position alone: the metric reads no other
        batch = tokens.to(model.cfg.device).expand(len(chunk), -1)
        with torch.enable_grad(), applied(model, [*hooks(path_edits), *raw,
                                                  *hooks(drop_edits)]):
            values = metric_of(metric, model(batch, return_type="logits")[:, -1].float())
        missing = [n for n, p in probes.items() if p.zero is None]
        if missing:
            raise BlockscopeError(f"this model's forward does not pass {missing[0]}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                     else "") + ", where the gradient is read")
        leaves = [p.zero for p in probes.values()]
        grads = (torch.autograd.grad(values.sum(), leaves, allow_unused=True)
                 if values.requires_grad else [None] * len(leaves))
        for name, leaf, g in zip(probes, leaves, grads, strict=True):
            g = torch.zeros_like(leaf) if g is None else g.detach()
            total[name] = g if name not in total else total[name] + g
        if first is None:
            first = (float(values[0].detach()), {n: p.base for n, p in probes.items()})
    return {n: g / len(alphas) for n, g in total.items()}, *first


LAST = "unembed.hook_in"


def _last(act: torch.Tensor, hook=None) -> torch.Tensor:
    """The final residual at the last position only (batch, 1, d_model)."""
    return act[:, -1:]


def _check(variants: Sequence[Variant], sources: dict) -> None:
    for v in variants:
        for e in v.edits:
            if isinstance(e.source, Site):
                raise ValueError(f"variant {v.label}: an edit reading its own run "
                                 f"({e.source.name}) has no first-order estimate here")
            if isinstance(e.source, str) and e.source not in sources:
                raise ValueError(f"variant {v.label} reads run {e.source!r}, not given")


def estimate(model, base: Run, sources: dict[str, Run], variants: Sequence[Variant], metric,
             method: str = "atp", steps: int = 1, progress=None) -> Estimates:
    """Every patch variant's estimated change of `metric` (see the module), and M of the
    base and source runs. `ig` and `atp-star` need one source run (the path's end, the
    run GradDrop's estimates patch from)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}")
    _check(variants, sources)
    for name, run in {"base": base, **sources}.items():
        if run.edits or run.samples != 1:
            raise ValueError(f"attribution takes plain runs: run {name!r} has edits or samples")
    if method != "atp" and len(sources) != 1:
        raise ValueError(f"{method} needs exactly one source run, the path's end")
    n_layers = model.cfg.n_layers
    if method == "atp-star" and n_layers < 2:
        raise ValueError("atp-star's GradDrop needs two blocks or more")
    started = time.perf_counter()
    names = sorted({e.site.name for v in variants for e in v.edits})
    qk = sorted({e.site.layer for v in variants for e in v.edits if e.site.point in qk_fix.QK}
                ) if method == "atp-star" else []
    held = {n: capture(model, run, names + ["blocks.0.hook_resid_pre"], last=True)
            for n, run in sources.items()}
    acts = {k: c.acts for k, c in held.items()}
    passes = {"forwards": len(sources), "backwards": 0}
    if method == "ig":
        kept = capture(model, base, names + ["blocks.0.hook_resid_pre"], last=True)
        (src,) = held.values()
        path = (kept.acts["blocks.0.hook_resid_pre"][:1], src.acts["blocks.0.hook_resid_pre"][:1])
        grads, _, _ = gradients(model, base.tokens, names, metric, path=path, steps=steps)
        base_acts, value = kept.acts, float(metric_of(metric, kept.logits)[0])
        passes["forwards"] += 1 + steps
        passes["backwards"] += steps
    else:
        grads, value, base_acts = gradients(model, base.tokens, names, metric, patterns=qk)
        passes["forwards"] += 1
        passes["backwards"] += 1
    if progress:
        progress(total=len(variants))
    deltas = qk_fix.deltas(model, base, variants, acts, base_acts) if qk else {}
    passes["forwards"] += len(deltas)  # each stopped at its block
    values, inert = _linear(model, variants, grads, base_acts, acts, deltas)
    bound = None
    if method == "atp-star":  # GradDrop, the QK fix in every pass
        total = np.zeros(len(variants))
        for layer in range(n_layers):
            dropped, _, _ = gradients(model, base.tokens, names, metric, drop=layer,
                                      patterns=qk)
            total += np.abs(_linear(model, variants, dropped, base_acts, acts, deltas)[0])
        bound = total / (n_layers - 1)
        passes["forwards"] += n_layers
        passes["backwards"] += n_layers
    if progress:
        for _ in variants:
            progress()
    how = {"method": method, "steps": steps if method == "ig" else None, **passes,
           "qk_fixed_blocks": len(qk) or None, "seconds": round(time.perf_counter() - started, 3)}
    return Estimates(values, inert, value,
                     {n: float(metric_of(metric, c.logits)[0]) for n, c in held.items()},
                     {k: v for k, v in how.items() if v is not None}, bound)


def _linear(model, variants: Sequence[Variant], grads: dict, base: dict, sources: dict,
            deltas: dict) -> tuple[np.ndarray, np.ndarray]:
    """(each variant's estimate: the sum over its edits of (apply(a_base, source) - a_base)
    . g at the edit's selection, or with the QK fix (`deltas` holds its site) the exact
    change of the pattern . dM/dA; whether every edit writes exactly what is there). Where
    an elementwise intervention reads a named run, its products are applied and summed
    over the feature axis once per site, (pos,) or (pos, heads), so that a variant costs an
    index into those sums."""
    sums: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    out, inert = np.empty(len(variants)), np.ones(len(variants), dtype=bool)
    for i, v in enumerate(variants):
        total = 0.0
        for e in v.edits:
            name = e.site.name
            if not (isinstance(e.source, str) and getattr(e.intervention, "elementwise", False)):
                here = (slice(None), *e.site.index())
                before = base[name][:1][here]
                diff = (e.intervention.apply(before.clone(), e.source_of(sources, 1))
                        - before).double()
                total += float((diff * grads[name][:1].double()[here]).sum())
                inert[i] &= not bool(diff.any())
                continue
            key = (e.intervention, e.source, name)
            if key not in sums:
                whole = base[name][:1]
                diff = (e.intervention.apply(whole.clone(), sources[e.source][name][:1])
                        - whole)[0].double()
                changed = diff.ne(0).flatten(2 if diff.dim() > 2 else 1).any(-1)
                if key in deltas:  # (pos, heads): the QK fix's terms, one per head
                    per = qk_fix.terms(model, e.site.point, deltas[key],
                                    grads[f"blocks.{e.site.layer}.attn.hook_pattern"])
                    terms = np.zeros(tuple(changed.shape))
                    terms[0] = per  # the head's whole term, at its first position
                else:
                    terms = (diff * grads[name][0].double()).flatten(
                        2 if diff.dim() > 2 else 1).sum(-1).cpu().numpy()
                sums[key] = terms, changed.cpu().numpy()
            terms, changed = sums[key]
            at = _at(e.site)
            total += float(terms[at].sum())
            inert[i] &= not bool(changed[at].any())
        out[i] = total
    return out, inert


def _at(site: Site) -> tuple:
    """A site's selection in its per-position (or per-position-and-head) sums."""
    pos = slice(None) if site.positions is None else list(site.positions)
    return (pos,) if site.head is None else (pos, site.head)
