"""Activation patching: write the clean run's activation at one site into the corrupted run.

Two prompts of equal length ("The capital of France is" / "... of Italy is"). Each variant
patches one (layer, position) of `resid-pre`, `attn-out` or `mlp-out`, or one (layer, head)
of `z` at every position (TransformerLens's `patching.py`: `get_act_patch_resid_pre`,
`..._attn_out`, `..._mlp_out`, `..._attn_head_out_all_pos`). The metric is the logit
difference target - contrast at the last position (log P(target) without a contrast),
normalised so that 0 is the corrupted run and 1 the clean run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.interventions.interchange import Edit, Patch, Site, heads_at
from blockscope.sweeps.interchange import Outcome, Run, sweep
from blockscope.sweeps.metrics import LogitDiff, TargetLogProb
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

SITES = {"resid-pre": "hook_resid_pre", "attn-out": "hook_attn_out",
         "mlp-out": "hook_mlp_out", "z": "attn.hook_z", "q": "attn.hook_q", "k": "attn.hook_k",
         "v": "attn.hook_v"}
HEADS = ("z", "q", "k", "v")  # sites patched one head at a time, at every position
MEANING = {
    "logit_diff": "logit(target) - logit(contrast) at the last position, the corrupted run "
    "with the clean run's activation written at the row's site",
    "log_prob": "log P(target) at the last position, the corrupted run with the clean run's "
    "activation written at the row's site",
    "normalized": "(value - corrupted) / (clean - corrupted): 0 is the corrupted run, 1 the "
    "clean run",
    "z": "one head's z at every position (head column; position empty)",
    "q, k, v": "one head's query, key or value at every position, before any rotary "
    "embedding (head column: for k and v a key/value head, shared by its group of query "
    "heads where the model groups them; position empty)",
}


def check_sites(sites) -> None:
    bad = [s for s in sites if s not in SITES]
    if bad or not sites:
        raise BadValue(f"`site` must be among {', '.join(SITES)} (got {', '.join(bad) or 'none'})")


def check_lengths(n_clean: int, n_corrupted: int) -> None:
    if n_clean != n_corrupted:
        raise BadValue(f"the clean and corrupted prompts must be the same number of tokens "
                       f"(`clean` is {n_clean}, `corrupted` {n_corrupted})")


def variants(cfg, n_tokens: int, sites) -> list[Variant]:
    """One variant per (layer, position) of each stream site, per (layer, head) of the
    per-head sites (z, q, k, v: the model's config `cfg` says how many heads each has)."""
    out = []
    for name in sites:
        point = SITES[name]
        for layer in range(cfg.n_layers):
            if name in HEADS:
                out += [Variant({"site": name, "layer": layer, "head": h, "position": None},
                                (Edit(Site(point, layer, tuple(range(n_tokens)), h), Patch(),
                                      "clean"),)) for h in range(heads_at(cfg, point))]
            else:
                out += [Variant({"site": name, "layer": layer, "head": None, "position": p},
                                (Edit(Site(point, layer, (p,)), Patch(), "clean"),))
                        for p in range(n_tokens)]
    return out


INSIDE = ("q", "k", "v")  # inside the attention: the cached engine does not resume there
WHY_INSIDE = ("q, k and v are inside the attention, where the cached engine does not resume; "
              "their cells ran on the naive loop")


def patched(model, base: Run, sources: dict, vs: list[Variant], metric,
            settings: RunSettings = RunSettings()) -> Outcome:
    """`sweep` over `patch`'s variants, the cells inside the attention (q, k, v) on the
    naive loop, the others on the engine `settings` names: one sweep each, so that a q cell
    does not send every cell to the naive loop. `how` is the others' (or, with only q, k
    and v, the naive loop's, saying why)."""
    inside = [i for i, v in enumerate(vs) if v.label["site"] in INSIDE]
    if not inside or settings.engine == "naive":
        return sweep(model, base, sources, vs, metric, settings)
    rest = [i for i in range(len(vs)) if i not in set(inside)]
    naive = sweep(model, base, sources, [vs[i] for i in inside], metric,
                  dataclasses.replace(settings, engine="naive"))
    if not rest:
        return dataclasses.replace(naive, how={**naive.how, "why_naive": WHY_INSIDE})
    out = sweep(model, base, sources, [vs[i] for i in rest], metric, settings)
    values = np.empty((len(vs), out.values.shape[1]))
    values[rest], values[inside] = out.values, naive.values
    return dataclasses.replace(out, values=values, how={**out.how, "inside": WHY_INSIDE})


def patch(model, clean: torch.Tensor, corrupted: torch.Tensor, *, target: int,
          contrast: int | None = None, sites=("resid-pre",),
          settings: RunSettings = RunSettings()) -> pd.DataFrame:
    """One row per patched site: `site, layer, head, position, token, logit_diff` (or
    `log_prob`), `normalized`. attrs: the clean and corrupted values, how it ran."""
    check_sites(sites)
    check_lengths(clean.shape[-1], corrupted.shape[-1])
    metric = TargetLogProb(target) if contrast is None else LogitDiff(target, contrast)
    n = clean.shape[-1]
    vs = variants(model.cfg, n, sites)
    res = patched(model, Run(corrupted), {"clean": Run(clean)}, vs, metric, settings)
    lo, hi = float(res.base[0]), float(res.sources["clean"][0])
    words = [model.tokenizer.decode([t]) for t in clean[0].tolist()]
    rows = []
    for v, value in zip(vs, res.values[:, 0], strict=True):
        p = v.label["position"]
        rows.append({**v.label, "token": "" if p is None else words[p],
                     metric.name: float(value),
                     "normalized": (float(value) - lo) / (hi - lo) if hi != lo else float("nan")})
    df = pd.DataFrame(rows)
    df["head"] = df["head"].astype("Int64")
    df["position"] = df["position"].astype("Int64")
    df.attrs.update(clean=hi, corrupted=lo, metric=metric.name, how=res.how)
    return df
