"""The head mask's gradient (Michel et al. 2019): |d(mean NLL)/d mask| for a mask
multiplying each head's z, with the weights frozen, and the NLL of the same passes.

The second way through the stack beside `plan.scores`: the plain replay with the mask
applied to each head's z (`interventions.ScaleHeads.apply`), once
`selfcheck.gradient_replay` has held it to the hooked model on each window; otherwise, and
on any mismatch (said in `how["fallback"]`), the hooked bridge.
"""

from __future__ import annotations

import torch

from blockscope.inputs.corpus import as_docs
from blockscope.inputs.parallel import total
from blockscope.interventions import applied, mask_heads
from blockscope.model import arch
from blockscope.sweeps import plan, replay, selfcheck
from blockscope.sweeps.steps import fused_gelu
from blockscope.sweeps.sweep import model_windows, window_nll


def gradient_pass(model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
                  prepared: plan.Prepared | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, plan.Scores]:
    """`head_importance`, and the NLL of the same forward passes as `plan.Scores` (one
    column: the model with heads scaled by `keep`, the hooked forward the gradient needs).

    Given the cached clean passes of the one document (`prepared`), the forward and backward
    run as the plain replay (fused attention) with the mask applied to each head's z, once
    `selfcheck.gradient_replay` has held that to the hooked model on each window; otherwise,
    and on any mismatch (said in `how["fallback"]`), through the hooked bridge."""
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
