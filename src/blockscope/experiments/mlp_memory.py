"""The MLP as a key-value memory (Geva et al. 2020, 2022), on one prompt.

Each MLP neuron n of a layer has a key (what activates it: its row of W_in, or of the gate
and up projections where the MLP is gated) and a value (its row of W_out, the down
projection's column): the MLP writes sum_n act_n * value_n + b_out. So a neuron's direct
contribution to the target's logit is act_n times its value's direct logit, through the
final norm with its scale frozen at the clean pass (as `logit_lens.attribution`).

- `neurons`: for the MLP layers that write most toward the target, the neurons that add
  most; each value's most promoted and suppressed tokens through the unembedding (Geva
  2022); and the check the article implies: remove those neurons (`scale_neurons`, zero or
  their clean mean over the prompt) and see the target's probability fall, or not.
Where a norm follows the MLP (Gemma2, OLMo 2) a neuron's write is not linear in the stream,
and where the MLP adds the residual itself (BLOOM) its write is not its own: both refused.
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.logit_lens import _centre, _frozen_readout, attribution, frozen_gain
from blockscope.inputs.text import token_text
from blockscope.interventions import applied, hooks, scale_neurons
from blockscope.model.arch import layout

SUM_REL = 1e-4  # the neurons' writes must add up to the MLP's own, relative


# What a neuron's contribution is, for the sidecar.
CONTRIBUTION = ("activation x the value's direct logit, through the final norm with its scale "
                "frozen at the clean pass (as logit-lens)")


@torch.inference_mode()
def neurons(model, tokens: torch.Tensor, *, position: int, target: int,
            contrast: int | None = None, n_layers: int = 3, per_layer: int = 5,
            k: int = 5, method: str = "zero") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(layers, neurons). `layers`: the `n_layers` MLPs with the largest direct
    contribution to the target's logit (minus the contrast's): `layer, contribution,
    share_of_logit, top_share` (the chosen neurons' part of it). `neurons`: per such layer
    the `per_layer` neurons adding most: `layer, neuron, activation, value_logit` (per unit
    of activation), `contribution, share_of_layer, promotes, suppresses` (the top-k tokens
    of the neuron's write here, the value signed by its activation, through the final
    norm's gain and the unembedding; "|"-joined), `target_rank` (the target's rank in that
    reading: is the answer what the value promotes?). attrs: the target's probability before
    and after removing all chosen neurons at once (`method` zero or mean)."""
    lay = layout(model)
    if lay.post_norms:
        raise BlockscopeError(f"{lay.family}: a norm follows each MLP, so a neuron's write "
                              "is not linear in the stream; mlp-memory's neurons are refused")
    if not lay.mlp_alone:
        raise BlockscopeError(f"{lay.family}: the MLP adds the residual itself, so a "
                              "neuron's write is not its own; refused")
    if method not in ("zero", "mean"):
        raise BadValue("`method` must be zero or mean")
    attrs = attribution(model, tokens, position=position, target=target, contrast=contrast)
    mlps = attrs[(attrs["level"] == "block") & (attrs["half"] == "mlp")]
    chosen = mlps.sort_values("contribution", ascending=False, kind="stable").head(n_layers)
    names = {f"blocks.{int(la)}.mlp.out.hook_in" for la in chosen["layer"]}
    with torch.inference_mode():
        logits, cache = model.run_with_cache(
            tokens.to(model.cfg.device), return_type="logits",
            names_filter=lambda n: n in names or n == "ln_final.hook_scale")
    direction, _ = _frozen_readout(model, cache, position, target, contrast)
    W_U = model.unembed.original_component.weight.double()  # (d_vocab, d_model)
    gain = frozen_gain(model, cache, position)  # (d_model,)
    rows, removed = [], []
    for r in chosen.itertuples():
        layer = int(r.layer)
        mlp = model.blocks[layer].mlp
        act = cache[f"blocks.{layer}.mlp.out.hook_in"][0, position].double()  # (d_mlp,)
        W_out = mlp.W_out.double()  # (d_mlp, d_model): each row a neuron's value
        values = torch.stack([_centre(model, v) for v in W_out]) @ direction  # (d_mlp,)
        contrib = act * values
        b_out = mlp.b_out
        bias = 0.0 if b_out is None else float(_centre(model, b_out.double()) @ direction)
        if abs(float(contrib.sum()) + bias - r.contribution) > SUM_REL * max(
                1.0, abs(r.contribution)):
            raise BlockscopeError(f"block {layer}'s neurons do not add up to its MLP's "
                                  "write here; refusing a wrong split")
        top = contrib.topk(per_layer).indices
        removed.append((layer, top))
        for n in top.tolist():
            sign = 1.0 if act[n] >= 0 else -1.0  # a gated MLP's activation may be negative:
            readout = sign * (W_U @ (gain * _centre(model, W_out[n])))  # its write's reading
            rows.append({
                "layer": layer, "neuron": n, "activation": float(act[n]),
                "value_logit": float(values[n]), "contribution": float(contrib[n]),
                "share_of_layer": float(contrib[n]) / r.contribution if r.contribution else None,
                "promotes": "|".join(token_text(model.tokenizer, i)
                                     for i in readout.topk(k).indices.tolist()),
                "suppresses": "|".join(token_text(model.tokenizer, i)
                                       for i in (-readout).topk(k).indices.tolist()),
                "target_rank": int((readout > readout[target]).sum()) + 1})
    df = pd.DataFrame(rows)
    layers = chosen[["layer", "contribution"]].assign(
        layer=chosen["layer"].astype(int),
        share_of_logit=chosen["contribution"] / attrs.attrs["logit"],
        top_share=[df[df["layer"] == int(la)]["contribution"].sum() / c if c else None
                   for la, c in zip(chosen["layer"], chosen["contribution"], strict=True)])
    df.attrs.update(_removal(model, tokens, cache, position, target, removed, method))
    return layers.reset_index(drop=True), df


