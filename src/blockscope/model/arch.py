"""The one place that knows each architecture's block layout.

TransformerLens's adapters map every family onto the same hook names (`hook_resid_pre`,
`hook_attn_out`, `attn.hook_z`, ...); they are the source here. What blockscope adds is the
few facts its experiments and its engine depend on, checked against the loaded bridge at run
time, and a refusal for any family nobody has checked:

- `parallel`: attention and MLP read the same input and both write to the stream
  (GPT-J, GPT-NeoX/Pythia, Phi, Falcon): there is no mid-block residual.
- `post_norms`: a norm sits on a sublayer's output before it joins the stream
  (Gemma2/3, OLMo 2): a head's write is then not linear in the stream.
- `softcap`: final-logit softcapping (Gemma2): logits = c * tanh(logits / c).

Everything else an experiment needs (which hook points exist, where W_O is) is read off the
bridge. A family is listed only once the test matrix holds it to plain-transformers
references (tests/test_families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blockscope.errors import BlockscopeError


@dataclass(frozen=True)
class Family:
    """What blockscope knows of one HF `model_type`, checked by the tests
    (tests/test_families.py) against plain-transformers references."""

    name: str  # shown to users
    parallel: Callable[[object], bool] | None = None  # the config's rule for parallel
    #   blocks, held against the bridge's block type (None: the config has no say)
    mlp_alone: bool = True  # the MLP half can run alone from the mid residual (not BLOOM's,
    #   whose MLP adds the residual itself)
    replay: str | None = None  # its plain replay in replay.py / replay_rotary.py, if any
    refuse: Callable[[object], str | None] = lambda config: None  # a variant not checked


def _never(config) -> bool:
    return False


def _always(config) -> bool:
    return True


def _flag(key: str) -> Callable[[object], bool]:
    return lambda config: bool(getattr(config, key, False))


# HF model_type -> what blockscope knows of it: the one family registry.
REGISTRY = {
    "gpt2": Family("GPT-2", _never, replay="gpt2"),
    "gpt_neo": Family("GPT-Neo"),
    "gpt_neox": Family("GPT-NeoX/Pythia", _flag("use_parallel_residual"), replay="neox"),
    "gptj": Family("GPT-J", _always),
    "opt": Family("OPT", refuse=lambda c: None if getattr(c, "do_layer_norm_before", True)
                  else "OPT with layer norm after each sublayer (opt-350m) has not been "
                  "checked by blockscope"),
    "bloom": Family("BLOOM", mlp_alone=False),
    "falcon": Family("Falcon", lambda c: bool(c.parallel_attn or c.new_decoder_architecture)),
    "llama": Family("Llama", _never, replay="llama"),
    "mistral": Family("Mistral", _never, replay="llama"),
    "mixtral": Family("Mixtral"),
    "qwen2": Family("Qwen2", _never, replay="llama"),
    "qwen3": Family("Qwen3"),
    "gemma": Family("Gemma", _never),
    "gemma2": Family("Gemma2", _never),
    "gemma3_text": Family("Gemma3"),
    "phi": Family("Phi", _always),
    "phi3": Family("Phi-3"),
    "olmo2": Family("OLMo 2", _never),
    "stablelm": Family("StableLM", _flag("use_parallel_residual")),
    "gpt_bigcode": Family("GPT-BigCode"),
}
FAMILIES = {k: f.name for k, f in REGISTRY.items()}  # model_type -> the name users see


def family(model) -> Family:
    """The registry's record for a loaded bridge's HF model_type, or one clear refusal."""
    config = hf_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in REGISTRY:
        raise BlockscopeError(
            f"architecture {model_type!r} has not been checked by blockscope; checked: "
            + ", ".join(sorted(set(FAMILIES.values())))
        )
    found = REGISTRY[model_type]
    why = found.refuse(config)
    if why:
        raise BlockscopeError(why)
    return found


@dataclass(frozen=True)
class Layout:
    """What a block is, for the experiments and the engine."""

    family: str  # user-facing family name (FAMILIES)
    parallel: bool  # attention and MLP in parallel: no hook_resid_mid
    post_norms: bool  # a norm on a sublayer's output before the stream (ln1_post/ln2_post)
    pre_mlp_norm: bool  # the MLP half reads ln2(x) (False: OLMo 2 reads x itself)
    softcap: float | None  # final-logit softcapping constant, or None
    mlp_alone: bool  # the MLP half can run alone from the mid residual (not BLOOM's, whose
    #   MLP adds the residual itself): entering there is possible
    n_key_value_heads: int  # K/V heads (= n_heads unless grouped- or multi-query)
    d_mlp: int  # the MLP's hidden width, from the HF config (TransformerLens's cfg.d_mlp is
    #   not always it: OPT's ffn_dim)

    @property
    def has_mid(self) -> bool:
        """Whether the stream has a point between the attention and MLP halves."""
        return not self.parallel

    @property
    def linear_heads(self) -> bool:
        """Whether each head's write to the stream is z_h @ W_O[h] (plus the shared bias)."""
        return not self.post_norms


