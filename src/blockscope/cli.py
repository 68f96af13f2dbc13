"""The `blockscope` command line: parse, load, call an experiment, render, write.

Heavy imports (torch, TransformerLens) happen inside the commands so that `--help` is instant.
"""

from __future__ import annotations

import functools
import os
import time
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
out = Console()
err = Console(stderr=True)


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Part(str, Enum):
    block = "block"
    attn = "attn"
    mlp = "mlp"


class Method(str, Enum):
    zero = "zero"
    mean = "mean"


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
BosOpt = Annotated[
    bool,
    typer.Option(
        help="Prepend the BOS token (GPT-2's <|endoftext|>, the document separator it was "
        "trained with), so the first word is predicted too. TransformerLens's default."
    ),
]
TextFileOpt = Annotated[Path, typer.Option("--text", "-t", help="A UTF-8 text file to score.")]
MaxTokensOpt = Annotated[
    int | None, typer.Option(help="Keep only the first N tokens of the text (BOS not counted).")
]
StrideOpt = Annotated[
    int | None,
    typer.Option(help="Sliding-window stride for text longer than the context (default n_ctx/2)."),
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
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
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
                f"[bold red]internal error:[/] {type(exc).__name__}: {exc} "
                "(set BLOCKSCOPE_DEBUG=1 for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)

    return wrapper


def load(spec, allow_pickle: bool, quiet: bool):
    from blockscope.loading import load_model

    if quiet:
        return load_model(spec, allow_pickle=allow_pickle)
    with err.status(f"loading {spec.name} on {spec.device} ({spec.dtype})"):
        return load_model(spec, allow_pickle=allow_pickle)


def report(paths: list[Path], quiet: bool) -> None:
    if quiet:
        out.print(str(paths[0]), highlight=False, soft_wrap=True)
    else:
        out.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)


@app.command()
@handled
def ablate(
    text: TextFileOpt = Path("data/alice.txt"),
    model: ModelOpt = "gpt2",
    part: Annotated[Part, typer.Option(help="Remove the whole block or one half.")] = Part.block,
    method: Annotated[
        Method, typer.Option(help="zero: remove it; mean: write its clean mean over positions.")
    ] = Method.zero,
    max_tokens: MaxTokensOpt = None,
    stride: StrideOpt = None,
    prepend_bos: BosOpt = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    quiet: QuietOpt = False,
) -> None:
    """Skip each block in turn (its output = its input) and report perplexity on a passage.

    Example: blockscope ablate --text data/alice.txt --max-tokens 469
    """
    from blockscope import ablate as experiment
    from blockscope.loading import spec_for
    from blockscope.render import progress_bar
    from blockscope.results import check_out_dir, sidecar, write_outputs
    from blockscope.text import read_passage, tokenize

    started = time.perf_counter()
    if max_tokens is not None and max_tokens < 2:
        raise BlockscopeError(f"--max-tokens must be at least 2 (got {max_tokens})")
    passage = read_passage(text)
    spec = spec_for(model, device=device, dtype=dtype.value)
    out_path = check_out_dir(out_dir)
    lm = load(spec, allow_pickle, quiet)
    tokens = tokenize(lm.tokenizer, passage.text, prepend_bos=prepend_bos, max_tokens=max_tokens)
    with progress_bar(err, lm.cfg.n_layers + 1, "ablating blocks", not quiet) as step:
        df = experiment.block_ablation(
            lm, tokens, part=part.value, method=method.value, stride=stride, progress=step
        )
    if not quiet:
        out.print(experiment_table(df, spec.name, passage.path, tokens))
    suffix = "" if part is Part.block else f"-{part.value}"
    suffix += "" if method is Method.zero else f"-{method.value}"
    stem = f"ablate-{spec.slug}-{passage.path.stem}{suffix}"
    meta = sidecar(
        command="ablate",
        model={"name": spec.name, "source": spec.source, "local": spec.is_local},
        text={"path": str(passage.path), "sha256": passage.sha256},
        n_tokens=int(tokens.shape[-1]) - int(prepend_bos),
        n_scored=int(df.loc[0, "n_scored"]),
        prepend_bos=prepend_bos,
        max_tokens=max_tokens,
        dtype=spec.dtype,
        device=spec.device,
        weights="processed" if spec.processed else "raw",
        part=part.value,
        method=method.value,
        window={"n_ctx": lm.cfg.n_ctx, "stride": stride or max(1, lm.cfg.n_ctx // 2)},
        perplexity="exp(mean next-token NLL over every scored token)",
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    report(write_outputs(out_path, {f"{stem}.csv": df, f"{stem}.json": meta}), quiet)


def experiment_table(df, model_name: str, text_path: Path, tokens):
    import pandas as pd

    from blockscope.render import table

    ablated = df.iloc[1:]
    styles = {0: "bold"}
    if len(ablated):
        styles[int(ablated["perplexity"].idxmax())] = "bold red"
        styles[int(ablated["perplexity"].idxmin())] = "green"
    shown = df.assign(block=[("baseline" if pd.isna(v) else str(v)) for v in df["layer"]])
    part, method = df.loc[len(df) - 1, "part"], df.loc[len(df) - 1, "method"]
    return table(
        shown,
        {"block": ("block removed", "s"), "perplexity": ("perplexity", ",.2f"),
         "delta": ("change", "+,.2f"), "ratio": ("ratio", ".3f")},
        title=f"{model_name} on {text_path.name}: {tokens.shape[-1]} tokens, "
        f"part={part}, method={method}",
        styles=styles,
        caption="red: the block whose removal hurts most; green: the mildest",
    )


def main() -> None:
    app()
