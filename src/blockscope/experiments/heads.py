"""Which heads matter, and how many can go (Michel et al. 2019; Voita et al. 2019).

- `single_head_ablation`: perplexity with each head removed (z zeroed before W_O, or replaced
  by its clean mean over positions).
- `head_importance`: Michel et al.'s |dLoss/dmask| for a head mask multiplying each z, from
  one forward and backward pass with the weights frozen, plus the per-layer L2-normalised
  score their code prunes by.
- `one_head_per_layer`: keep only each layer's most important head in turn.

The pruning curve built on these is in `pruning`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from blockscope.errors import BlockscopeError
from blockscope.inputs.corpus import as_docs
from blockscope.inputs.parallel import total
from blockscope.interventions import ScaleHeads, applied, mask_heads
from blockscope.sweeps import plan
from blockscope.sweeps.stats import Bootstrap
from blockscope.sweeps.sweep import Progress, Variant, model_windows, window_nll

ENGINES = plan.ENGINES


def prepare(model, tokens, *, method: str = "zero", stride: int | None = None,
            engine: str = "cached") -> plan.Prepared:
    """The clean passes (or NLL) and, for `method` mean, the clean mean z that every head
    experiment below starts from: computed once, passed to each as `prepared=`."""
    return prepare_fill(model, as_docs(tokens), stride, method, engine)[0]


def prepare_fill(model, docs, stride, method: str, engine: str,
             prepared: plan.Prepared | None = None) -> tuple[plan.Prepared, dict | None]:
    """`prepared` (made here if None), and `fill`: None for zero ablation, else each
    layer's clean mean z over positions (n_heads, d_head)."""
    if method not in ("zero", "mean"):
        raise BlockscopeError("--method must be zero or mean")
    names = [n for i in range(model.cfg.n_layers)  # where each layer's mean z is read
             for n in ScaleHeads(i, torch.ones(model.cfg.n_heads)).mean_points()]
    if prepared is None:
        prepared = plan.prepare(model, docs, stride=stride, engine_name=engine, heads=True,
                                mean_names=names if method == "mean" else ())
    elif prepared.engine != engine or (method == "mean" and not set(names) <= set(
            prepared.means)):
        raise ValueError(f"`prepared` was made for another engine or method than "
                         f"{engine}/{method}")
    fill = {i: prepared.means[n] for i, n in enumerate(names)} if method == "mean" else None
    return prepared, fill


def _head_sweep(model, docs, items, *, prepared, fill, **kw):
    """Score `items` = [(label, layer, keep (n_heads,))], each changing one layer's heads."""
    variants = [Variant(label, (ScaleHeads(layer, keep, fill[layer] if fill else None),))
                for label, layer, keep in items]
    return plan.run(model, docs, variants, prepared=prepared, **kw)


