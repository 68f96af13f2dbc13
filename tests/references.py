"""The tests' independent references, written against plain HF models (never blockscope's
code): HF's perplexity and KL, HF's sliding-window perplexity, each family's layers and the
modules that write to its stream, hooks that replace a module's input or output, and the
residual stream read by HF module hooks. Test modules import these, never each other."""

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


# --- interchange interventions on plain HF models (patching, causal tracing, knockout) ---

def hf_modules(hf) -> dict:
    """The HF modules a site names, per family: each layer's block, attention and MLP, the
    attention's output projection (its input is every head's z side by side), the token
    embedding."""
    kind = hf.config.model_type
    if kind == "gpt2":
        layers = hf.transformer.h
        return dict(layers=layers, attn=[b.attn for b in layers], mlp=[b.mlp for b in layers],
                    o=[b.attn.c_proj for b in layers], embed=hf.transformer.wte)
    if kind == "gpt_neox":
        layers = hf.gpt_neox.layers
        return dict(layers=layers, attn=[b.attention for b in layers],
                    mlp=[b.mlp for b in layers], o=[b.attention.dense for b in layers],
                    embed=hf.gpt_neox.embed_in)
    layers = hf.model.layers
    return dict(layers=layers, attn=[b.self_attn for b in layers], mlp=[b.mlp for b in layers],
                o=[b.self_attn.o_proj for b in layers], embed=hf.model.embed_tokens)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def hf_run(hf, tokens, hooks, position: int = -1) -> torch.Tensor:
    """The logits (B, d_vocab) at `position` with `hooks` on: (module, "pre" or "out", fn)
    where fn(tensor) returns the tensor to use (a block's or projection's input for "pre",
    a module's output for "out")."""
    handles = []
    for module, when, fn in hooks:
        if when == "pre":
            def pre(m, args, kwargs, fn=fn):
                if args:
                    return (fn(args[0].clone()), *args[1:]), kwargs
                key = "hidden_states" if "hidden_states" in kwargs else "input"
                return args, {**kwargs, key: fn(kwargs[key].clone())}

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(m, args, out, fn=fn):
                if isinstance(out, tuple):
                    return (fn(out[0].clone()), *out[1:])
                return fn(out.clone())

            handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            return hf(tokens, use_cache=False).logits[:, position].double()
    finally:
        for h in handles:
            h.remove()


def hf_capture(hf, tokens, module, when: str = "out", hooks=()) -> torch.Tensor:
    """What `module` received ("pre") or gave ("out") in a forward of `tokens`."""
    kept = {}

    def keep(t):
        kept["t"] = t.clone()
        return t

    hf_run(hf, tokens, [*hooks, (module, when, keep)])
    return kept["t"]


def hf_knockout_mask_hook(T: int, keys) -> callable:
    """A pre-hook that hands an attention module a 4-D additive mask: causal, and the last
    query may not see `keys` (Geva et al.'s knockout, written as their mask)."""
    def pre(m, args, kwargs):
        mask = torch.full((T, T), float("-inf")).triu(1)
        mask[-1, list(keys)] = float("-inf")
        return args, {**kwargs, "attention_mask": mask[None, None]}

    return pre


# Per family, under each decoder layer: the module whose output is attention's write to the
# stream, the MLP's write, and attention's output projection (its input: the heads' z).
# Bloom's attention and MLP add the residual themselves, after `dense`/`dense_4h_to_h`.
WRITES = {
    "gpt2": ("attn.c_proj", "mlp.c_proj", "attn.c_proj"),
    "gpt_neo": ("attn.attention.out_proj", "mlp.c_proj", "attn.attention.out_proj"),
    "gpt_neox": ("attention.dense", "mlp.dense_4h_to_h", "attention.dense"),
    "gptj": ("attn.out_proj", "mlp.fc_out", "attn.out_proj"),
    "opt": ("self_attn.out_proj", "fc2", "self_attn.out_proj"),
    "bloom": ("self_attention.dense", "mlp.dense_4h_to_h", "self_attention.dense"),
    "falcon": ("self_attention.dense", "mlp.dense_4h_to_h", "self_attention.dense"),
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.o_proj"),
    "gemma3": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.o_proj"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.o_proj"),
    "phi": ("self_attn.dense", "mlp.fc2", "self_attn.dense"),
    "gpt_bigcode": ("attn.c_proj", "mlp.c_proj", "attn.c_proj"),
}
LLAMA_LIKE = ("self_attn.o_proj", "mlp.down_proj", "self_attn.o_proj")
MOE = ("self_attn.o_proj", "mlp", "self_attn.o_proj")  # the whole sparse-MoE block's output


def writes(family):
    return WRITES.get(family, MOE if family == "mixtral" else LLAMA_LIKE)


def layers(hf):
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod = hf
        try:
            for part in path.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        return list(mod)
    raise AssertionError("no decoder layers found")


def output_hook(module, fn):
    """(module, register): replace the module's (first) output by fn(output, inputs)."""

    def hook(mod, args, kwargs, out):
        first = out[0] if isinstance(out, tuple) else out
        x = args[0] if args else kwargs["hidden_states"]
        new = fn(first, x)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return module, lambda m: m.register_forward_hook(hook, with_kwargs=True)


def input_hook(module, fn):
    """(module, register): replace the module's first input by fn(input)."""

    def hook(mod, args):
        return (fn(args[0]), *args[1:])

    return module, lambda m: m.register_forward_pre_hook(hook)


def sub(layer, path):
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


PATHS = {"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}


def hf_ppl(model, ids) -> float:
    with torch.inference_mode():
        return math.exp(float(model(ids, labels=ids, use_cache=False).loss))


def hf_kl(clean, model, ids) -> float:
    """Mean over the scored tokens of KL(p_clean || p_model), from both HF models' logits
    (torch's kl_div, float64)."""
    with torch.inference_mode():
        p, q = (m(ids, use_cache=False).logits[0, :-1].double().log_softmax(-1)
                for m in (clean, model))
    return float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum")) / len(p)
