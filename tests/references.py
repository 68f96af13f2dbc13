"""The tests' independent references, written against plain HF models (never blockscope's
code): HF's sliding-window perplexity and the residual stream read by HF module hooks."""

import math

import torch


def hf_sliding_sum(model, ids, n_ctx, stride) -> tuple[float, int]:
    """HF's perplexity guide, with the loss summed exactly over scored tokens: (sum, count)."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + n_ctx, ids.shape[1])
        trg_len = end - prev_end
        labels = ids[:, begin:end].clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(ids[:, begin:end], labels=labels, use_cache=False).loss
        n = int((labels[:, 1:] != -100).sum())
        total, count, prev_end = total + loss.item() * n, count + n, end
        if end == ids.shape[1]:
            break
    return total, count


def hf_sliding_ppl(model, ids, n_ctx, stride) -> float:
    total, count = hf_sliding_sum(model, ids, n_ctx, stride)
    return math.exp(total / count)


def hf_stream(hf, ids):
    """Per block: (input, after attention, output), from HF hooks, not blockscope's."""
    records = []
    handles = []
    for block in hf.transformer.h:
        rec = {}
        records.append(rec)
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k, rec=rec: rec.__setitem__("in", a[0]), with_kwargs=True))
        handles.append(block.attn.register_forward_hook(
            lambda m, a, o, rec=rec: rec.__setitem__("attn", o[0])))
        handles.append(block.register_forward_hook(
            lambda m, a, o, rec=rec: rec.__setitem__("out", o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        for h in handles:
            h.remove()
    return hidden, records
