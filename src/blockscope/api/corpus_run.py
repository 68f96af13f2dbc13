"""What the passage commands read (--text or --dataset), and the run they share.

`corpus_run` reads the passage (a missing file fails before the model loads), joins
torchrun's process group when there is one, loads the model (the command's `check` run on
its sizes first), and reads and tokenizes the text or corpus into `corpus.Docs`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockscope.api.common import checked_load, err, model_record, model_spec, status

if TYPE_CHECKING:
    from blockscope.sweeps.settings import RunSettings


def uncertainty_record(df) -> dict:
    """The sidecar's account of the intervals: what was resampled and how."""
    record = dict(df.attrs.get("uncertainty", {}))
    if record.get("unit") == "chunk":
        record["note"] = ("one passage: the bootstrap resamples its consecutive 128-token "
                          "chunks (not independent documents), so the intervals say how much "
                          "the figure hangs on which parts of this text, not on which text")
    if "rank_stability" in record:
        record["rank_stability_means"] = (
            "Spearman correlation of the variants' perplexity changes between two random "
            f"halves of the {record['unit']}s (seed {record['seed']})")
    return record


def stability_line(record: dict, what: str = "rankings") -> str:
    """One line on whether the ranking (of blocks, or heads: `what`) holds up across the
    corpus."""
    unit, n = record.get("unit", "document"), record.get("n_units", 0)
    if "rank_stability" not in record:
        return (f"rank stability: needs 4 or more {unit}s and bootstrap on ({n} {unit}"
                f"{'s' * (n != 1)} here)")
    return (f"rank stability: Spearman {record['rank_stability']:+.2f} between the {what} "
            f"from two random halves of the {n:,} {unit}s (near 1: the corpus is big enough "
            "to rank them)")


@dataclass
class CorpusRun:
    """What ablate, prune-heads and head-roles share: the source, the loaded model, its
    tokens as `corpus.Docs`, and this process's place among torchrun's."""

    source: object  # corpus.Source
    passage: object | None  # text.Passage of a --text, else None
    spec: object  # loading.ModelSpec
    model: object  # TransformerBridge
    docs: object  # corpus.Docs: this process's documents
    stride: int | None

    @property
    def comm(self):
        return self.docs.comm

    @property
    def tokens(self):
        """The passage's token ids (1, pos) (a --text run)."""
        return self.docs.ids[0]

    @property
    def name(self) -> str:
        """The text's file name or the dataset, for titles."""
        return self.passage.path.name if self.passage is not None else self.source.dataset

    @property
    def n_tokens(self) -> int:
        return int(self.docs.record["n_tokens"])

    def describe(self) -> str:
        """`469 tokens + BOS of alice.txt` / `5,000 tokens in 12 documents of wiki.jsonl`."""
        bos = " + BOS" if self.source.prepend_bos else ""
        if self.passage is not None:
            return f"{self.n_tokens:,} tokens{bos} of {self.name}"
        n = self.docs.record["n_docs"]
        return (f"{self.n_tokens:,} tokens in {n:,} document{'s' * (n != 1)}"
                f"{' (BOS before each)' if bos else ''} of {self.name}")

    def meta(self, command: str, **more) -> dict:
        """The sidecar fields every passage command records, plus `more`."""
        from blockscope.results.files import sidecar
        from blockscope.sweeps.naive import default_stride

        n_ctx = self.model.cfg.n_ctx
        data = ({"text": {"path": self.passage.where, "sha256": self.passage.sha256},
                 "max_tokens": self.source.max_tokens,
                 "token_ids": self.docs.record["token_ids"]} if self.passage is not None
                else {"dataset": self.docs.record, "n_docs": self.docs.record["n_docs"]})
        return sidecar(
            command=command, model=model_record(self.spec, self.model), **data,
            n_tokens=self.n_tokens,
            prepend_bos=self.source.prepend_bos, dtype=self.spec.dtype, device=self.spec.device,
            window={"n_ctx": n_ctx, "stride": self.stride or default_stride(n_ctx)},
            perplexity="exp(total next-token NLL / total tokens scored), every document "
            "scored alone", world_size=self.comm.size, **more)


