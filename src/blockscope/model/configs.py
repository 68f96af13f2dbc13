"""Architectures without weights: the article's models as config presets (`params` needs no
network), a config from a preset, a `config.json`, a checkpoint directory or a cached hub id
(`load_config`), and a preset with random weights for figures that depend on shapes only
(`random_model`)."""

from __future__ import annotations

from pathlib import Path

from blockscope.errors import BadValue, BlockscopeError
from blockscope.model.loading import _first, _hub_reachable
from blockscope.model.spec import looks_like_path

# Architecture-only presets for `params`: the article's models, needing no network.
CONFIG_PRESETS = {
    "gpt2": ("gpt2", {}),  # GPT-2 small: GPT2Config's defaults
    "gpt3-175b": (  # Brown et al. 2020, table 2.1: GPT-2's block at d_model 12,288
        "gpt2",
        dict(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257),
    ),
    "llama-3.1-8b": (  # grouped-query attention, SwiGLU MLP, untied embeddings
        "llama",
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
             max_position_embeddings=131072, tie_word_embeddings=False),
    ),
}


def load_config(name: str):
    """An HF config from a preset, a `config.json`, a checkpoint dir, or a (cached) hub id."""
    import json

    from transformers import AutoConfig

    from blockscope.model import fetch

    if name in CONFIG_PRESETS:
        model_type, overrides = CONFIG_PRESETS[name]
        return AutoConfig.for_model(model_type, **overrides)
    path = Path(name).expanduser()
    if name in fetch.MODELS and not path.exists():
        path = fetch.fetch(name)[0]
    if not path.exists() and looks_like_path(name):
        raise BadValue(f"`model` {name}: no such file or directory")
    try:
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if "model_type" not in data:
                raise BadValue(f"`model` {path}: a config.json needs a model_type")
            return AutoConfig.for_model(data.pop("model_type"), **data)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise BadValue(f"`model` {path}: no config.json, so not an HF checkpoint")
            return AutoConfig.from_pretrained(path, trust_remote_code=False)
        try:
            return AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
        except OSError:
            if not _hub_reachable():
                raise BadValue(
                    f"`model` {name}: not a preset ({', '.join(CONFIG_PRESETS)}), a file or "
                    "directory here, or a cached hub id, and the hub is unreachable"
                )
            return AutoConfig.from_pretrained(name, trust_remote_code=False)
    except BlockscopeError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise BadValue(f"`model` {name}: cannot read its config: {_first(exc)}")


def random_model(preset: str, tokenizer):
    """A TransformerBridge with a preset's architecture and random weights (no download):
    for figures that depend on shapes only. `tokenizer` is any HF tokenizer object."""
    import tempfile

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_config(load_config(preset), attn_implementation="eager")
    with tempfile.TemporaryDirectory() as tmp:  # reload it as the loader does, BOS-aware
        tokenizer.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp, add_bos_token=True)
    return TransformerBridge.boot_transformers(
        preset, hf_model=hf_model.eval(), tokenizer=tokenizer, device="cpu"
    )
