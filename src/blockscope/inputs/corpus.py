"""Where the text comes from and how it is tokenized: one `Source`, passed down as `Docs`.

A source is one text file (`text`: one passage, resampled in 128-token chunks) or a corpus
that `datasets` loads with its own loaders (`dataset`): a hub id (streamed), a local
`.txt` (one document per blank-line-separated paragraph), `.jsonl`/`.json`, `.csv` or
`.parquet` file, a directory of `.txt` files (one document per file) or a dataset saved with
`save_to_disk`. Documents are taken in order (or shuffled with a seed) until the token budget
is spent, the last one cut to fit; empty ones are skipped and counted. Each document is
scored alone, with BOS before it when asked.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockscope.errors import BadValue, BlockscopeError
from blockscope.inputs.parallel import Comm

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv",
                 ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    """What to score and how to cut it into token ids."""

    text: Path | None = None  # one UTF-8 file, scored as one passage
    dataset: str | None = None  # a hub id or a local file/directory, loaded by `datasets`
    config: str | None = None  # the hub dataset's configuration (e.g. wikitext-2-raw-v1)
    split: str | None = None  # default: "test" on the hub; a local source's one split
    column: str = "text"  # the column holding each document's text
    revision: str | None = None  # hub only: a branch, tag or commit
    n_tokens: int | None = None  # budget in text tokens (BOS not counted); None: all
    n_docs: int | None = None  # at most this many documents; None: all
    shuffle: bool = False  # sample documents with `seed` instead of taking them in order
    seed: int = 0  # the shuffle's seed
    prepend_bos: bool = True  # BOS before each document (and before the passage)
    max_tokens: int | None = None  # `text` only: its first N tokens

    @property
    def stem(self) -> str:
        """A readable name for result files: the file's or dataset's name."""
        if self.text is not None:
            return self.text.stem
        path = Path(self.dataset)
        if path.exists():
            return path.stem or path.name
        parts = [self.dataset.replace("/", "_"), self.config, self.split or "test"]
        return "-".join(p for p in parts if p)


@dataclass
class Docs:
    """This process's documents as token ids, and how their scores join the others'."""

    ids: list[torch.Tensor]  # each (1, pos) token ids, BOS already decided
    index: list[int]  # their positions in the whole corpus (0-based)
    unit: str = "chunk"  # what the bootstrap resamples: "document", or "chunk" (one passage)
    comm: Comm = field(default_factory=Comm)  # single process, or this rank of torchrun's
    record: dict = field(default_factory=dict)  # the corpus as the sidecar records it

    @property
    def single(self) -> bool:
        """Whether the whole corpus, over every process, is one document (a passage is).
        A choice of code path made on this, not on how many documents this process holds,
        is the same on every rank as in one process."""
        if self.comm.size == 1:
            return len(self.ids) == 1
        return self.record.get("n_docs", 1) == 1


def as_docs(tokens) -> Docs:
    """`Docs` as given, or one passage `(1, pos)` as a single-document `Docs`."""
    if isinstance(tokens, Docs):
        return tokens
    return Docs([tokens], [0])


def check(source: Source) -> None:
    """Refuse contradictory or out-of-range options before anything loads."""
    if (source.text is None) == (source.dataset is None):
        raise BadValue("give `text` or `dataset`, not both" if source.text
                       else "give `text` or `dataset`")
    if source.text is not None:
        only = [o for o, v in (("config", source.config), ("split", source.split),
                               ("revision", source.revision), ("n_tokens", source.n_tokens),
                               ("n_docs", source.n_docs), ("shuffle", source.shuffle or None))
                if v is not None]
        if only:
            raise BadValue(f"`{only[0]}` goes with `dataset`, not `text`")
    elif source.max_tokens is not None:
        raise BadValue("`max_tokens` cuts a `text`; with `dataset` give `n_tokens`")
    if source.dataset is not None and not Path(source.dataset).expanduser().exists() and (
            Path(source.dataset).suffix.lower() in FILE_BUILDERS
            or source.dataset.startswith((".", "/", "~")) or source.dataset.count("/") >= 2):
        raise BadValue(f"`dataset` {source.dataset}: no such file or directory")
    for name, value in (("n_tokens", source.n_tokens), ("n_docs", source.n_docs)):
        if value is not None and value < 1:
            raise BadValue(f"`{name}` must be at least 1 (got {value})")
    if source.dataset is not None:
        _check_json_lines(Path(source.dataset).expanduser())


def _check_json_lines(path: Path) -> None:
    """A local JSON lines file parses line by line, or the first line that does not is
    named: read before the model loads (`datasets` would say only that generating the
    dataset failed)."""
    if path.suffix.lower() not in (".jsonl", ".json") or not path.is_file():
        return
    try:
        with path.open(encoding="utf-8") as f:
            head = f.read(1).lstrip()
            if path.suffix.lower() == ".json" and head in ("[", "{", ""):
                f.seek(0)
                try:
                    json.load(f)  # one JSON document (a list of records): datasets reads it
                    return
                except json.JSONDecodeError:
                    f.seek(0)  # or JSON lines in a .json file: say which line fails
            f.seek(0)
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise BadValue(f"`dataset` {path}: line {n} is not JSON ({exc.msg}, "
                                       f"column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise BadValue(f"`dataset` {path}: not UTF-8 text ({exc.reason} at byte {exc.start})")


def _local_kind(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return "saved"
        if any(path.glob("*.txt")):
            return "text directory"
        raise BadValue(f"`dataset` {path}: a directory with neither .txt files nor a "
                              "dataset saved with save_to_disk")
    if path.suffix.lower() not in FILE_BUILDERS:
        raise BadValue(f"`dataset` {path}: not a {', '.join(FILE_BUILDERS)} file")
    return "file"


def _open(source: Source):
    """The split as a `datasets` Dataset or IterableDataset, and what to record of it."""
    import datasets
    import pyarrow

    datasets.disable_progress_bars()
    if not os.environ.get("BLOCKSCOPE_DEBUG"):  # its own "Failed to load JSON ..." lines
        datasets.logging.set_verbosity(datasets.logging.CRITICAL + 1)
    path = Path(source.dataset).expanduser()
    local = path.exists()
    record = {"source": source.dataset, "config": source.config, "column": source.column}
    try:
        if not local:
            split = source.split or "test"
            ds = datasets.load_dataset(source.dataset, source.config, split=split,
                                       revision=source.revision, streaming=True)
            record.update(kind="hub", split=split, revision=source.revision or "latest",
                          streaming=True)
            return ds, record
        kind = _local_kind(path)
        if source.config is not None or source.revision is not None:
            raise BadValue("`config` and `revision` go with a hub dataset, not a "
                                  f"local one ({path})")
        if kind == "saved":
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = source.split or (next(iter(ds)) if len(ds) == 1 else None)
                if split not in ds:
                    raise BadValue(f"`dataset` {path}: no split {split!r}; it has "
                                   f"{', '.join(ds)}" if split else f"`dataset` {path}"
                                   f": give `split`, one of {', '.join(ds)}")
                ds = ds[split]
            else:
                split = source.split or "train"
        else:
            if source.split not in (None, "train"):
                raise BadValue(f"`split` {source.split}: a local file has one split, "
                                      "train")
            files = sorted(str(p) for p in path.glob("*.txt")) if kind == "text directory" \
                else str(path)
            builder = "text" if kind == "text directory" else FILE_BUILDERS[path.suffix.lower()]
            extra = {}
            if builder == "text":
                extra["sample_by"] = "document" if kind == "text directory" else "paragraph"
                record["sample_by"] = extra["sample_by"]
            ds = datasets.load_dataset(builder, data_files=files, split="train", **extra)
            split = "train"
        record.update(kind=f"local {kind}", split=split,
                      fingerprint=getattr(ds, "_fingerprint", None))
        return ds, record
    except BlockscopeError:
        raise
    except (ConnectionError, FileNotFoundError) as exc:
        raise BadValue(f"`dataset` {source.dataset}: cannot load it "
                              f"({_first_line(exc)})")
    except ValueError as exc:  # an unknown split or config, or an unreadable file
        raise BadValue(f"`dataset` {source.dataset}: {_first_line(exc)}")
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowException, OSError) as exc:
        # datasets' own (DatasetGenerationError, ...), Arrow's, and the hub's HTTP errors
        raise BadValue(f"`dataset` {source.dataset}: cannot read it "
                              f"({type(exc).__name__}: {_first_line(exc)})")


def passage_docs(passage, tokenizer, source: Source, comm: Comm | None = None) -> Docs:
    """One read passage (`text.Passage`) as a single-document `Docs` (held by rank 0)."""
    from blockscope.inputs.text import tokenize

    comm = comm or Comm()
    ids = tokenize(tokenizer, passage.text, prepend_bos=source.prepend_bos,
                   max_tokens=source.max_tokens)
    mine = comm.owns(0)
    return Docs([ids] if mine else [], [0] if mine else [], "chunk", comm,
                {"path": passage.where, "sha256": passage.sha256,
                 "n_tokens": int(ids.shape[-1]) - int(source.prepend_bos),
                 "token_ids": ids_record(ids[0])})


def ids_record(ids: torch.Tensor, n: int = 8) -> dict:
    """What a sidecar records of the token ids a figure scored (BOS included): their count,
    sha256 (int64 little-endian) and the first and last few, so anyone can recompute it."""
    values = ids.tolist()
    return {"n": len(values), "first": values[:n], "last": values[-n:],
            "sha256": hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest(),
            "sha256_of": "the ids, BOS included, as int64 little-endian"}


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_docs(source: Source, tokenizer, comm: Comm | None = None) -> Docs:
    """The documents `source` names, tokenized, this process's share of them (`comm`)."""
    comm = comm or Comm()
    check(source)
    if source.text is not None:
        from blockscope.inputs.text import read_passage

        return passage_docs(read_passage(source.text), tokenizer, source, comm)
    ds, record = _open(source)
    if source.shuffle:
        ds = ds.shuffle(seed=source.seed, **({"buffer_size": 10_000} if record.get("streaming")
                                             else {}))
    columns = getattr(ds, "column_names", None)
    if columns is not None and source.column not in columns:
        raise BadValue(f"`dataset` {source.dataset}: no column {source.column!r}; "
                              f"it has {', '.join(columns)} (choose one with `column`)")
    bos = [tokenizer.bos_token_id] if source.prepend_bos else []
    if source.prepend_bos and tokenizer.bos_token_id is None:
        raise BadValue("the tokenizer has no BOS token; use `no_prepend_bos`")
    need = 1 if source.prepend_bos else 2  # text tokens for at least one scored token
    all_ids, empty, short, cut, left = [], 0, 0, False, source.n_tokens
    digest = hashlib.sha256()
    try:
        for row in ds:
            if source.n_docs is not None and len(all_ids) >= source.n_docs:
                break
            if left is not None and left < need:
                break
            text = row.get(source.column)
            if text is None and source.column not in row:
                raise BadValue(f"`dataset` {source.dataset}: no column "
                                      f"{source.column!r}; it has {', '.join(row)}")
            if not isinstance(text, str):
                raise BadValue(f"`dataset` {source.dataset}: column {source.column!r} "
                                      f"holds {type(text).__name__}, not text")
            if not text.strip():
                empty += 1
                continue
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) < need:
                short += 1
                continue
            if left is not None:
                cut = cut or len(ids) > left
                ids = ids[:left]
                left -= len(ids)
            doc = torch.tensor([bos + ids], dtype=torch.long)  # (1, pos)
            digest.update(len(doc[0]).to_bytes(8, "little"))
            digest.update(doc[0].numpy().astype("<i8").tobytes())
            all_ids.append(doc)
    except BlockscopeError:
        raise
    except (ConnectionError, ValueError, OSError) as exc:
        raise BadValue(f"`dataset` {source.dataset}: cannot read it "
                              f"({_first_line(exc)})")
    if not all_ids:
        raise BadValue(f"`dataset` {source.dataset}: no non-empty documents "
                              f"({empty} empty, {short} too short to score)")
    n_text = sum(d.shape[1] for d in all_ids) - len(all_ids) * len(bos)
    record.update(
        n_docs=len(all_ids), skipped_empty=empty, skipped_too_short=short,
        n_tokens=n_text, n_tokens_budget=source.n_tokens, n_docs_cap=source.n_docs,
        last_document_cut=cut, shuffle=source.shuffle, seed=source.seed if source.shuffle
        else None, prepend_bos=source.prepend_bos,
        tokens_sha256=digest.hexdigest(),
        tokens_sha256_of="each document's length then its ids (BOS included), int64 "
        "little-endian, in corpus order")
    mine = [i for i in range(len(all_ids)) if comm.owns(i)]
    return Docs([all_ids[i] for i in mine], mine, "document", comm, record)