def corpus_run(source, load, *, quiet: bool, check=None, stride: int | None = None,
               processed: bool = False, bos_token: str | None = None) -> CorpusRun:
    """Read the passage, join the process group (under torchrun), load the model as
    `load` (`options.Load`) says, `check(sizes)` first, and read the text or corpus."""
    from blockscope.allocator import untune
    from blockscope.inputs import parallel
    from blockscope.inputs.corpus import load_docs, passage_docs
    from blockscope.inputs.text import read_passage


    passage = read_passage(source.text) if source.text is not None else None
    spec = model_spec(load.model, load.held, device=parallel.local_device(load.device),
                      dtype=load.dtype.value, processed=processed, bos_token=bos_token)
    comm = parallel.from_env(spec.device)
    quiet = quiet or not comm.writes
    lm = checked_load(spec, load.allow_pickle, quiet, check, load.held)
    if passage is not None:
        docs = passage_docs(passage, lm.tokenizer, source, comm)
    else:
        untune()  # documents of many lengths: keep peak memory flat in corpus size
        with status(f"reading {source.dataset}", quiet):
            docs = load_docs(source, lm.tokenizer, comm)
    run = CorpusRun(source, passage, spec, lm, docs, stride)
    if quiet:
        return run
    n_text = run.n_tokens
    if passage is not None and source.max_tokens is not None and n_text < source.max_tokens:
        err.print(f"note: --max-tokens {source.max_tokens:,}, but {passage.path.name} has "
                  f"{n_text:,} tokens: using all of them", highlight=False, soft_wrap=True)
    if passage is not None:
        from blockscope.sweeps.naive import model_windows

        n_win = len(model_windows(lm, run.tokens, stride))
        err.print(f"{run.describe()}, {n_win} window{'s' * (n_win != 1)} of up to "
                  f"{lm.cfg.n_ctx:,}", highlight=False, soft_wrap=True)
    else:
        rec = docs.record
        skipped = rec["skipped_empty"] + rec["skipped_too_short"]
        err.print(f"{run.describe()}"
                  f"{f', {skipped} empty or too short skipped' if skipped else ''}"
                  f"{', the last one cut to fit --n-tokens' if rec['last_document_cut'] else ''}"
                  f"{'' if source.n_tokens or source.n_docs else ', the whole split'}"
                  f"{f', across {comm.size} processes' if comm.size > 1 else ''}",
                  highlight=False, soft_wrap=True)
    return run


@dataclass
class PassageCommand:
    """The skeleton every passage command shares (ablate, prune-heads, prune-blocks,
    rearrange): the clock, the source, the loaded run, and at the end the sidecar's common
    fields, the file stem, the picture on request and the atomic write."""

    o: object  # the command's options: passage, window, load, sweep, out, seed
    command: str
    run: CorpusRun
    started: float
    settings: RunSettings  # how its sweeps run, from the options, made once

    @property
    def writes(self) -> bool:
        """Whether this process writes (rank 0 under torchrun)."""
        return self.run.comm.writes

    @property
    def show(self) -> bool:
        return not self.o.out.quiet and self.writes

    @property
    def title(self) -> str:
        return f"{self.run.spec.label} on {self.run.describe()}"

    def finish(self, frames: dict, *, n_scored: int, ran: tuple = (), suffix: str = "",
               plot=None, shown: list | None = None, **fields):
        """The Result: `frames` (`{csv suffix: DataFrame}`) with the sidecar (the common
        fields: `n_scored`, how the sweeps behind the frames `ran`, the KL's meaning, the
        wall time; then `fields`), with --plot `plot()`'s picture, and `shown` (what the
        command line prints)."""
        from blockscope.api.common import engine_record
        from blockscope.api.output import write
        from blockscope.sweeps import stats

        meta = self.run.meta(self.command, n_scored=int(n_scored),
                             **{"engine": self.o.sweep.engine.value,  # what ran, if said
                                **engine_record(*(ran or frames.values()))},
                             kl=stats.KL_MEANING, **fields,
                             wall_time_s=round(time.perf_counter() - self.started, 3))
        stem = f"{self.command}-{self.run.spec.slug}-{self.run.source.stem}{suffix}"
        extra = {f"{stem}.png": plot()} if plot is not None and self.o.out.plot else {}
        return write(self.o, stem, frames, meta, extra=extra, shown=shown)


def passage_command(o, command: str) -> PassageCommand:
    """Start a passage command: read its text or corpus and load its model, checked first."""
    started = time.perf_counter()
    source = o.passage.source(o.seed, o.window)
    run = corpus_run(source, o.load, quiet=o.out.quiet, check=o.check_all_sizes,
                     stride=o.window.stride, bos_token=o.window.bos_token)
    return PassageCommand(o, command, run, started, run_settings(o))


def run_settings(o) -> RunSettings:
    """A passage command's `RunSettings` from its options."""
    from blockscope.sweeps.stats import Bootstrap

    return o.sweep.settings(stride=o.window.stride, ci=Bootstrap(o.passage.bootstrap, o.seed),
                            seed=o.seed, kept=o.out.partial)
