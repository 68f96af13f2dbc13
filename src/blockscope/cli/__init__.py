"""The `blockscope` command line: one module per group of commands, on one Typer app.

Each command parses, loads, calls a pure experiment, renders and writes; nothing else.
Heavy imports (torch, TransformerLens) happen inside the commands, so `--help` is instant.
"""

import sys

from blockscope.cli import (  # noqa: F401  (registers the commands)
    ablate,
    heads,
    norm,
    probes,
    reproduce,
    roles,
    tables,
    toy,
)
from blockscope.cli.common import app


def main() -> None:
    from blockscope.allocator import tune_allocator

    tune_allocator()  # before torch allocates anything large: sweeps free and reuse a lot
    _negative_numbers_hint(sys.argv[1:])
    app()


def _negative_numbers_hint(argv: list[str]) -> None:
    """`blockscope layernorm -1 0 1`: Click reads -1 as an option. Say how to pass it."""
    import re

    if argv[:1] == ["layernorm"]:
        before = argv[: argv.index("--")] if "--" in argv else argv
        bad = next((a for a in before if re.fullmatch(r"-(\d+\.?\d*|\.\d+)(e-?\d+)?", a)), None)
        if bad is not None:
            from blockscope.cli.common import err

            err.print(f"error: {bad} reads as an option; put -- before the numbers, after "
                      "any options: blockscope layernorm --eps 1e-5 -- -1 0 1",
                      highlight=False, soft_wrap=True)
            raise SystemExit(2)
