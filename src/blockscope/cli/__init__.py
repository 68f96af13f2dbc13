"""The `blockscope` command line: the commands of `blockscope.api` on one Typer app, and
bad usage said in one line."""

import sys

from blockscope.cli.app import app  # noqa: F401  (the Typer app, every command on it)


def main() -> None:
    from blockscope.allocator import tune_allocator

    tune_allocator()  # before torch allocates anything large: sweeps free and reuse a lot
    _negative_numbers_hint(sys.argv[1:])
    raise SystemExit(_run())


def _run() -> int:
    """The app, with a mistyped option or a bad choice said in one line (Click's own
    message: the valid choices, or "Did you mean --max-tokens?"), not Click's usage box."""
    import typer

    try:  # Typer 0.2x vendors Click: its exceptions live there
        from typer._click.exceptions import UsageError
    except ImportError:
        from click.exceptions import UsageError

    from blockscope.api.console import err

    try:
        code = app(standalone_mode=False)
    except UsageError as exc:
        message = " ".join(exc.format_message().replace("Value error, ", "").split())
        command = exc.ctx.command_path if exc.ctx is not None else "blockscope"
        err.print(f"error: {message} (see {command} --help)", highlight=False, soft_wrap=True)
        return 2
    except typer.Abort:
        err.print("interrupted: nothing was written", highlight=False)
        return 130
    return code if isinstance(code, int) else 0


def _negative_numbers_hint(argv: list[str]) -> None:
    """`blockscope layernorm -1 0 1`: Click reads -1 as an option. Say how to pass it."""
    import re

    if argv[:1] == ["layernorm"]:
        before = argv[: argv.index("--")] if "--" in argv else argv
        number = re.compile(r"-(\d+\.?\d*|\.\d+)(e-?\d+)?")
        valued = {"--eps", "--gain", "--bias", "--out-dir"}  # their value may be negative
        bad = next((a for i, a in enumerate(before)
                    if number.fullmatch(a) and before[i - 1] not in valued), None)
        if bad is not None:
            from blockscope.api.console import err

            err.print(f"error: {bad} reads as an option; put -- before the numbers, after "
                      "any options: blockscope layernorm --eps 1e-5 -- -1 0 1",
                      highlight=False, soft_wrap=True)
            raise SystemExit(2)
