"""The head mask's gradient (Michel et al. 2019): |d(mean NLL)/d mask| for a mask
multiplying each head's z, with the weights frozen, and the NLL of the same passes.

The second way through the stack beside `scoring.scores`: the plain replay with the mask
applied to each head's z (`interventions.ScaleHeads.apply`), once
`selfcheck.gradient_replay` has held it to the hooked model on each window; otherwise
(said in `how["why_naive"]`), and on any mismatch (said in `how["fallback"]`), the hooked
bridge, each window through the one orchestrator (`how.Engine.run`). Each window's KL from the
clean distribution is read off the same pass's final residual (`unembed.final_nll` with the
clean pass's `Reference`; a clean pass of the window is run for it where none is cached).
"""

from __future__ import annotations

import torch

from blockscope.inputs.corpus import as_docs
from blockscope.inputs.parallel import total
from blockscope.interventions import applied, mask_heads
from blockscope.model import arch
from blockscope.sweeps import clean, replay, scoring, selfcheck, unembed
from blockscope.sweeps.how import Engine, Fallback, How, fell_back, not_tried
from blockscope.sweeps.naive import model_windows, window_nll
from blockscope.sweeps.steps import fused_gelu
from blockscope.sweeps.units import Scores, doc_units, gather_units, merged_how


def gradient_pass(model, tokens, *, stride: int | None = None, keep: torch.Tensor | None = None,
                  prepared: scoring.Prepared | None = None, kl: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor, Scores]:
    """`head_importance`, and the NLL of the same forward passes as `units.Scores` (one
    column: the model with heads scaled by `keep`, the hooked forward the gradient needs;
    its KL from the clean distribution with `kl`, else NaN).

    Given the cached clean passes of the one document (`prepared`), the forward and backward
    run as the plain replay (fused attention) with the mask applied to each head's z, once
    `selfcheck.gradient_replay` has held that to the hooked model on each window; otherwise,
    and on any mismatch (said in `how["fallback"]`), through the hooked bridge."""
    docs = as_docs(tokens)
    cfg = model.cfg
    keep = torch.ones(cfg.n_layers, cfg.n_heads) if keep is None else keep
    mask = keep.detach().clone().float().to(cfg.device).requires_grad_(True)
    # the plain replay where the corpus is one document whose clean passes are held; the
    # choice is the corpus's, not this rank's, so ranks and one process run the same floats
    cleans = prepared.cleans if prepared is not None and docs.single else None
    lay = arch.layout(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen weights: only the mask gets a gradient
    # per document, in float64 on the CPU: joined in corpus order (`parallel.total`), the
    # same sum whichever ranks' documents it gathers
    grads, units, hows = [], [], []
    try:
        with torch.enable_grad():
            for index, ids in zip(docs.index, docs.ids, strict=True):
                nlls = []
                summed = torch.zeros(mask.shape, dtype=torch.float64)
                n_scored = 0
                for wi, w in enumerate(model_windows(model, ids, stride)):
                    c = cleans[wi] if cleans is not None else None
                    (nll, grad, x), how = _window(model, lay, ids, w, c, mask)
                    hows.append(how)
                    summed += (grad.abs() * (mask.detach() != 0)).double().cpu()  # removed: 0
                    n_scored += nll.numel()
                    div = torch.full((nll.numel(),), float("nan"), dtype=torch.float64)
                    if kl:
                        ref = c if c is not None else clean.clean_pass(model, ids, w)
                        div = _kl(model, lay, ref, x, nll.detach())
                    nlls.append(torch.stack([nll.detach().double().cpu(), div]))
                units += doc_units(index, torch.cat(nlls, 1)[None], docs.unit)
                grads.append((index, {"grad": summed, "n": torch.tensor(float(n_scored))}))
    finally:
        for p in params:
            p.requires_grad_(True)
    joined = total(docs.comm, grads)
    importance = (joined["grad"] / joined["n"]).float()
    normalised = importance / (importance.norm(dim=-1, keepdim=True) + 1e-20)
    how = merged_how(hows)
    scored = gather_units(docs, units, [how] if units else [], [{"variant": "ablated"}])
    return importance, normalised, scored


BRIDGE = "the gradients ran through the bridge"


def _window(model, lay, ids: torch.Tensor, w, c: clean.Clean | None, mask: torch.Tensor):
    """((NLL (n_scored,), gradient (n_layers, n_heads), final residual (1, T, d_model)), how)
    of window `w` with each head's z scaled by `mask`: by the plain replay of its clean pass
    `c` once `selfcheck.gradient_replay` has held it to the hooked model, else (no clean
    pass held, no plain replay, or a mismatch, said in `how`) through the hooked bridge
    (`how.Engine.run`, the one orchestrator)."""
    final: list[torch.Tensor] = []  # what ln_final received, pass by pass (a torch
    # pre-hook, not a hook point: the replay runs only unhooked)
    handle = model.ln_final.register_forward_pre_hook(
        lambda m, args: final.append(args[0].detach()))
    checked_pass: list = []  # the hooked model's (NLL, gradient), where the check ran it

    def replayed():
        if c is None:
            raise Fallback(How(why_naive=not_tried("the head-mask gradient without the one "
                                                   "document's clean passes", BRIDGE)))
        plain, why, ran = selfcheck.gradient_replay(model, lay, c, mask)
        if why:
            if ran is not None:  # checked on this call: its hooked pass is the one to use
                checked_pass.append(ran)
            raise Fallback(How(fallback=fell_back(why, BRIDGE)))
        if plain is None:
            raise Fallback(How(why_naive=not_tried(
                "the head-mask gradient here (a hook in a block or on the unembedding, or a "
                "family without a plain replay)", BRIDGE)))
        if ran is not None:  # the check's own replay pass, which agreed
            nll, grad = ran
        else:
            with fused_gelu(model):
                nll = replay.masked_nll(model, plain, c, mask, lay.softcap)
            (grad,) = torch.autograd.grad(nll.sum(), mask)
        return (nll, grad, final[0]), How("cached", "plain", 1).record()

    def bridged(how):
        if checked_pass:  # the check ran the replay, then the hooked model: the second
            nll, grad = checked_pass[0]
            return nll, grad, final[-1]
        with applied(model, mask_heads(mask)):
            nll = window_nll(model, ids, w)  # (n_scored,)
        (grad,) = torch.autograd.grad(nll.sum(), mask)
        return nll, grad, final[-1]

    try:
        return Engine("cached", How("naive", "bridge", 1)).run(replayed, bridged)
    finally:
        handle.remove()


def _kl(model, lay, c: clean.Clean, x: torch.Tensor, nll: torch.Tensor) -> torch.Tensor:
    """KL (n_scored,) float64 from the clean distribution of `c`'s window, of the pass whose
    final residual is x (1, T, d_model) and NLL `nll`; NaN where the unembedding is hooked."""
    ref = c.reference(model, lay.softcap)
    if ref is None:
        return torch.full((c.nll.numel(),), float("nan"), dtype=torch.float64)
    with torch.inference_mode():
        kl = unembed.kl_given_nll(model, x.to(ref.h.dtype), c.chunk, c.window, nll, ref,
                                  lay.softcap)
    return kl.double().cpu()
