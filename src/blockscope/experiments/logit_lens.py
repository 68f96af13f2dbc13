"""What each point of the stream already predicts, and what each component writes toward
the answer: the logit lens (nostalgebraist 2020) and direct logit attribution (Elhage et
al. 2021), on one prompt.

- `lens`: at every point of the residual stream (the embeddings, each block's mid point
  where it has one, each block's output) the model's own final norm and unembedding, as if
  the stream ended there: top-k tokens, the target's rank, probability and logit, and the
  KL divergence of the model's final distribution from the lens's. At the last point the
  lens is the model's output, exactly (checked). Early points are read in a basis the model
  was never trained to be read in there: a lens, not what the model "thinks".
- `attribution`: each component's direct contribution to the target's logit (or to the
  difference against a contrast token): the embeddings, each block's attention half and
  each of its heads, each MLP, and the biases. The final norm is applied with its scale
  frozen at the clean pass (its `hook_scale`), as TransformerLens's `logit_attrs` does, so
  the contributions are linear and sum to the logit.
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.inputs.text import token_text
from blockscope.model.arch import layout, stream_points
from blockscope.sweeps.unembed import softcapped

SUM_REL = 1e-5  # the stream must be the sum of its writes to this (float32)


def _cache(model, tokens):
    names = {n for n, _, _ in stream_points(layout(model), model.cfg.n_layers)}
    n = model.cfg.n_layers
    names |= {f"blocks.{i}.{p}" for i in range(n) for p in ("hook_attn_out", "hook_mlp_out",
                                                             "attn.hook_z")}
    names |= {f"blocks.{n - 1}.hook_resid_post", "ln_final.hook_scale"}
    with torch.inference_mode():
        logits, cache = model.run_with_cache(tokens.to(model.cfg.device), return_type="logits",
                                             names_filter=lambda name: name in names)
    return logits[0].float(), cache


def _unembed(model, x: torch.Tensor) -> torch.Tensor:
    """The model's own final norm and unembedding (and softcap) on residuals x (..., d)."""
    return softcapped(model.unembed(model.ln_final(x)).float(), layout(model).softcap)


# How `attribution` reads the final norm, for the sidecar.
ATTRIBUTION_MEANS = {
    "final_norm": "scale frozen at the clean pass (ln_final.hook_scale), as TransformerLens's "
    "logit_attrs; each write centred first where the norm is a LayerNorm",
    "softcap": "attributes the logit before any final softcapping"}


def target_id(tokenizer, text: str, option: str = "target") -> int:
    """The one token `text` is, or a refusal naming how many it is (`option`: the
    parameter it came in)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise BadValue(f"`{option}` {text!r} is {len(ids)} tokens of this model's "
                       "tokenizer, not one (mind the leading space: ' Paris')")
    return ids[0]


def lens(model, tokens: torch.Tensor, *, positions: list[int], k: int = 5,
         target: int | None = None) -> pd.DataFrame:
    """One row per (stream point, position): `point, layer, position, token, top1..topk,
    p1..pk, target, target_id, target_rank, target_prob, target_logit, kl_from_final`
    (nats). The
    target: `target` (a token id), else the model's own top-1 at that position."""
    logits, cache = _cache(model, tokens)
    points = stream_points(layout(model), model.cfg.n_layers)
    last = points[-1][0]
    with torch.inference_mode():
        if not torch.equal(_unembed(model, cache[last][0]), logits):
            raise BlockscopeError("the lens at the last point is not the model's own output "
                                  "here (the final norm or unembedding is not what the "
                                  "bridge runs): refusing rather than showing a lens")
        final = logits.double().log_softmax(-1)  # (T, d_vocab), float64 for the KL
        rows = []
        for name, layer, label in points:
            raw = _unembed(model, cache[name][0, positions])  # (P, d_vocab)
            lp = raw.double().log_softmax(-1)
            for j, pos in enumerate(positions):
                t = int(final[pos].argmax()) if target is None else target
                top = lp[j].topk(k)
                row = {"point": label, "layer": layer, "position": pos,
                       "token": token_text(model.tokenizer, int(tokens[0, pos]))}
                for i, (p, tok) in enumerate(zip(top.values.exp().tolist(),
                                                 top.indices.tolist(), strict=True), 1):
                    row[f"top{i}"], row[f"p{i}"] = token_text(model.tokenizer, tok), p
                row.update(
                    target=token_text(model.tokenizer, t), target_id=t,
                    target_rank=int((lp[j] > lp[j, t]).sum()) + 1,
                    target_prob=float(lp[j, t].exp()), target_logit=float(raw[j, t]),
                    kl_from_final=float((final[pos].exp() * (final[pos] - lp[j])).sum()))
                rows.append(row)
    return pd.DataFrame(rows)


