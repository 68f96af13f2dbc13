"""The final norm and unembedding, scored without materialising the logits.

`final_nll` scores a batch of final residuals for the engine's sweeps: the logits of a block
of rows against a chunk of the vocabulary at a time, with a running logsumexp (the bridge's
unembed when that is hooked). `ChunkedNLL` is the same for the pruning curve's gradient
pass: differentiable in the residual, with the weights frozen. Final-logit softcapping
(Gemma2) is applied wherever a logit is formed (`softcapped`).

With a `Reference` (the clean distribution at the same positions) `final_nll` also gives
each row's KL(p_clean || p_variant), in the same vocabulary chunks:

    KL = sum_v p_c(v) (z_c(v) - z(v)) + lse - lse_c,

and where the logits are linear in the normed residual h (no softcap), sum_v p_c(v) z(v) =
h . E_c[W] + E_c[b], so KL = (h_c - h) . E_c[W] + lse - lse_c: E_c[W] (n, d_model) is
computed once per window and a variant's KL costs a dot product per row. With a softcap
the clean logits are formed again beside each chunk of the variant's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockscope.inputs.text import Window
from blockscope.sweeps.naive import nll_from_logits


class ChunkedNLL(torch.autograd.Function):
    """NLL (R,) of h (R, d_model) @ weight.T (+ bias) at `targets`, differentiable in h only
    (the weights are frozen): the logits in the blocks `_logsumexp` uses (at the machine's
    matmul rate), kept for the backward, which forms softmax - onehot block by block in
    place (faster than log_softmax's backward, to 2e-6 of it: docs/performance.md's
    "Design choices, measured")."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets):
        blocks = []
        lse = _logsumexp(h, weight, bias, None, keep=blocks)  # (R,)
        ctx.save_for_backward(weight, targets, lse)
        ctx.blocks = blocks
        return lse - _target_logits(h, weight, bias, targets, None).double()

    @staticmethod
    def backward(ctx, grad_out):
        weight, targets, lse = ctx.saved_tensors
        blocks, ctx.blocks = ctx.blocks, None
        lse, grad_out = lse.float(), grad_out.float()  # the float32 softmax is exact enough
        grad = weight.new_zeros(grad_out.shape[0], weight.shape[1])  # (R, d_model)
        for part, s in zip(blocks, range(0, weight.shape[0], VOCAB_CHUNK), strict=True):
            p = part.sub_(lse[:, None]).exp_().mul_(grad_out[:, None])  # softmax * grad_out
            grad.addmm_(p, weight[s : s + VOCAB_CHUNK])
        grad -= grad_out[:, None] * weight[targets]  # the target logit's own term
        return grad, None, None, None


VOCAB_CHUNK = 1024  # unembedding rows per matmul; with ROW_BLOCK rows, a 4 MB logits block:
#   the shape that runs at the machine's large-matmul rate (docs/performance.md, "Design
#   choices, measured")


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit softcapping (Gemma2): cap * tanh(logits / cap); unchanged without a cap."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


@dataclass
class Reference:
    """The clean next-token distribution at a window's scored positions, as the KL needs it
    (see the module docstring)."""

    h: torch.Tensor  # (n, d_model) the clean normed residual of each predicting position
    lse: torch.Tensor  # (n,) float64 logsumexp of the clean logits
    mean_w: torch.Tensor | None  # (n, d_model) float64 E_{p_clean}[W_v]; None with a softcap


def linear_of(model):
    """The unembedding's nn.Linear, or None where it cannot be read directly (hooked)."""
    unembed = model.unembed
    linear = getattr(unembed, "original_component", None)
    if (not isinstance(linear, torch.nn.Linear) or unembed.hook_in.has_hooks()
            or unembed.hook_out.has_hooks()):
        return None
    return linear


