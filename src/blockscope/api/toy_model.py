"""`blockscope toy-model`: a random-weight GPT-2 with the real tokenizer, to try the tool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, out
from blockscope.api.options import Options, flag
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
