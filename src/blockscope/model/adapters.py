"""The HF side of each family, for the engine: with `arch.REGISTRY`, the one place that names
HF classes, attributes and config keys.

The plain replays (`sweeps.replay`, `sweeps.replay_rotary`) read a block through
TransformerLens's generic submodules (`ln1`, `ln2`, `attn.q/k/v/o` or `attn.qkv`,
`mlp.in/out/gate`: the adapters' `component_mapping` keys). What those do not carry (the
attention's scale and head width, the MLP's activation, the rotary function, the flags that
rule a replay out) is read here, per replay kind, and the engine's other HF facts (GELU
swap, cache objects, sliding-window layers) with them.
"""

from __future__ import annotations

import torch


def inner(module):
    """The HF module a TransformerLens bridge wraps (None for anything else)."""
    return getattr(module, "original_component", None)


def generic(block, path: str):
    """The HF module behind a block's generic submodule, e.g. `attn.q` or `mlp.in`; None
    where the adapter has no such submodule."""
    module = block
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return inner(module)


def gpt2_facts(block) -> dict | None:
    """What GPT-2's replay needs beyond the generic submodules (the scale, the head count,
    the MLP holding its activation), or None where the block is not the layout it reads:
    cross-attention, reordered or upcast attention."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Block

    hf, attn, mlp = inner(block), generic(block, "attn"), generic(block, "mlp")
    if not isinstance(hf, GPT2Block) or getattr(hf, "crossattention", None) is not None:
        return None
    if not isinstance(attn, GPT2Attention) or not isinstance(mlp, GPT2MLP):
        return None
    if attn.reorder_and_upcast_attn or attn.is_cross_attention:
        return None
    scale = attn.head_dim**-0.5  # as the bridge's attention, which always scales
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= float(attn.layer_idx + 1)
    return {"scale": scale, "n_heads": attn.num_heads, "mlp": mlp}


def rotary_facts(block, kind: str) -> dict | None:
    """What a Llama-family ("llama") or GPT-NeoX ("neox") replay needs beyond the generic
    submodules: head width, scale, the MLP's activation, the rotary function, and whether
    the halves run in parallel; None where the block is not that layout."""
    hf, attn, mlp = inner(block), generic(block, "attn"), generic(block, "mlp")
    if hf is None or attn is None or mlp is None:
        return None
    if kind == "llama":
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if set(hf._modules) != {"self_attn", "mlp", "input_layernorm",
                                "post_attention_layernorm"}:
            return None
        if set(attn._modules) != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return None
        facts = {"d_head": getattr(attn, "head_dim", None), "act": getattr(mlp, "act_fn", None),
                 "parallel": False}
    elif kind == "neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

        facts = {"d_head": getattr(attn, "head_size", None), "act": getattr(mlp, "act", None),
                 "parallel": getattr(hf, "use_parallel_residual", None)}
    else:
        return None
    facts.update(scale=getattr(attn, "scaling", None), rotary=apply_rotary_pos_emb)
    return None if None in facts.values() else facts


def fast_activations(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(the HF MLP, the activation to run in its place) for every block whose MLP runs
    GPT-2's NewGELUActivation (seven elementwise passes in Python): transformers' GELUTanh,
    torch's fused tanh GELU, the same function to float rounding and faster
    (docs/performance.md, "Design choices, measured")."""
    from transformers.activations import GELUTanh, NewGELUActivation

    found = []
    for block in model.blocks:
        mlp = inner(block.mlp)
        if isinstance(getattr(mlp, "act", None), NewGELUActivation):
            found.append((mlp, GELUTanh()))
    return found


def is_cache(value) -> bool:
    """Whether a recorded block argument is an HF key/value cache object (never replayed)."""
    return type(value).__name__.endswith("Cache")


def replayable_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's call as a forward pre-hook sees it, for calling the block again: the
    arguments after the hidden states, any K/V cache dropped (replays never append to
    it), and `use_cache=False`."""
    def keep(v):
        return None if is_cache(v) else v

    return (tuple(keep(a) for a in args[1:]),
            {**{k: keep(v) for k, v in kwargs.items()}, "use_cache": False})


def block_kind(model, j: int) -> tuple:
    """What may make block j compute differently from another: its HF class and, where the
    config or its attention says so, its attention type (sliding or global)."""
    from blockscope.model.arch import hf_config

    config = hf_config(model)
    types = (getattr(config, "layer_types", None) or getattr(config, "attention_layers", None)
             or [])
    block = model.blocks[j]
    attn = inner(block.attn)
    return (type(getattr(block, "original_component", block)).__name__,
            types[j] if j < len(types) else None,
            getattr(attn, "sliding_window", None), getattr(attn, "is_sliding", None))
