"""`bs.sweep`: your own variants and metric on blockscope's engine, checked as its own are.

    import blockscope as bs
    model = bs.load("smollm2-135m")
    steer = bs.Variant("steer", [bs.Edit(bs.Site("hook_resid_pre", 10), AddVector(v))])
    result = bs.sweep(model, [steer], bs.TargetLogProb(token), base=bs.Run("The capital ..."))

A variant is a value: a label and its edits, each `Edit(site, intervention, source)`. An
intervention is any object with `apply(base, source) -> activation'` (a frozen dataclass,
by convention): `base` is the run's own activation at the site, as the site selects it
(`(samples, positions, ...)`), and `source` what the edit reads: a named source run's
activation at the same site, a tensor, or None. A metric is any object with a `name` and
`__call__(logits) -> values`, logits `(samples, d_vocab)` at the base run's position
`position` (an int attribute, negative from the end; the last where it has none), values
`(samples,)` or `(samples, k)` with `columns` naming the k.

The same engine runs the commands `patch`, `trace` and `knockout` (`sweeps.interchange`):
each variant from the first block and position it changes, the base run replayed and the
first variant of each kind held to the naive loop; where that check fails every variant
runs naive, a warning says why and `meta["how"]["fallback"]` records it (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from blockscope.api.result import MAIN, Result
from blockscope.errors import BadValue
from blockscope.interventions.interchange import Edit, Site, heads_at
from blockscope.sweeps.interchange import Run
from blockscope.sweeps.metrics import position_of
from blockscope.sweeps.variant import Variant


class EngineFallback(UserWarning):
    """The cached engine's self-check failed, or it cannot run these edits (an edit at
    `hook_embed`, a family without a plain replay), and every variant ran on the naive
    loop."""


def sweep(model, variants: Sequence[Variant], metric, *, base: Run,
          sources: dict[str, Run] | None = None, engine: str = "cached",
          batch_size: int | None = None, prepend_bos: bool = True,
          progress: Callable | None = None, tokenizer=None) -> Result:
    """Every variant's metric on the base run, one row per variant.

    Args:
        model: A model from `bs.load`, a TransformerBridge, or a Hugging Face model (then
            with `tokenizer`).
        variants: `bs.Variant(label, edits)`: the label a string (the `variant` column) or
            a dict of columns; the edits `bs.Edit(bs.Site(...), intervention, source)`.
        metric: What is read off one position's logits (its `position`, the last by
            default): `bs.TargetLogProb(id)`, `bs.TargetProb(id)`, `bs.LogitDiff(id, id)`
            (each with `position=`), or a class of your own.
        base: The run the variants edit: `bs.Run(tokens)` (a string is tokenized as the
            commands do, BOS first unless `prepend_bos` is False; or token ids (1, T)),
            with edits of its own and `samples` copies (`bs.Run(t, edits, samples=10)`).
        sources: The runs edits read from, by name ("base" names the base run itself).
        engine: "cached" (each variant from where it first differs, self-checked) or
            "naive" (one hooked forward per variant: the reference).
        batch_size: Variants per batch of the cached engine (None: by memory).
        progress: progress(done, total, description), called as variants finish.

    Returns:
        A `Result`: `table` has one row per variant, its label's columns then the metric's
        (the mean over the base run's samples where it has several); `meta` has the base
        run's and each source run's value, and `how`: the engine that ran (cached or
        naive), any fallback and why, the batch size and the block-positions computed.
    """
    from blockscope.api.face import held_spec
    from blockscope.choices import EngineName, one_of
    from blockscope.sweeps import interchange
    from blockscope.sweeps.settings import RunSettings
    from blockscope.versions import versions

    model, spec = held_spec(model, tokenizer)
    engine = one_of(EngineName, engine, "engine").value
    variants = [_variant(v) for v in variants]
    if not variants:
        raise BadValue("`variants` is empty: give at least one")
    sources = dict(sources or {})
    base = _tokens(model, base, "base", prepend_bos)
    sources = {name: _tokens(model, run, name, prepend_bos) for name, run in sources.items()}
    T = base.tokens.shape[-1]
    for name, run in sources.items():
        if run.tokens.shape[-1] != T:
            raise BadValue(f"source run {name!r} is {run.tokens.shape[-1]} tokens and the "
                           f"base run {T}: edits read the same positions of both")
    _check_sites(model, variants, base, T)
    names = _columns(metric)
    try:
        position_of(metric, T)
    except ValueError as exc:
        raise BadValue(str(exc)) from None
    step = _stepper(progress, len(variants))
    outcome = interchange.sweep(model, base, sources, variants, metric,
                                RunSettings(engine=engine, batch_size=batch_size,
                                            progress=step))
    how = dict(outcome.how)
    if engine == "cached" and how.get("engine") == "naive":  # fell back, or could not run
        warnings.warn(how.get("fallback") or how.get("why_naive"), EngineFallback,
                      stacklevel=2)
    if how.get("engine") == "naive":
        how["block_positions"] = len(variants) * base.samples * model.cfg.n_layers * T
    values = outcome.values.reshape(len(variants), base.samples, len(names))  # (V, S, k)
    rows = [{**v.label, **dict(zip(names, values[i].mean(0).tolist(), strict=True))}
            for i, v in enumerate(variants)]
    meta = {"command": "sweep", "model": {"name": spec.name, "source": spec.source},
            "metric": _describe(metric), "columns": names,
            "base": _value(outcome.base, names),
            "sources": {n: _value(v, names) for n, v in outcome.sources.items()},
            "tokens": T, "samples": base.samples, "variants": len(variants), "how": how,
            "versions": versions()}
    if base.samples > 1:
        meta["samples_rule"] = "each variant's value is its mean over the base run's samples"
    table = pd.DataFrame(rows)
    return Result("sweep", f"sweep-{spec.slug}", _digest(spec, variants, metric, base, sources,
                                                          engine), {MAIN: table}, meta)


def _variant(v) -> Variant:
    """A variant with a dict label and a tuple of Edits (a string label is its `variant`
    column; a list of edits a tuple)."""
    if not isinstance(v, Variant):
        raise BadValue(f"each variant must be a bs.Variant, not {type(v).__name__}")
    label = {"variant": v.label} if isinstance(v.label, str) else dict(v.label)
    edits = (v.edits,) if isinstance(v.edits, Edit) else tuple(v.edits)
    for e in edits:
        if not isinstance(e, Edit):
            raise BadValue(f"variant {label} has {type(e).__name__}; edits here are "
                           "bs.Edit(site, intervention, source)")
        if not callable(getattr(e.intervention, "apply", None)):
            raise BadValue(f"variant {label}: {type(e.intervention).__name__} has no "
                           "apply(base, source)")
    return Variant(label, edits, v.order)


def _tokens(model, run: Run, name: str, prepend_bos: bool) -> Run:
    """`run` with its tokens as ids (1, T): a string tokenized as the commands do."""
    from blockscope.inputs.text import tokenize

    if not isinstance(run, Run):
        raise BadValue(f"the {name} run must be a bs.Run, not {type(run).__name__}")
    tokens = run.tokens
    if isinstance(tokens, str):
        tokens = tokenize(model.tokenizer, tokens, prepend_bos=prepend_bos)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    tokens = tokens[None] if tokens.dim() == 1 else tokens
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise BadValue(f"the {name} run's tokens must be one sequence (1, T), not "
                       f"{tuple(tokens.shape)}")
    if tokens.shape[-1] > model.cfg.n_ctx:
        raise BadValue(f"the {name} run is {tokens.shape[-1]} tokens; the context is "
                       f"{model.cfg.n_ctx}")
    if run.samples < 1:
        raise BadValue(f"the {name} run's `samples` must be at least 1")
    return dataclasses.replace(run, tokens=tokens)


def _check_sites(model, variants: Sequence[Variant], base: Run, T: int) -> None:
    """Every edit within the model: its layer, positions and head, and what an intervention
    with a `check(cfg)` says of itself (a built-in removal's heads or neurons)."""
    cfg = model.cfg
    for v in variants:
        edits = (*base.edits, *v.edits)
        for e in edits:
            check = getattr(e.intervention, "check", None)
            wrong = check(cfg) if callable(check) else None
            if wrong:
                raise BadValue(f"variant {v.label}: {wrong}")
        for s in [e.site for e in edits] + [e.source for e in edits if isinstance(e.source, Site)]:
            where = f"variant {v.label}: site {s.name}"
            if s.layer is not None and not 0 <= s.layer < cfg.n_layers:
                raise BadValue(f"{where}: layer {s.layer} is outside 0..{cfg.n_layers - 1}")
            if any(not 0 <= p < T for p in (*(s.positions or ()), *s.keys)):
                raise BadValue(f"{where}: positions must be within 0..{T - 1}")
            n_heads = heads_at(cfg, s.point)
            if s.head is not None and not 0 <= s.head < n_heads:
                raise BadValue(f"{where}: head {s.head} is outside 0..{n_heads - 1}")


def _columns(metric) -> list[str]:
    """The metric's column names: its `columns`, or its `name`."""
    if not callable(metric):
        raise BadValue(f"the metric must be callable on logits, not {type(metric).__name__}")
    columns = getattr(metric, "columns", None)
    if columns:
        return [str(c) for c in columns]
    return [str(getattr(metric, "name", None) or type(metric).__name__)]


def _value(values: np.ndarray, names: list[str]) -> dict:
    """A run's metric (S,) or (S, k) as {column: mean over samples}."""
    values = np.asarray(values, dtype=np.float64).reshape(-1, len(names))
    return dict(zip(names, values.mean(0).tolist(), strict=True))


def _describe(metric) -> dict:
    """The metric as the sidecar records it: its class and its fields."""
    record = {"class": f"{type(metric).__module__}.{type(metric).__qualname__}"}
    if dataclasses.is_dataclass(metric):
        record |= {f.name: _plain(getattr(metric, f.name)) for f in dataclasses.fields(metric)}
    return record


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 16 else f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _digest(spec, variants, metric, base: Run, sources: dict, engine: str) -> str:
    """8 hex digits naming what was measured: the model, the runs' tokens and edits, every
    variant's label and edits, the metric, with tensors named by their bytes."""
    h = hashlib.sha256()

    def feed(value):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"tensor{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else
                     t.float().numpy().tobytes())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            h.update(type(value).__qualname__.encode())
            for f in dataclasses.fields(value):
                h.update(f.name.encode())
                feed(getattr(value, f.name))
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(repr(k).encode())
                feed(value[k])
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for v in value:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(value).encode())

    feed(["sweep", spec.source, spec.dtype, engine, base, sorted(sources.items()),
          [(v.label, v.edits) for v in variants], type(metric).__qualname__, metric])
    return h.hexdigest()[:8]


def _stepper(progress: Callable | None, total: int) -> Callable | None:
    """The engine's cb()/cb(total=n) as the face's progress(done, total, description)."""
    if progress is None:
        return None
    state = {"done": 0, "total": total}

    def step(total: int | None = None) -> None:
        if total is not None:
            state["total"] = total
        else:
            state["done"] += 1
        progress(state["done"], state["total"], "variants")

    return step