def reference(model, x: torch.Tensor, w: Window, softcap: float | None = None
              ) -> Reference | None:
    """The clean distribution at window `w`'s scored positions from its final residual x
    (1, T, d_model); None where the unembedding is hooked (the engine then reports no KL:
    NaN)."""
    linear = linear_of(model)
    if linear is None:
        return None
    with torch.inference_mode():
        h = model.ln_final(x)[0, w.offset - 1 : -1]  # (n, d_model)
        weight, bias = linear.weight, linear.bias
        if softcap is not None:
            lse = torch.cat([_logsumexp(h[r : r + ROW_BLOCK], weight, bias, softcap)
                             for r in range(0, h.shape[0], ROW_BLOCK)])  # (n,)
            return Reference(h, lse, None)
        # one pass over the vocabulary: a running max, the sum of exponentials and their
        # weighted sum of rows of W, rescaled as the max grows (float64 accumulators)
        top = torch.full((h.shape[0],), -torch.inf, dtype=torch.float64, device=h.device)
        total = torch.zeros_like(top)
        acc = torch.zeros(h.shape, dtype=torch.float64, device=h.device)  # (n, d_model)
        for s in range(0, weight.shape[0], VOCAB_CHUNK):
            rows = weight[s : s + VOCAB_CHUNK]
            z = h @ rows.T  # (n, chunk)
            if bias is not None:
                z += bias[s : s + VOCAB_CHUNK]
            new = torch.maximum(top, z.amax(-1).double())
            scale = torch.exp(top - new)  # (n,)
            p = z.float().sub_(new.float()[:, None]).exp_()  # exp(z - running max)
            total = total * scale + p.sum(-1, dtype=torch.float64)
            acc = acc * scale[:, None] + (p @ rows.float()).double()
            top = new
        lse, mean_w = top + total.log(), acc / total[:, None]
    return Reference(h, lse, mean_w)


def clean_nll(model, ref: Reference, chunk: torch.Tensor, w: Window,
              softcap: float | None = None) -> torch.Tensor:
    """The clean NLL (n_scored,) from its own Reference: lse - the target's logit (the
    logsumexp pass the Reference made is the only one)."""
    linear = linear_of(model)
    return ref.lse - _target_logits(ref.h, linear.weight, linear.bias, chunk[0, w.offset:],
                                    softcap).double()


def kl_given_nll(model, x: torch.Tensor, chunk: torch.Tensor, w: Window, nll: torch.Tensor,
                 ref: Reference, softcap: float | None = None) -> torch.Tensor:
    """KL (n_scored,) from `ref` of a pass already scored: its final residual x (1, T,
    d_model) and its NLL (n_scored,). With linear logits its lse is NLL + the target's logit
    (no pass over the vocabulary); with a softcap, `final_nll` again."""
    if ref.mean_w is None:
        return final_nll(model, x, chunk, w, softcap, ref)[1][0]
    linear = linear_of(model)
    h = model.ln_final(x)[0, w.offset - 1 : -1]  # (n, d_model)
    lse = nll.double() + _target_logits(h, linear.weight, linear.bias, chunk[0, w.offset:],
                                        None).double()
    return _linear_kl(ref, h, lse)


