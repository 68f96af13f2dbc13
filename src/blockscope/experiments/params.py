"""Where the parameters live, counted from real module shapes, not formulas.

The model is built from its config on the `meta` device (shapes, no memory, no weights),
and every parameter is assigned to a component by its name. Tied parameters (GPT-2's
unembedding is its token embedding) are counted once, as PyTorch does.
"""

from __future__ import annotations

import re

import pandas as pd
import torch

from blockscope.errors import BadValue, BlockscopeError

BLOCK = re.compile(r"\.(?:h|layers|blocks|layer)\.(\d+)\.")
# Norms first: Llama's post_attention_layernorm is a norm, not attention.
# OPT's MLP is the layer's own fc1/fc2; Mixtral's experts sit under its `mlp`.
HALVES = (("layer norms", ("ln", "norm")), ("attention", ("attn", "attention")),
          ("MLP", ("mlp", "feed_forward", "ffn", "fc1", "fc2", "moe", "experts")))


def _head_overrides(config, n_heads: int) -> None:
    from blockscope.model.arch import config_get

    d_model = config_get(config, "d_model")
    if n_heads < 1:
        raise BadValue(f"`n_heads` must be at least 1 (got {n_heads})")
    if d_model % n_heads:
        raise BadValue(f"`n_heads` {n_heads} must divide d_model {d_model}")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None:  # grouped-query attention: keep the query heads per K/V head
        group = config.num_attention_heads // kv
        if n_heads % group:
            raise BadValue(
                f"`n_heads` {n_heads}: this model shares each K/V head among {group} query "
                f"heads, so the head count must be a multiple of {group}"
            )
        config.num_key_value_heads = n_heads // group
    if hasattr(config, "head_dim"):
        config.head_dim = d_model // n_heads
    config.num_attention_heads = n_heads  # GPT2Config maps n_head to this attribute


def _component(name: str) -> tuple[str, int | None]:
    m = BLOCK.search(name)
    if m is None:
        if re.search(r"wpe|position_embed|embed_positions", name):
            return "position embeddings", None
        if re.search(r"wte|embed_tokens|word_embed|embed_in", name):
            return "token embeddings", None
        if re.search(r"lm_head|embed_out|unembed", name):
            return "unembedding", None
        if re.search(r"ln_f|norm", name):
            return "final norm", None
        return "other", None
    rest = name[m.end():]
    for half, keys in HALVES:
        if any(k in rest.split(".")[0] for k in keys):
            kind = "biases" if name.endswith("bias") else "weights"
            return (f"{half} {kind}" if half != "layer norms" else half), int(m.group(1))
    return "block other", int(m.group(1))


def block_counts(config) -> tuple[list[int], int]:
    """Parameters of each block and of the whole model (tied ones once), from the config
    (a meta-device HF model: the bridge holds split copies of fused weights besides)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    counts: dict[int | None, int] = {}
    for name, p in model.named_parameters():
        layer = _component(name)[1]
        counts[layer] = counts.get(layer, 0) + p.numel()
    n = max(k for k in counts if k is not None) + 1
    return [counts.get(i, 0) for i in range(n)], sum(counts.values())


def parameter_counts(config, *, n_heads: int | None = None) -> pd.DataFrame:
    """Rows (component, scope, parameters, share_of_block, share_of_model) for one config."""
    from transformers import AutoModelForCausalLM

    config = type(config).from_dict(config.to_dict())  # never mutate the caller's config
    if n_heads is not None:
        _head_overrides(config, n_heads)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    counts: dict[tuple[str, int | None], int] = {}
    for name, p in model.named_parameters():  # tied parameters appear once
        key = _component(name)
        counts[key] = counts.get(key, 0) + p.numel()
    layers = sorted({layer for _, layer in counts if layer is not None})
    if not layers:
        raise BlockscopeError("no transformer blocks found in this architecture")

    def per_block(component: str) -> int:
        return counts.get((component, layers[0]), 0)

    d_model = model.get_input_embeddings().weight.shape[1]
    block_total = sum(v for (c, layer), v in counts.items() if layer == layers[0])
    total = sum(counts.values())
    rows = [("token embeddings", "model", counts.get(("token embeddings", None), 0)),
            ("position embeddings", "model", counts.get(("position embeddings", None), 0))]
    for half in ("attention", "MLP"):
        w, b = per_block(f"{half} weights"), per_block(f"{half} biases")
        rows += [(f"{half} weights", "per block", w), (f"{half} biases", "per block", b),
                 (half, "per block", w + b)]
    rows += [("layer norms", "per block", per_block("layer norms")),
             ("block other", "per block", per_block("block other")),
             ("block", "per block", block_total),
             (f"all {len(layers)} blocks", "model",
              sum(v for (_, layer), v in counts.items() if layer is not None)),
             ("final norm", "model", counts.get(("final norm", None), 0)),
             ("unembedding (untied)", "model", counts.get(("unembedding", None), 0)),
             ("other", "model", counts.get(("other", None), 0)),
             ("total", "model", total),
             ("12 d_model^2 shortcut", "per block", 12 * d_model**2)]
    df = pd.DataFrame(rows, columns=["component", "scope", "parameters"])
    df = df[(df["parameters"] != 0) | df["component"].isin(["position embeddings"])]
    df = df[~df["component"].isin(["block other", "other"]) | (df["parameters"] != 0)]
    df["share_of_block"] = (df["parameters"] / block_total).where(df["scope"] == "per block")
    df["share_of_model"] = df["parameters"] / total
    shortcut = df["component"] == "12 d_model^2 shortcut"
    df.loc[shortcut, "share_of_model"] = float("nan")
    df["shortcut_error"] = (df["parameters"] / block_total - 1).where(shortcut)
    return df.reset_index(drop=True)
