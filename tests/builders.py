"""Test-support builders: one tiny random-weight checkpoint per family blockscope checks
(arch.FAMILIES), saved as an ordinary HF checkpoint with the real GPT-2 tokenizer. Kept
under tests/ (the package ships only what its commands use: `blockscope.toy`)."""

from __future__ import annotations

import json
from pathlib import Path

from blockscope.model.toy import gpt2_tokenizer

from .conftest import ALICE

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


def paragraphs() -> list[str]:
    return [p for p in ALICE.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def write_jsonl(path, texts, column="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({column: t, "n": len(t)}) + "\n")
    return path


def tiny_reference(tmp_path):
    ref = tmp_path / "ref.toml"
    ref.write_text(f"""
model = "unused"
[ablate]
text = "{ALICE}"
max_tokens = 60
[resid_norm]
prompt = "The capital of France is"
[prune_heads]
text = "{ALICE}"
max_tokens = 30
tolerance = 0.05
[layernorm]
examples = [[2, 4, 6, 8]]
[norm_placement]
section = "Pre-norm and post-norm"
text = "{ALICE}"
n_layers = 2
d_model = 32
n_heads = 2
max_tokens = 30
seeds = 1
train_steps = 8
warmup_steps = 2
lrs = [1e-3, 3e-3]
train_layers = 1
train_d_model = 16
train_heads = 2
batch_size = 2
seq_len = 16
claims = ["post-norm needs a warm-up"]
[mlp]
section = "The MLP"
prompt = "The capital of France is"
target = " Paris"
subject = "France"
text = "{ALICE}"
key_tokens = 60
n_layers = 2
per_layer = 2
claims = ["values push the stream toward Paris"]
[attribution]
clean = "The capital of France is"
corrupted = "The capital of Italy is"
target = " Paris"
contrast = " Rome"
sites = ["mlp-out", "z"]
[head_roles]
section = "What heads do"
text = "{ALICE}"
max_tokens = 30
n_random = 8
known = [
    {{ role = "induction", layer = 2, head = 1 }},
    {{ role = "induction", layer = 5, head = 1 }},
]
[[figure]]
experiment = "ablate"
name = "baseline perplexity"
article = "22.2"
measure = "ablate.baseline"
[[figure]]
experiment = "resid-norm"
name = "norm after the article's block 1 (block 0)"
article = "56.5"
measure = "resid.block 0"
[[figure]]
experiment = "resid-norm"
name = "norm after the article's block 6 (block 5)"
article = "73.4"
measure = "resid.block 5"
[[figure]]
experiment = "params"
name = "GPT-2 small: total"
article = "124,439,808"
measure = "params.gpt2.total"
[[figure]]
experiment = "layernorm"
name = "std"
article = "2.236"
measure = "layernorm.2 4 6 8.std"
""")
    return ref
