"""The Typer app: every command of `blockscope.api` on it, run with bad input said in one
line, and the Result each returns shown and saved under --out-dir."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from blockscope.api import output
from blockscope.api.common import COMMANDS, DISTRIBUTED
from blockscope.api.console import err, out, styled
from blockscope.api.options import flag
from blockscope.cli import help as help_text
from blockscope.errors import BlockscopeError

REFUSED = 2  # the exit code of every refusal of bad input, Click's usage errors included
INTERNAL = 1  # an unexpected error: a bug to report

app = typer.Typer(
    cls=help_text.Group,
    help="A lab for looking inside a Transformer block: the measurements of the article "
    '"Multi-Head Attention and the Transformer Block", rerun on any model.',
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

def _print_version(value: bool) -> None:
    if value:
        from blockscope.versions import __version__

        out.print(f"blockscope {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        flag("--version", callback=_print_version, is_eager=True, help="Print version."),
    ] = False,
) -> None:
    """blockscope: rerun the article's measurements on GPT-2 small or any TransformerLens model."""


def register(fn, cls) -> None:
    """Put command `fn(o)` on the app. The dataclass `cls` of `o` (`api.options`) gives
    the Typer signature, its groups' options flattened in field order, and the command's
    name; `run` makes it from what Typer parsed."""
    from blockscope.api.options import parameters

    empty = inspect.Parameter.empty
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                default=empty if default is dataclasses.MISSING else default)
              for name, kind, default in parameters(cls)]

    def entry(**values):
        return run(fn, cls, values)

    entry.__signature__ = inspect.Signature(params)
    entry.__annotations__ = {p.name: p.annotation for p in params}
    entry.__name__, entry.__doc__ = fn.__name__, fn.__doc__
    app.command(cls.name, cls=help_text.Command)(entry)


def run(fn, cls, values: dict):
    """Make the options, check them, run the command: bad input is one line on stderr and
    exit 2 (as Click's usage errors: every refusal exits 2), Ctrl-C exits 130 and writes
    nothing final, anything else is an internal error, exit 1 (with the traceback under
    BLOCKSCOPE_DEBUG=1)."""
    from blockscope.api.options import build
    from blockscope.inputs import parallel

    rank = parallel.env_rank()
    partial = None
    try:
        if parallel.world_size() > 1 and cls.name not in DISTRIBUTED:
            raise BlockscopeError(f"{cls.name} runs in one process; under torchrun only "
                                  f"{', '.join(sorted(DISTRIBUTED))} do")
        o = build(cls, values)
        o.check_all()
        output.refuse_overwrite(o)
        partial = output.partial_store(o)
        if partial is not None:
            o.out.partial = partial  # units finished are kept; a rerun resumes from them
        result = fn(o)
        if result is not None:  # the command's results: shown, then saved in --out-dir
            if not o.out.quiet:
                result.show(out)
            if partial is not None and partial.passes:
                result.meta["partial"] = partial.record()
            output.saved(result, Path(o.out.out_dir).expanduser(), o.out.quiet)
        if partial is not None and rank == 0:
            partial.discard()
    except BlockscopeError as exc:
        message = exc.as_flag() if hasattr(exc, "as_flag") else str(exc)
        if rank == 0:  # every process meets the same bad input: say it once
            err.print(styled("error: ", "bold red", message), highlight=False, soft_wrap=True)
        parallel.report_failure(f"error: {message}")
        raise typer.Exit(REFUSED)
    except KeyboardInterrupt:
        if rank == 0:
            err.print(partial.interrupted() if partial is not None
                      else "interrupted: nothing was written", highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    except (typer.Exit, typer.Abort):
        raise
    except Exception as exc:
        if os.environ.get("BLOCKSCOPE_DEBUG"):
            raise
        where = "" if parallel.world_size() == 1 else (
            f"rank {rank} of this torchrun (nothing was written): ")
        line = f"{where}{type(exc).__name__}: {exc} (set BLOCKSCOPE_DEBUG=1 for the traceback)"
        err.print(styled("internal error: ", "bold red", line), highlight=False, soft_wrap=True)
        parallel.report_failure(f"internal error: {line}")
        raise typer.Exit(INTERNAL)
    finally:
        if "torch.distributed" in sys.modules:
            parallel.finish()




for _fn, _cls in COMMANDS.values():
    register(_fn, _cls)