def _linear_kl(ref: Reference, h: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """KL (..., n) = (h_c - h) . E_c[W] + lse - lse_c, for rows h (..., n, d_model) whose
    logits' logsumexp is `lse` (..., n): logits linear in h."""
    return ((ref.h.double() - h.double()) * ref.mean_w).sum(-1) + lse - ref.lse


def final_nll(model, x: torch.Tensor, chunk: torch.Tensor, w: Window,
              softcap: float | None = None, ref: Reference | None = None):
    """NLL (B, n_scored) from final residuals `x` (B, T, d_model): ln_final, then the
    unembedding of all B x n_scored positions at once in vocabulary chunks with a running
    logsumexp, never materialising T x d_vocab logits; `softcap` as the layout says. Falls
    back to the bridge's own unembed, one element at a time, when hooks sit on it.

    With `ref` (the clean distribution, `reference`): (NLL, KL from it), both (B, n_scored)."""
    normed = model.ln_final(x)  # (B, T, d_model)
    linear = linear_of(model)
    if linear is None:
        logits = [softcapped(model.unembed(n[None])[0], softcap) for n in normed]
        nll = torch.stack([nll_from_logits(g, chunk, w) for g in logits])
        # a hooked unembedding: the KL is not read off it (NaN, the column says so)
        return nll if ref is None else (nll, torch.full_like(nll, float("nan")))
    lo = w.offset
    B, n = normed.shape[0], normed.shape[1] - lo
    h = normed[:, lo - 1 : -1].reshape(B * n, -1)  # (B n_scored, d_model): predicting rows
    targets = chunk[0, lo:].repeat(B)  # (B n_scored,)
    weight, bias = linear.weight, linear.bias  # (d_vocab, d_model), (d_vocab,) or None
    cross = [] if ref is not None and ref.mean_w is None else None  # sum_v p_c z, softcapped
    lse = torch.cat([_logsumexp(h[r : r + ROW_BLOCK], weight, bias, softcap,
                                ref=None if cross is None else _rows(ref, r, n, h),
                                cross=cross)
                     for r in range(0, h.shape[0], ROW_BLOCK)])  # (B n_scored,)
    nll = (lse - _target_logits(h, weight, bias, targets, softcap).double()).view(B, n)
    if ref is None:
        return nll
    if cross is None:  # linear logits
        return nll, _linear_kl(ref, h.view(B, n, -1), lse.view(B, n))
    own: list = []  # sum_v p_c z_c: the clean rows' own term
    _logsumexp(ref.h, weight, bias, softcap, ref=(ref.h, ref.lse), cross=own)
    return nll, (own[0] - torch.cat(cross).view(B, n)) + lse.view(B, n) - ref.lse


def _rows(ref: Reference, r: int, n: int, h: torch.Tensor):
    """The clean rows matching rows r.. r+ROW_BLOCK of the (B n, d_model) batch."""
    pos = torch.arange(r, min(r + ROW_BLOCK, h.shape[0]), device=h.device) % n
    return ref.h[pos], ref.lse[pos]


def _target_logits(h, weight, bias, targets, softcap) -> torch.Tensor:
    """The logit of each row's target (R,), softcapped, without the full logits."""
    target = (h * weight[targets]).sum(-1)
    if bias is not None:
        target = target + bias[targets]
    return softcapped(target, softcap)


ROW_BLOCK = 1024  # rows per unembedding pass (see VOCAB_CHUNK); blocks, not all rows at once
#   (faster on the CPU: docs/performance.md, "Design choices, measured")


def _logsumexp(h: torch.Tensor, weight: torch.Tensor, bias, softcap,
               keep: list | None = None, ref=None, cross: list | None = None) -> torch.Tensor:
    """logsumexp (R,) float64 over the vocabulary of h (R, d_model) @ weight.T (+ bias),
    softcapped, one VOCAB_CHUNK at a time: float32 logits, a running max and a float64 sum
    of their exponentials (as `naive.nll_of`), the chunk exponentiated in place (no
    temporaries the size of the chunk), or, with `keep`, each chunk's logits appended to it
    and a copy exponentiated. With `ref` = (clean rows (R, d_model), their lse (R,)) the
    sum over the vocabulary of p_clean x these logits (R,) float64 is appended to `cross`."""
    top = total = None
    mixed = None if ref is None else torch.zeros(h.shape[0], dtype=torch.float64,
                                                 device=h.device)
    for s in range(0, weight.shape[0], VOCAB_CHUNK):
        part = h @ weight[s : s + VOCAB_CHUNK].T  # (R, chunk)
        if bias is not None:
            part += bias[s : s + VOCAB_CHUNK]
        part = softcapped(part, softcap).float()
        if ref is not None:  # p_clean on this chunk, from the clean rows' own logits
            z = ref[0] @ weight[s : s + VOCAB_CHUNK].T
            if bias is not None:
                z += bias[s : s + VOCAB_CHUNK]
            p = (softcapped(z, softcap).double() - ref[1][:, None]).exp()
            mixed += (p * part.double()).sum(-1)
        m = part.amax(-1)  # (R,)
        if keep is not None:
            keep.append(part)
            part = part - m[:, None]
        else:
            part.sub_(m[:, None])
        here = part.exp_().sum(-1, dtype=torch.float64)  # (R,)
        if top is None:
            top, total = m, here
        else:
            new = torch.maximum(top, m)
            total = total * torch.exp(top - new).double() + here * torch.exp(m - new).double()
            top = new
    if cross is not None:
        cross.append(mixed)
    return top.double() + total.log()
