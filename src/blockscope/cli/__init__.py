"""The `blockscope` command line: one module per group of commands, on one Typer app.

Each command parses, loads, calls a pure experiment, renders and writes; nothing else.
Heavy imports (torch, TransformerLens) happen inside the commands, so `--help` is instant.
"""

from blockscope.cli import ablate, heads, norm, probes, reproduce, roles, tables  # noqa: F401,E501  (registers the commands)
from blockscope.cli.common import app


def main() -> None:
    from blockscope.allocator import tune_allocator

    tune_allocator()  # before torch allocates anything large: sweeps free and reuse a lot
    app()
