"""What every command shares: the app, consoles, option types, error handling, output."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from blockscope.errors import BlockscopeError

app = typer.Typer(
    help="A lab for looking inside a Transformer block: the measurements of the article "
    '"Multi-Head Attention and the Transformer Block", rerun on any model.',
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Literal consoles: a path or model name may contain "[", which must print as itself.
# Styles come from Text objects (`styled`), never from markup in strings.
out = Console(markup=False)
err = Console(stderr=True, markup=False)


def styled(label: str, style: str, rest: str = ""):
    """`label` in `style`, then `rest`, as literal text."""
    from rich.text import Text

    return Text.assemble((label, style), rest)


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Hub id (e.g. gpt2) or a local checkpoint directory.")
]
DeviceOpt = Annotated[str, typer.Option(help="auto (cuda if present, else cpu), cpu, cuda:N.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Weights and activations dtype.")]
PickleOpt = Annotated[
    bool,
    typer.Option("--allow-pickle", help="Allow pickle (.bin) weights (they can run code)."),
]
OutDirOpt = Annotated[Path, typer.Option(help="Where the CSV, JSON and PNG go.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the CSV's path.")]
PlotOpt = Annotated[bool, typer.Option("--plot/--no-plot", help="Write a PNG beside the CSV.")]
TextFileOpt = Annotated[Path, typer.Option("--text", "-t", help="A UTF-8 text file.")]
PromptArg = Annotated[
    str | None, typer.Argument(help="The prompt (or give --text FILE).", show_default=False)
]
PromptFileOpt = Annotated[
    Path | None, typer.Option("--text", "-t", help="Read the prompt from a UTF-8 file.")
]


def _print_version(value: bool) -> None:
    if value:
        from blockscope import __version__

        out.print(f"blockscope {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print version."),
    ] = False,
) -> None:
    """blockscope: rerun the article's measurements on GPT-2 small or any TransformerLens model."""


def handled(fn):
    """Turn bad input into one line on stderr and a non-zero exit; Ctrl-C writes nothing."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BlockscopeError as exc:
            err.print(styled("error: ", "bold red", str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            err.print("interrupted: nothing was written", highlight=False)
            raise typer.Exit(130)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if os.environ.get("BLOCKSCOPE_DEBUG"):
                raise
            err.print(
                styled("internal error: ", "bold red", f"{type(exc).__name__}: {exc} "
                       "(set BLOCKSCOPE_DEBUG=1 for the traceback)"),
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)

    return wrapper


def status(message: str, quiet: bool):
    """A spinner on stderr while the body runs; nothing when quiet."""
    return contextlib.nullcontext() if quiet else err.status(message)


def load(spec, allow_pickle: bool, quiet: bool):
    """Load the model, with a spinner on stderr unless quiet."""
    from blockscope.loading import load_model

    with status(f"loading {spec.name} on {spec.device} ({spec.dtype})", quiet):
        return load_model(spec, allow_pickle=allow_pickle)


def prompt_text(prompt: str | None, text_file: Path | None) -> tuple[str, dict]:
    """The prompt from the argument or --text, and how to record where it came from."""
    from blockscope.text import read_passage

    if (prompt is None) == (text_file is None):
        raise BlockscopeError("give the prompt as an argument or with --text FILE, not both")
    if text_file is not None:
        passage = read_passage(text_file)
        return passage.text, {"path": str(passage.path), "sha256": passage.sha256}
    if not prompt.strip():
        raise BlockscopeError("the prompt is empty")
    return prompt, {"prompt": prompt}


@dataclass
class PassageRun:
    """What ablate and prune-heads share: a validated passage, a loaded model, its tokens."""

    passage: object  # text.Passage
    spec: object  # loading.ModelSpec
    out_dir: Path  # checked writable, not yet created
    model: object  # TransformerBridge
    tokens: object  # (1, pos) token ids
    prepend_bos: bool
    max_tokens: int | None
    stride: int | None

    def meta(self, command: str, **more) -> dict:
        """The sidecar fields every passage command records, plus `more`."""
        from blockscope.results import sidecar
        from blockscope.sweep import default_stride

        n_ctx = self.model.cfg.n_ctx
        return sidecar(
            command=command, model=model_record(self.spec),
            text={"path": str(self.passage.path), "sha256": self.passage.sha256},
            n_tokens=int(self.tokens.shape[-1]) - int(self.prepend_bos),
            prepend_bos=self.prepend_bos, max_tokens=self.max_tokens, dtype=self.spec.dtype,
            device=self.spec.device,
            window={"n_ctx": n_ctx, "stride": self.stride or default_stride(n_ctx)},
            perplexity="exp(mean next-token NLL over every scored token)", **more)


def passage_run(text: Path, model: str, *, device: str, dtype: str, max_tokens: int | None,
                prepend_bos: bool, stride: int | None, out_dir: Path, allow_pickle: bool,
                quiet: bool) -> PassageRun:
    """Validate everything cheap first (text, options, device, out-dir), then load and
    tokenize: bad input fails before the model loads."""
    from blockscope.loading import spec_for
    from blockscope.results import check_out_dir
    from blockscope.text import read_passage, tokenize

    if max_tokens is not None and max_tokens < 2:
        raise BlockscopeError(f"--max-tokens must be at least 2 (got {max_tokens})")
    passage = read_passage(text)
    spec = spec_for(model, device=device, dtype=dtype)
    out_path = check_out_dir(out_dir)
    lm = load(spec, allow_pickle, quiet)
    tokens = tokenize(lm.tokenizer, passage.text, prepend_bos=prepend_bos, max_tokens=max_tokens)
    return PassageRun(passage, spec, out_path, lm, tokens, prepend_bos, max_tokens, stride)


def comma_list(text: str | None, option: str, kind: type = float) -> list | None:
    """Parse `--option 1,2,3` into a list of `kind`; None when the option was not given."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise BlockscopeError(f"--{option} takes {what} separated by commas, not {text!r}")


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


def model_record(spec) -> dict:
    return {"name": spec.name, "source": spec.source, "local": spec.is_local,
            "weights": "processed" if spec.processed else "raw"}


def write(out_dir: Path, stem: str, frames: dict, meta: dict, quiet: bool,
          extra: dict | None = None) -> list[Path]:
    """Write `{suffix: DataFrame}` as `<stem><suffix>.csv`, `<stem>.json` and `extra`
    (`{filename: Figure or text}`); say where."""
    from blockscope.results import write_outputs

    files = {f"{stem}{suffix}.csv": df for suffix, df in frames.items()}
    files[f"{stem}.json"] = meta
    files.update(extra or {})
    try:
        paths = write_outputs(out_dir, files)
    finally:
        for content in (extra or {}).values():
            if hasattr(content, "savefig"):
                import matplotlib.pyplot as plt

                plt.close(content)
    csvs = [p for p in paths if p.suffix == ".csv"]
    if quiet:
        out.print(str(csvs[0]), highlight=False, soft_wrap=True)
    else:
        out.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)
    return paths
