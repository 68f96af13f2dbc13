"""Interchange sweeps: a base run, source runs, variants (edits at named sites) and a metric.

`sweep(model, base, sources, variants, metric)` scores each variant: the base run (its
tokens, and edits of its own such as ROME's noise, over `samples` copies) with the
variant's edits (`interventions.interchange.Edit`), each writing `apply(base, source)` at
its site, `source` being what a source run had there. Source runs are run once and their
activations cached; the base run is run once and kept.

Two engines give the same numbers:
- `naive`: one hooked forward of the base run per variant (TransformerLens's
  `generic_activation_patch`, ROME's `trace_with_patch`);
- `cached` (resume.py): each variant from the first block and the first position it
  changes. The model is causal, so the positions before the first changed one are the base
  run's, and their keys and values too: a variant at (layer l, position p) runs blocks
  l.. at positions p.. only. It runs on the plain replays (GPT-2, the Llama family,
  GPT-NeoX), self-checked: the base run replayed from the embeddings, and the first
  variant of each kind held to the naive loop; on a mismatch every variant runs naive and
  `how["fallback"]` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from blockscope.interventions import applied
from blockscope.interventions import hooks as edit_hooks
from blockscope.interventions.interchange import Edit
from blockscope.model import adapters
from blockscope.sweeps.how import Engine
from blockscope.sweeps.metrics import position_of
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant


@dataclass(frozen=True, eq=False)
class Run:
    """A run of the model: tokens (1, T), and the edits that make it (each reading a tensor
    source, batch `samples` or 1), over `samples` copies of the tokens."""

    tokens: torch.Tensor
    edits: tuple[Edit, ...] = ()
    samples: int = 1


@dataclass
class Captured:
    """What a run left: its final logits at one position (the last, unless asked), each
    block's input (and the final residual) and the hook points asked for, all
    (samples, ...), and each block's call."""

    logits: torch.Tensor  # (S, d_vocab)
    pre: list[torch.Tensor]  # n_layers + 1 of (S, T, d_model)
    acts: dict[str, torch.Tensor]  # hook name -> (S, ...)
    block_args: list[tuple[tuple, dict]]


@dataclass
class Outcome:
    """A sweep's metric values, and how it ran."""

    values: np.ndarray  # (V, S): each variant on each sample of the base run
    base: np.ndarray  # (S,): the base run itself
    sources: dict[str, np.ndarray]  # each source run itself, (its samples,)
    how: dict = field(default_factory=dict)


def capture(model, run: Run, names: Sequence[str] = (), *, blocks: bool = False,
            last: bool = False, position: int = -1) -> Captured:
    """One forward of `run` (its edits on), keeping the hook points `names` (as edited), the
    logits at `position` and, with `blocks`, each block's input, the final residual and each
    block's call. With `last`, the unembedding runs at the last position alone (where the
    model has `unembed.hook_in`): the same logits to float32 rounding, a product over the
    vocabulary the length of the prompt cheaper."""
    n = model.cfg.n_layers
    pre: list = [None] * (n + 1)
    acts: dict[str, torch.Tensor] = {}
    args: list = [None] * n

    def keep(name, i=None):
        def hook(act, hook=None):
            if i is None:
                acts[name] = act.detach()
            else:
                pre[i] = act.detach()

        return hook

    hooks = edit_hooks(run.edits, run.samples)
    hooks += [(name, keep(name)) for name in sorted(set(names))]
    handles = []
    if blocks:
        hooks += [(f"blocks.{i}.hook_resid_pre", keep(None, i)) for i in range(n)]
        hooks.append(("ln_final.hook_in", keep(None, n)))

        def record(i):
            def pre_hook(module, a, kw):
                args[i] = adapters.replayable_call(a, kw)

            return pre_hook

        handles = [b.register_forward_pre_hook(record(i), with_kwargs=True)
                   for i, b in enumerate(model.blocks)]
    if last and position == -1 and "unembed.hook_in" in model.hook_dict:
        hooks.append(("unembed.hook_in", lambda act, hook=None: act[:, -1:]))
    tokens = run.tokens.to(model.cfg.device).expand(run.samples, -1)  # (S, T)
    try:
        with torch.inference_mode(), applied(model, hooks):
            logits = model(tokens, return_type="logits")[:, position]  # (S, d_vocab)
    finally:
        for h in handles:
            h.remove()
    return Captured(logits.float(), pre, acts, args)


def naive(model, base: Run, variants: Sequence[Variant], sources: dict, metric,
          progress: Callable | None = None) -> list[torch.Tensor]:
    """Each variant's metric (S,): one hooked forward of the base run per variant."""
    out = []
    position = position_of(metric, base.tokens.shape[-1])
    for v in variants:
        out.append(metric(variant_logits(model, base, v, sources, position)).cpu())
        if progress:
            progress()
    return out


def variant_logits(model, base: Run, v: Variant, sources: dict,
                   position: int = -1) -> torch.Tensor:
    """The logits (S, d_vocab) at `position` of the base run with `v`'s edits on."""
    tokens = base.tokens.to(model.cfg.device).expand(base.samples, -1)
    hooks = Variant(v.label, (*base.edits, *v.edits), v.order).hooks(base.samples, sources)
    with torch.inference_mode(), applied(model, hooks):
        return model(tokens, return_type="logits")[:, position].float()


def source_names(variants: Sequence[Variant]) -> dict[str, set[str]]:
    """Run name -> the hook points the variants read from it."""
    need: dict[str, set[str]] = {}
    for v in variants:
        for e in v.edits:
            if isinstance(e.source, str):
                need.setdefault(e.source, set()).add(e.site.name)
    return need


def sweep(model, base: Run, sources: dict[str, Run], variants: Sequence[Variant], metric,
          settings: RunSettings = RunSettings()) -> Outcome:
    """Every variant's metric on every sample of the base run. `sources` names the runs
    edits read from; "base" names the base run itself (a freeze). Of `settings`: the engine,
    the batch size and the progress callback."""
    from blockscope.sweeps import resume

    engine, progress = settings.engine, settings.progress
    need = source_names(variants)
    unknown = sorted(set(need) - set(sources) - {"base"})
    if unknown:
        raise ValueError(f"edits read from runs not given: {', '.join(unknown)}")
    position = position_of(metric, base.tokens.shape[-1])  # the one the metric reads
    held = {name: capture(model, run, sorted(need.get(name, ())), position=position)
            for name, run in sources.items()}
    kept = capture(model, base, sorted(need.get("base", ())), blocks=engine == "cached",
                   position=position)
    acts = {name: c.acts for name, c in held.items()} | {"base": kept.acts}
    if progress:
        progress(total=len(variants))
    values, how = Engine(engine).run(
        lambda: resume.cached(model, base, kept, variants, acts, metric,
                              lambda v: variant_logits(model, base, v, acts, position),
                              batch_size=settings.batch_size, progress=progress),
        lambda how: naive(model, base, variants, acts, metric, progress))
    return Outcome(np.stack([v.numpy() for v in values]) if values else
                  np.zeros((0, base.samples)),
                  metric(kept.logits).cpu().numpy(),
                  {name: metric(c.logits).cpu().numpy() for name, c in held.items()}, how)
