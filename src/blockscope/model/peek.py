"""What a --model's files say before anything loads, read from a local directory or the
cache only (never the hub): its sizes, its tokenizer with the BOS the loaded model will use,
so options and prompts are refused before the weights load."""

from __future__ import annotations

from pathlib import Path

from blockscope.errors import BadValue
from blockscope.model.spec import ModelSpec


def peek_sizes(spec: ModelSpec) -> dict | None:
    """n_layers, n_heads, n_ctx, d_vocab and d_mlp from the config alone (a local
    directory's config.json, or the cache), so options can be checked before the weights
    load; None when no config is at hand without loading (the load then says why)."""
    import json

    try:
        if spec.is_local:
            data = json.loads((Path(spec.source) / "config.json").read_text(encoding="utf-8"))
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(spec.source, local_files_only=True)
            data = getattr(config, "text_config", None) or config
            data = data.to_dict()
    except (OSError, ValueError, TypeError):
        return None
    from blockscope.model.arch import config_get

    sizes = {name: config_get(data, name) for name in ("n_layers", "n_heads", "n_ctx",
                                                       "d_vocab", "d_mlp")}
    if sizes["d_mlp"] is None and config_get(data, "d_model") is not None:
        sizes["d_mlp"] = 4 * config_get(data, "d_model")  # GPT-2's rule where it is unset
    return sizes


def peek_tokenizer(spec: ModelSpec):
    """The tokenizer alone, its BOS chosen as the loaded model's will be, from a local
    directory or the cache (no hub, no TransformerLens), so a prompt's refusals come before
    the weights load; None when it is not at hand (the load then says why)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from blockscope.inputs.text import choose_bos

    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.source, local_files_only=True,
                                                  add_bos_token=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not here, or not readable: the load says which
    choose_bos(tokenizer, spec.bos_token)
    return tokenizer


def as_read(tokenizer):
    """A tokenizer `peek_tokenizer` read, its own BOS put back (`text.choose_bos` set the
    chosen one and keeps the own one aside): as a fresh read of the files has it, for the
    bridge's boot, after which the load chooses again."""
    own = getattr(tokenizer, "blockscope_own_bos", None)
    if own is not None and tokenizer.bos_token != own:
        tokenizer.bos_token = own
    return tokenizer


def local_tokenizer(name: str):
    """The tokenizer of a checkpoint directory or cached hub id, without the hub (what
    norm-placement tokenizes with under `--tokenizer model`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadValue(f"`tokenizer` model: no tokenizer for {name} here "
                       f"({str(exc).splitlines()[0]})")