def _check(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    values = list(range(n)) if values is None else list(values)
    if not values or any(not 0 <= v < n for v in values):
        raise BlockscopeError(f"--{what} must be between 0 and {n - 1}")
    return values


def single_head_ablation(
    model, tokens, *, method: str = "zero", stride: int | None = None,
    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
    engine: str = "cached", batch_size: int | None = None, progress: Progress | None = None,
    ci: Bootstrap | None = None, prepared: plan.Prepared | None = None,
) -> pd.DataFrame:
    """Baseline row, then one row per (layer, head) removed alone. `tokens`: a passage
    `(1, pos)` or `corpus.Docs`; `ci`: bootstrap intervals (`stats.frame`); `prepared`:
    from `prepare` with the same method and engine, if at hand."""
    cfg = model.cfg
    layers = _check(layers, cfg.n_layers, "layers")
    heads = _check(heads, cfg.n_heads, "heads")
    docs = as_docs(tokens)
    prepared, fill = prepare_fill(model, docs, stride, method, engine, prepared)
    items = []
    for layer in layers:
        for head in heads:
            keep = torch.ones(cfg.n_heads)
            keep[head] = 0
            items.append(({"layer": layer, "head": head, "method": method}, layer, keep))
    df = _head_sweep(model, docs, items, prepared=prepared, fill=fill, stride=stride,
                     batch_size=batch_size, progress=progress, ci=ci)
    df[["layer", "head"]] = df[["layer", "head"]].astype("Int64")
    df.loc[0, "method"] = "none"
    return df


def head_importance(
    model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
    prepared: plan.Prepared | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance, normalised), each (n_layers, n_heads).

    importance = |d(mean NLL)/d mask| with the mask at `keep` (default all ones), and 0 for
    a head `keep` removes (sets to 0: it is gone, and the plain replay leaves it out); with
    several windows, each window's |gradient of its summed NLL| is added, then divided by
    the tokens scored; over documents (`corpus.Docs`, every process), every window of every
    document. normalised divides each layer's scores by their L2 norm (Michel et al.'s code).
    With the cached clean passes in `prepared`, the pass runs as `gradient_pass` says.
    """
    importance, normalised, _ = gradient_pass(model, tokens, stride=stride, keep=keep,
                                              prepared=prepared)
    return importance, normalised


def gradient_pass(model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
                  prepared: plan.Prepared | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, plan.Scores]:
    """`head_importance`, and the NLL of the same forward passes as `plan.Scores` (one
    column: the model with heads scaled by `keep`, the hooked forward the gradient needs).

    Given the cached clean passes of the one document (`prepared`), the forward and backward
    run as the plain replay (fused attention) with the mask applied to each head's z, once
    `selfcheck.gradient_replay` has held that to the hooked model on each window; otherwise,
    and on any mismatch (said in `how["fallback"]`), through the hooked bridge."""
    from blockscope.model import arch
    from blockscope.sweeps import replay, selfcheck
    from blockscope.sweeps.steps import fused_gelu

    docs = as_docs(tokens)
    cfg = model.cfg
    keep = torch.ones(cfg.n_layers, cfg.n_heads) if keep is None else keep
    mask = keep.detach().clone().float().to(cfg.device).requires_grad_(True)
    cleans = prepared.cleans if prepared is not None and len(docs.ids) == 1 else None
    lay = arch.layout(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen weights: only the mask gets a gradient
    # float64 on the CPU: the sum is the same whichever ranks' documents it gathers
    summed, n_scored, units = torch.zeros(mask.shape, dtype=torch.float64), 0, []
    how = {"replay": set(), "batch_size": 1}
    try:
        with torch.enable_grad():
            for index, ids in zip(docs.index, docs.ids, strict=True):
                nlls = []
                for wi, w in enumerate(model_windows(model, ids, stride)):
                    plain = ran = None
                    if cleans is not None:  # `ran`: the check's own pass, if it just ran
                        plain, why, ran = selfcheck.gradient_replay(model, lay, cleans[wi],
                                                                    mask)
                        if why:
                            how["fallback"] = why
                    if ran is not None:
                        nll, grad = ran
                    elif plain is not None:
                        with fused_gelu(model):
                            nll = replay.masked_nll(model, plain, cleans[wi], mask, lay.softcap)
                    else:
                        with applied(model, mask_heads(mask)):
                            nll = window_nll(model, ids, w)  # (n_scored,)
                    how["replay"].add("plain" if plain is not None else "bridge")
                    if ran is None:
                        (grad,) = torch.autograd.grad(nll.sum(), mask)
                    summed += (grad.abs() * (mask.detach() != 0)).double().cpu()  # removed: 0
                    n_scored += nll.numel()
                    nlls.append(nll.detach().double().cpu())
                units += plan.doc_units(index, torch.cat(nlls)[None], docs.unit)
    finally:
        for p in params:
            p.requires_grad_(True)
    joined = total(docs.comm, {"grad": summed,
                               "n": torch.tensor(float(n_scored), dtype=torch.float64)})
    importance = (joined["grad"] / joined["n"]).float()
    normalised = importance / (importance.norm(dim=-1, keepdim=True) + 1e-20)
    how["replay"] = "+".join(sorted(how["replay"], reverse=True))
    scored = plan.gather_units(docs, units, [how] if units else [], [{"variant": "ablated"}])
    return importance, normalised, scored


def one_head_per_layer(
    model, tokens, importance: torch.Tensor, *, method: str = "zero",
    stride: int | None = None, engine: str = "cached", batch_size: int | None = None,
    progress: Progress | None = None, ci: Bootstrap | None = None,
    prepared: plan.Prepared | None = None,
) -> pd.DataFrame:
    """For each layer alone: keep only its most important head, other layers intact."""
    cfg = model.cfg
    docs = as_docs(tokens)
    prepared, fill = prepare_fill(model, docs, stride, method, engine, prepared)
    items = []
    for layer in range(cfg.n_layers):
        kept = int(importance[layer].argmax())
        keep = torch.zeros(cfg.n_heads)
        keep[kept] = 1
        items.append(({"layer": layer, "kept_head": kept}, layer, keep))
    df = _head_sweep(model, docs, items, prepared=prepared, fill=fill, stride=stride,
                     batch_size=batch_size, progress=progress, ci=ci)
    df[["layer", "kept_head"]] = df[["layer", "kept_head"]].astype("Int64")
    return df