def attribution(model, tokens: torch.Tensor, *, position: int, target: int,
                contrast: int | None = None) -> pd.DataFrame:
    """One row per component: `level` ("block": embeddings, each attention half and MLP,
    the biases; "head": each head and each layer's attention bias, in place of the halves),
    `component, layer, head, half, contribution` to the target's logit (minus the
    contrast's). Components are named as the lens's points ("block 24 mlp": counted from
    1), heads as head-roles names them ("head 23.5": layer.head from 0); `layer` counts from
    0. Each goes through the final norm with its scale frozen at the clean pass.

    Each level sums to the logit (difference) the model gives (before a final softcap,
    which is not linear: Gemma2's), to SUM_REL relative; a model
    whose stream is not the sum of its writes (a block whose MLP adds the residual itself)
    is refused. Heads only where each head's write is linear (no post-sublayer norm)."""
    lay = layout(model)
    n = model.cfg.n_layers
    logits, cache = _cache(model, tokens)
    pos = position
    with torch.inference_mode():
        x = cache[f"blocks.{n - 1}.hook_resid_post"][0, pos].double()  # (d_model,)
        parts = [("embeddings", None, None, "embeddings",
                  cache["blocks.0.hook_resid_pre"][0, pos].double())]
        for i in range(n):
            parts.append((f"block {i} attn", i, None, "attn",
                          cache[f"blocks.{i}.hook_attn_out"][0, pos].double()))
            parts.append((f"block {i} mlp", i, None, "mlp",
                          cache[f"blocks.{i}.hook_mlp_out"][0, pos].double()))
        written = sum(p[-1] for p in parts)
        if float((written - x).norm() / x.norm()) > SUM_REL:
            raise BlockscopeError(f"{lay.family}: the final residual is not the sum of the "
                                  "embeddings and each half's write here, so a direct logit "
                                  "attribution would not add up; refusing")
        direction, const = _frozen_readout(model, cache, pos, target, contrast)
        rows = [{"level": "block", "component": c, "layer": la, "head": h, "half": half,
                 "contribution": float(_centre(model, v) @ direction)}
                for c, la, h, half, v in parts]
        rows.append({"level": "block", "component": "biases (final norm, unembedding)",
                     "layer": None, "head": None, "half": "bias", "contribution": const})
        if lay.linear_heads:
            rows += _head_rows(model, cache, pos, direction, rows)
    df = pd.DataFrame(rows)
    with torch.inference_mode():  # the logit before any final softcapping (Gemma2's)
        raw = model.unembed(model.ln_final(cache[f"blocks.{n - 1}.hook_resid_post"][0, pos]))
    raw = raw.double()
    want = float(raw[target] - (0 if contrast is None else raw[contrast]))
    for level, group in df.groupby("level"):
        got = group["contribution"].sum()
        if abs(got - want) > SUM_REL * max(1.0, abs(want)):
            raise BlockscopeError(f"the {level}-level attributions sum to {got:.6f}, the "
                                  f"model's logit is {want:.6f}: refusing a wrong split")
    df.attrs["logit"] = want
    df.attrs["softcap"] = lay.softcap  # the model's logit is cap * tanh(logit / cap) then
    return df


def _centre(model, v: torch.Tensor) -> torch.Tensor:
    """What the final norm does to a write before its scale: centre it (LayerNorm), or
    nothing (RMSNorm)."""
    return v if model.ln_final.uses_rms_norm else v - v.mean()


def _frozen_readout(model, cache, pos: int, target: int, contrast: int | None):
    """(direction (d_model,), constant): the final norm with its scale frozen and the
    unembedding, read along target (minus contrast): logit = centred(x) . direction + const."""
    ln = model.ln_final
    bias = getattr(ln.original_component, "bias", None)
    linear = model.unembed.original_component
    W = linear.weight.double()  # (d_vocab, d_model)
    row = W[target] - (0 if contrast is None else W[contrast])
    direction = frozen_gain(model, cache, pos) * row
    const = 0.0 if bias is None or ln.uses_rms_norm else float(bias.double() @ row)
    if linear.bias is not None:
        const += float(linear.bias[target] - (0 if contrast is None else linear.bias[contrast]))
    return direction, const


def frozen_gain(model, cache, pos: int) -> torch.Tensor:
    """The final norm's weight over its scale at `pos` in the clean pass (d_model,): with
    the scale frozen, the norm is centring (LayerNorm) then this gain, then its bias."""
    ln = model.ln_final
    scale = cache["ln_final.hook_scale"][0, pos].double()  # (1,)
    weight = ln.weight.double() + (1.0 if getattr(ln, "uses_weight_offset", False) else 0.0)
    return weight / scale


def _head_rows(model, cache, pos: int, direction: torch.Tensor, blocks: list) -> list:
    """Each head's z_h W_O[h] and each layer's b_O, in place of the attention halves; a
    layer whose heads do not sum to its attention write is left at the half."""
    rows = [dict(r, level="head") for r in blocks if r["half"] != "attn"]
    for i in range(model.cfg.n_layers):
        attn = model.blocks[i].attn
        z = cache[f"blocks.{i}.attn.hook_z"][0, pos].double()  # (n_heads, d_head)
        heads = torch.einsum("hd,hdm->hm", z, attn.W_O.double())  # (n_heads, d_model)
        b_O = attn.b_O.double() if attn.b_O is not None else torch.zeros_like(heads[0])
        whole = cache[f"blocks.{i}.hook_attn_out"][0, pos].double()
        if float((heads.sum(0) + b_O - whole).norm() / whole.norm().clamp_min(1e-30)) > 1e-4:
            rows.append(dict(next(r for r in blocks if r["layer"] == i and r["half"] == "attn"),
                             level="head"))
            continue
        for h in range(heads.shape[0]):
            rows.append({"level": "head", "component": f"head {i}.{h}", "layer": i,
                         "head": h, "half": "attn",
                         "contribution": float(_centre(model, heads[h]) @ direction)})
        rows.append({"level": "head", "component": f"block {i} attn bias", "layer": i,
                     "head": None, "half": "attn",
                     "contribution": float(_centre(model, b_O) @ direction)})
    return rows
