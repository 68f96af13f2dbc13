"""Activation patching: write the clean run's activation at one site into the corrupted run.

Two prompts of equal length ("The capital of France is" / "... of Italy is"). Each variant
patches one (layer, position) of `resid-pre`, `attn-out` or `mlp-out`, or one (layer, head)
of `z` at every position (TransformerLens's `patching.py`: `get_act_patch_resid_pre`,
`..._attn_out`, `..._mlp_out`, `..._attn_head_out_all_pos`). The metric is the logit
difference target - contrast at the last position (log P(target) without a contrast),
normalised so that 0 is the corrupted run and 1 the clean run.
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.interventions.interchange import Edit, Patch, Site
from blockscope.sweeps.interchange import Run, sweep
from blockscope.sweeps.metrics import LogitDiff, TargetLogProb
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

SITES = {"resid-pre": "hook_resid_pre", "attn-out": "hook_attn_out",
         "mlp-out": "hook_mlp_out", "z": "attn.hook_z"}
MEANING = {
    "logit_diff": "logit(target) - logit(contrast) at the last position, the corrupted run "
    "with the clean run's activation written at the row's site",
    "log_prob": "log P(target) at the last position, the corrupted run with the clean run's "
    "activation written at the row's site",
    "normalized": "(value - corrupted) / (clean - corrupted): 0 is the corrupted run, 1 the "
    "clean run",
    "z": "one head's z at every position (head column; position empty)",
}


def check_sites(sites) -> None:
    bad = [s for s in sites if s not in SITES]
    if bad or not sites:
        raise BadValue(f"`site` must be among {', '.join(SITES)} (got {', '.join(bad) or 'none'})")


def check_lengths(n_clean: int, n_corrupted: int) -> None:
    if n_clean != n_corrupted:
        raise BadValue(f"the clean and corrupted prompts must be the same number of tokens "
                       f"(`clean` is {n_clean}, `corrupted` {n_corrupted})")


def variants(n_layers: int, n_heads: int, n_tokens: int, sites) -> list[Variant]:
    """One variant per (layer, position) of each stream site, per (layer, head) of z."""
    out = []
    for name in sites:
        point = SITES[name]
        for layer in range(n_layers):
            if name == "z":
                out += [Variant({"site": name, "layer": layer, "head": h, "position": None},
                                (Edit(Site(point, layer, tuple(range(n_tokens)), h), Patch(),
                                      "clean"),)) for h in range(n_heads)]
            else:
                out += [Variant({"site": name, "layer": layer, "head": None, "position": p},
                                (Edit(Site(point, layer, (p,)), Patch(), "clean"),))
                        for p in range(n_tokens)]
    return out


def patch(model, clean: torch.Tensor, corrupted: torch.Tensor, *, target: int,
          contrast: int | None = None, sites=("resid-pre",),
          settings: RunSettings = RunSettings()) -> pd.DataFrame:
    """One row per patched site: `site, layer, head, position, token, logit_diff` (or
    `log_prob`), `normalized`. attrs: the clean and corrupted values, how it ran."""
    check_sites(sites)
    check_lengths(clean.shape[-1], corrupted.shape[-1])
    metric = TargetLogProb(target) if contrast is None else LogitDiff(target, contrast)
    n = clean.shape[-1]
    vs = variants(model.cfg.n_layers, model.cfg.n_heads, n, sites)
    res = sweep(model, Run(corrupted), {"clean": Run(clean)}, vs, metric, settings)
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