def hf_config(model):
    """The HF config of a bridged model (a multimodal one's text config)."""
    hf = getattr(model, "original_model", None)
    config = getattr(hf, "config", None)
    if config is None:
        raise BlockscopeError("this model has no Hugging Face config: blockscope needs one")
    return getattr(config, "text_config", None) or config


def layout(model) -> Layout:
    """The layout of a loaded TransformerBridge, or one clear refusal.

    The facts come from the bridge's own block type and submodules (TransformerLens's
    adapters); the family must be one the tests check, and the HF config must agree."""
    from transformer_lens.model_bridge.generalized_components.block import ParallelBlockBridge

    config = hf_config(model)
    fam = family(model)
    blocks = list(model.blocks)
    kinds = {(isinstance(b, ParallelBlockBridge), "ln1_post" in b._modules,
              "ln2_post" in b._modules, "ln2" in b._modules) for b in blocks}
    if len(kinds) != 1:
        raise BlockscopeError(f"{fam.name}: blocks of different layouts in one "
                              "model are not supported")
    parallel, ln1_post, ln2_post, ln2 = kinds.pop()
    if parallel and (ln1_post or ln2_post):
        raise BlockscopeError(f"{fam.name}: a parallel block with post-sublayer "
                              "norms is not a layout blockscope knows")
    if fam.parallel is not None and fam.parallel(config) != parallel:
        raise BlockscopeError(  # a silent guess about the layout would give wrong numbers
            f"{fam.name}: TransformerLens bridges these blocks as "
            f"{'parallel' if parallel else 'sequential'} but the config says otherwise; "
            "refusing rather than guessing")
    softcap = getattr(config, "final_logit_softcapping", None)
    cfg = model.cfg
    return Layout(
        family=fam.name, parallel=parallel, post_norms=ln1_post or ln2_post,
        pre_mlp_norm=ln2 or parallel, softcap=float(softcap) if softcap else None,
        mlp_alone=fam.mlp_alone,
        n_key_value_heads=int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads),
        d_mlp=_d_mlp(config, cfg.d_model),
    )


def block_parts(model) -> dict:
    """What a block's norms and MLP are, for notes that must not be GPT-2's on every model:
    `norm` (TransformerLens's normalization_type: LN centres and shifts, RMS does neither),
    `gated` (the adapter maps an MLP gate: act(gate) x up), `act` (the HF config's
    activation, else TransformerLens's act_fn), `width` (d_mlp / d_model)."""
    config, cfg = hf_config(model), model.cfg
    act = next((getattr(config, k) for k in ("hidden_act", "activation_function",
                                             "hidden_activation")
                if isinstance(getattr(config, k, None), str)), None)
    if act is None and getattr(config, "model_type", None) == "bloom":
        act = "gelu (BLOOM's tanh approximation)"  # hard-coded in HF's BloomMLP
    return {"norm": "RMS" if "RMS" in str(cfg.normalization_type or "") else "LN",
            "gated": "gate" in model.blocks[0].mlp._modules,
            "act": act or str(getattr(cfg, "act_fn", "unknown")),
            "width": layout(model).d_mlp / cfg.d_model}


# What each family's HF config calls the sizes blockscope reads: the one table of them.
CONFIG_KEYS = {
    "n_layers": ("n_layer", "num_hidden_layers", "num_layers"),
    "d_model": ("n_embd", "hidden_size", "d_model"),
    "n_heads": ("n_head", "num_attention_heads", "num_heads"),
    "d_mlp": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "n_ctx": ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"),
    "d_vocab": ("vocab_size",),
    "eps": ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps"),
}


def config_get(config, name: str, default=None):
    """Size `name` (a CONFIG_KEYS key, TransformerLens's name for it) from an HF config
    object or its dict: the first of the family's keys that is set (a positive number);
    `default` when none is. A multimodal config's `text_config` is read first."""
    inner = (config.get("text_config") if isinstance(config, dict)
             else getattr(config, "text_config", None))
    config = inner or config
    for key in CONFIG_KEYS[name]:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return value
    return default


def _d_mlp(config, d_model: int) -> int:
    return config_get(config, "d_mlp", 4 * d_model)  # GPT-2, GPT-Neo, GPT-J, BLOOM:
    #   unset means 4 d_model


def stream_points(lay: Layout, n_layers: int) -> list[tuple[str, int | None, str]]:
    """(hook name, layer, label) for every point of the residual stream, in order: the
    embeddings, then per block its mid point (sequential blocks only) and its output."""
    points = [("blocks.0.hook_resid_pre", None, "embeddings")]
    for i in range(n_layers):
        if lay.has_mid:
            points.append((f"blocks.{i}.hook_resid_mid", i, f"block {i} attn"))
        points.append((f"blocks.{i}.hook_resid_post", i, f"block {i}"))
    return points