def _removal(model, tokens, cache, position: int, target: int, removed, method: str) -> dict:
    """The target's probability at `position`, clean and with every chosen neuron removed
    (their activation zeroed, or set to its mean over the prompt's positions)."""
    edits = []
    for layer, idx in removed:
        fill = None
        if method == "mean":
            fill = cache[f"blocks.{layer}.mlp.out.hook_in"][0][:, idx].mean(0)  # (k,)
        edits.append(scale_neurons(layer, idx, fill))
    ids = tokens.to(model.cfg.device)
    with torch.inference_mode():
        before = model(ids, return_type="logits")[0, position].float().softmax(-1)[target]
        with applied(model, hooks(edits)):
            after = model(ids, return_type="logits")[0, position].float().softmax(-1)[target]
    return {"prob_before": float(before), "prob_after": float(after), "method": method,
            "n_removed": sum(len(idx) for _, idx in removed)}


@torch.inference_mode()
def triggers(model, docs, picks: list[tuple[int, int, float]], *, n_examples: int = 5,
             stride: int | None = None, width: int = 12) -> pd.DataFrame:
    """Each neuron's keys (Geva et al. 2020's trigger examples): the `n_examples` corpus
    positions where `picks` [(layer, neuron, sign)] fire most (sign x activation: a gated
    MLP's neuron may write through negative activations), over every document's tokens but
    its first, each position read once (windows as the sweeps'). Streams the documents,
    keeping only a top-k heap per neuron. Rows: `layer, neuron, rank, activation, doc,
    position, trigger, context` (the `width` tokens up to and including the trigger)."""
    import heapq

    from blockscope.inputs.corpus import as_docs
    from blockscope.sweeps.naive import model_windows

    docs = as_docs(docs)
    layers = sorted({la for la, _, _ in picks})
    names = {f"blocks.{la}.mlp.out.hook_in" for la in layers}
    heaps: dict[tuple[int, int], list] = {(la, n): [] for la, n, _ in picks}
    by_layer = {la: [(n, s) for la2, n, s in picks if la2 == la] for la in layers}
    for d, ids in zip(docs.index, docs.ids, strict=True):
        for w in model_windows(model, ids, stride):
            chunk = ids[:, w.begin:w.end].to(model.cfg.device)
            _, cache = model.run_with_cache(chunk, return_type=None,
                                            names_filter=lambda n: n in names)
            lo = w.offset  # positions first read here (a document's first never)
            for la in layers:
                acts = cache[f"blocks.{la}.mlp.out.hook_in"][0, lo:]  # (t, d_mlp)
                for n, s in by_layer[la]:
                    heap = heaps[(la, n)]
                    for j, a in enumerate((s * acts[:, n]).float().tolist()):
                        item = (a, -d, -(w.begin + lo + j))
                        if len(heap) < n_examples:
                            heapq.heappush(heap, item)
                        elif item > heap[0]:
                            heapq.heapreplace(heap, item)
            del cache
    text = {d: ids[0] for d, ids in zip(docs.index, docs.ids, strict=True)}
    rows = []
    for (la, n), heap in heaps.items():
        s = next(s for la2, n2, s in picks if (la2, n2) == (la, n))
        for rank, (a, d, p) in enumerate(sorted(heap, reverse=True), 1):
            d, p = -d, -p
            ids = text[d][max(0, p - width + 1): p + 1].tolist()
            rows.append({"layer": la, "neuron": n, "rank": rank, "activation": s * a,
                         "doc": d, "position": p,
                         "trigger": token_text(model.tokenizer, ids[-1]),
                         "context": model.tokenizer.decode(ids)})
    return pd.DataFrame(rows)
