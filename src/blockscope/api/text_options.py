"""The options of the commands that read text: a prompt, a passage or a corpus, how a
passage is cut into the model's context, and how a sweep's variants run (groups of
`options.Options`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from blockscope.api.options import BosTokenOpt, Options, at_least, flag, group
from blockscope.choices import EngineName, Method
from blockscope.errors import BadValue, BlockscopeError

PromptArg = Annotated[str | None, typer.Argument(help="The prompt (or give --text FILE).",
                                                 show_default=False)]
PromptFileOpt = Annotated[Path | None, typer.Option("--text", "-t",
                                                    help="Read the prompt from a UTF-8 file.")]
TextOpt = Annotated[Path | None, typer.Option(
    "--text", "-t", help="A UTF-8 text file, scored as one passage (default data/alice.txt "
    "when no --dataset is given).", show_default=False)]
TextFileOpt = Annotated[Path, typer.Option("--text", "-t", help="A UTF-8 text file.")]
ShuffleOpt = Annotated[bool, flag("--shuffle", help="Sample documents with --seed instead of "
                                  "taking them in order.")]
BootstrapOpt = Annotated[int, typer.Option(
    min=0, help="Bootstrap resamples for the 95% intervals (over documents; over 128-token "
    "chunks of a single --text). 0: none.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the bootstrap, the halves and --shuffle.")]
PositionOpt = Annotated[int, typer.Option(help="Token index; negative counts from the end.")]


@dataclass
class Prompt(Options):
    """A prompt: the argument, or --text FILE."""

    prompt: PromptArg = None
    text: PromptFileOpt = None

    def read(self) -> tuple[str, dict]:
        """The prompt's text, and how the sidecar records where it came from."""
        from blockscope.inputs.text import as_prompt, read_passage

        if (self.prompt is None) == (self.text is None):
            raise BadValue("give the prompt as an argument or with `text` FILE"
                                  + (", not both" if self.prompt is not None else ""))
        if self.text is not None:
            passage = read_passage(self.text)
            text, stripped = as_prompt(passage.text)
            if not text.strip():
                raise BadValue(f"`text` {passage.path}: the prompt is empty")
            return text, {"path": passage.where, "sha256": passage.sha256,
                          "stripped": stripped}
        if not self.prompt.strip():
            raise BlockscopeError("the prompt is empty")
        return self.prompt, {"prompt": self.prompt}


@dataclass
class Dataset(Options):
    """A corpus to score instead of a passage (--dataset and how to read it)."""

    dataset: Annotated[str | None, typer.Option(
        "--dataset", "-d", help="Score a corpus instead of --text: a hub dataset id, a local "
        ".txt (one document per paragraph), .jsonl/.json, .csv or .parquet file, a directory "
        "of .txt files (one document each) or a directory saved with datasets' save_to_disk.",
        show_default=False)] = None
    config: Annotated[str | None, typer.Option(help="The hub dataset's configuration.",
                                               show_default=False)] = None
    split: Annotated[str | None, typer.Option(
        help="Split (default: test for a hub dataset; a local source's one split).",
        show_default=False)] = None
    column: Annotated[str, typer.Option(help="The column that holds the text.")] = "text"
    revision: Annotated[str | None, typer.Option(
        help="Hub dataset revision: branch, tag or commit.", show_default=False)] = None
    n_tokens: Annotated[int | None, typer.Option(
        help="Token budget of a --dataset (BOS not counted): whole documents in order, the "
        "last one cut to fit. Default: every document.", show_default=False)] = None
    n_docs: Annotated[int | None, typer.Option(help="At most this many documents.",
                                               show_default=False)] = None

    def source(self, text: Path | None, *, shuffle: bool = False, seed: int = 0,
               prepend_bos: bool = True, max_tokens: int | None = None):
        """These options and the text options beside them as one `corpus.Source`
        (checked)."""
        from blockscope.inputs.corpus import Source, check

        source = Source(text=text, dataset=self.dataset, config=self.config, split=self.split,
                        column=self.column, revision=self.revision, n_tokens=self.n_tokens,
                        n_docs=self.n_docs, shuffle=shuffle, seed=seed,
                        prepend_bos=prepend_bos, max_tokens=max_tokens)
        check(source)
        return source


# --- sweeps: how a passage is cut and its variants run ----------------------------------

BosOpt = Annotated[bool, flag(
    help="Prepend BOS (the token the model saw at document starts; see --bos-token), so the "
    "first word is predicted too. TransformerLens's default.")]
MethodOpt = Annotated[Method, typer.Option(
    help="zero: remove it; mean: write its clean mean over positions; resample (heads and "
    "halves, on a --dataset): write what it gave on another document, position by "
    "position.")]


def check_resample(method: Method, passage) -> None:
    """--method resample draws from other documents: it needs a corpus."""
    if method is Method.resample and passage.data.dataset is None:
        raise BadValue("`method` resample takes a component's output from another document: "
                       "give a corpus with `dataset`")


def resample_record(method: Method, df) -> dict:
    """The sidecar's account of how resample fills were drawn (nothing for other methods)."""
    return {"resample": df.attrs["resample"]} if method is Method.resample else {}


@dataclass
class WindowOptions(Options):
    """How a passage is cut into the model's context."""

    max_tokens: Annotated[int | None, typer.Option(
        help="Keep only the first N tokens of the text (BOS not counted).")] = None
    stride: Annotated[int | None, typer.Option(
        help="Sliding-window stride for text longer than the context (default n_ctx/2).")
    ] = None
    prepend_bos: BosOpt = True
    bos_token: BosTokenOpt = None

    def check(self) -> None:
        at_least(2, max_tokens=self.max_tokens)
        at_least(1, stride=self.stride)

    def check_sizes(self, sizes: dict) -> None:
        if self.stride is not None and self.stride > sizes["n_ctx"]:
            raise BadValue(f"`stride` {self.stride} is longer than the model's context "
                           f"({sizes['n_ctx']:,} tokens)")


@dataclass
class Sweep(Options):
    """Which engine scores the variants, and how many at once."""

    engine: Annotated[EngineName, typer.Option(
        help="cached: one clean pass, each variant from the block it changes; naive: one "
        "hooked forward per variant (the reference). Same numbers.")] = EngineName.cached
    batch_size: Annotated[int | None, typer.Option(
        min=1, help="Variants per batch (default: by memory; on the CPU at most 6, or 1 where "
        "blocks run through the bridge).")] = None

    def settings(self, **more):
        """The `RunSettings` the sweeps run with: this engine and batch size, and `more`
        (stride, ci, seed)."""
        from blockscope.sweeps.settings import RunSettings

        return RunSettings(engine=self.engine, batch_size=self.batch_size, **more)


@dataclass
class PassageOptions(Options):
    """What the perplexity commands score: a passage (data/alice.txt when neither --text
    nor --dataset is given) or a corpus, and its bootstrap."""

    text: TextOpt = None
    data: Dataset = group(Dataset)
    shuffle: ShuffleOpt = False
    bootstrap: BootstrapOpt = 1000

    def __post_init__(self):
        from blockscope.inputs.text import DEFAULT_TEXT

        if self.text is None and self.data.dataset is None:
            self.text = DEFAULT_TEXT

    def source(self, seed: int, window: WindowOptions):
        """As one `corpus.Source`, cut as `window` says (checked)."""
        return self.data.source(self.text, shuffle=self.shuffle, seed=seed,
                                prepend_bos=window.prepend_bos, max_tokens=window.max_tokens)
