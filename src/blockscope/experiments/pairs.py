"""Many prompt pairs: a JSONL of `clean, corrupted, target[, contrast]`, or one of the two
sets written for blockscope, and averages over pairs with bootstrap intervals.

- `capitals`: two facts of the template "The capital of X is" from `data/facts.jsonl`,
  the clean one's capital the target and the corrupted one's the contrast: each capital
  fact with the next one in the file whose prompt has as many tokens and whose answer
  differs, both answers one token of the model's tokenizer. The set keeps the pairs of
  the most common length, so that positions line up across pairs.
- `ioi`: Wang et al.'s (2022) indirect-object sentences from their templates, "When Mary
  and John went to the store, John gave a drink to" -> " Mary", corrupted as their "ABC"
  set corrupts it (the second "John" another name, "Alice"), the contrast the subject
  (" John"). Names, places and objects are those that are one token (with their space) on
  the model's tokenizer, drawn with `seed`; only the templates of the most common length
  are used, so that positions line up.

A pair's metric is `patch`'s: logit(target) - logit(contrast), or log P(target) without a
contrast (every pair of a set has one, or none). Averages over pairs are ratios of means:
the mean change over the mean clean - corrupted gap, so a pair whose gap is small weighs
little instead of blowing up, with a 95% percentile bootstrap interval over pairs.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BadValue

BUILTIN = ("capitals", "ioi")
COLUMNS = ("clean", "corrupted", "target", "contrast")
N_BOOT = 1000
IOI_PAIRS = 32  # drawn where --n-pairs is not given
MAX_PAIRS = 100_000  # a cap on --n-pairs: ioi draws that many
INTERVAL = "95% percentile bootstrap over pairs of the ratio of means, 1000 resamples, seed 0"

# Wang et al. 2022 (the IOI templates of their code, "BABA" order: the indirect object is
# the second name, the subject is repeated), the last name left for the model.
IOI_TEMPLATES = (
    "Then, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Then, {B} and {A} had a lot of fun at the {PLACE}. {B} gave a {OBJECT} to",
    "Then, {B} and {A} were working at the {PLACE}. {B} decided to give a {OBJECT} to",
    "After {B} and {A} went to the {PLACE}, {B} gave a {OBJECT} to",
    "When {B} and {A} got a {OBJECT} at the {PLACE}, {B} decided to give it to",
    "While {B} and {A} were working at the {PLACE}, {B} gave a {OBJECT} to",
    "While {B} and {A} were commuting to the {PLACE}, {B} gave a {OBJECT} to",
    "After the lunch, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Afterwards, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Friends {B} and {A} found a {OBJECT} at the {PLACE}. {B} gave it to",
)
IOI_NAMES = ("Mary", "John", "Alice", "Bob", "Tom", "James", "David", "Sarah", "Michael",
             "Emma", "Paul", "Anna", "Mark", "Lisa", "Peter", "Laura", "Daniel", "Kate",
             "Jack", "Rose", "Robert", "Linda", "George", "Susan", "Richard", "Amy", "Steven",
             "Helen", "Kevin", "Jane", "Brian", "Ruth", "Thomas", "Grace", "Eric", "Nancy")
IOI_PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house",
              "station")
IOI_OBJECTS = ("ring", "kiss", "bone", "basketball", "computer", "necklace", "drink",
               "snack")


@dataclass(frozen=True)
class PromptPair:
    clean: str
    corrupted: str
    target: str  # the clean answer, one token (' Paris')
    contrast: str | None = None  # the corrupted answer: the metric is the logit difference
    line: int = field(default=0, compare=False)  # its line in the file (0: built in)


@dataclass
class Tokens:
    """A pair as the model reads it."""

    pair: PromptPair
    clean: torch.Tensor  # (1, pos)
    corrupted: torch.Tensor  # (1, pos)
    target: int
    contrast: int | None

    @property
    def length(self) -> int:
        return int(self.clean.shape[-1])


def read_pairs(path: str) -> list[PromptPair]:
    """The pairs of a JSONL file, read by `datasets`; a line that is not one JSON object, or
    lacks a column, is refused, naming it (before any model loads)."""
    import datasets
    import pyarrow
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    from blockscope.experiments.facts import json_lines

    disable_progress_bar()
    if not Path(path).is_file():
        raise BadValue(f"`pairs` {path}: no such file, nor a built-in set "
                       f"({', '.join(BUILTIN)})")
    lines = json_lines(Path(path), f"`pairs` {path}")
    if not lines:
        raise BadValue(f"`pairs` {path}: no pair in it")
    try:
        rows = load_dataset("json", data_files=path, split="train")
    except (ValueError, OSError, datasets.exceptions.DatasetsError,
            pyarrow.ArrowException) as exc:  # records datasets cannot put in one table
        raise BadValue(f"`pairs` {path}: cannot read it as JSONL ({type(exc).__name__})")
    missing = {"clean", "corrupted", "target"} - set(rows.column_names)
    if missing:
        raise BadValue(f"`pairs` {path}: no column {', '.join(sorted(missing))}")
    has_contrast = "contrast" in rows.column_names
    out = []
    for r, line in zip(rows, lines, strict=True):
        for name in ("clean", "corrupted", "target"):
            if not isinstance(r[name], str) or not r[name].strip():
                raise BadValue(f"`pairs` {path}, line {line}: the {name} is empty")
        contrast = r["contrast"] if has_contrast else None
        if contrast is not None and (not isinstance(contrast, str) or not contrast.strip()):
            raise BadValue(f"`pairs` {path}, line {line}: the contrast is empty")
        out.append(PromptPair(r["clean"], r["corrupted"], r["target"], contrast, line))
    if len({p.contrast is None for p in out}) > 1:
        first = next(p for p in out if p.contrast is None)
        raise BadValue(f"`pairs` {path}, line {first.line}: no contrast, where other lines "
                       "have one (every pair has one metric: give a contrast on every line "
                       "or on none)")
    return out


def one_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def capitals(tokenizer, prepend_bos: bool) -> list[PromptPair]:
    """The `capitals` set on this tokenizer (see the module)."""
    from blockscope.experiments.facts import BUILTIN as FACTS
    from blockscope.experiments.facts import read_facts
    from blockscope.inputs.text import tokenize

    facts = [f for f in read_facts(FACTS) if f.prompt == f"The capital of {f.subject} is"
             and one_token(tokenizer, f.target) is not None]
    length = [tokenize(tokenizer, f.prompt, prepend_bos=prepend_bos).shape[-1] for f in facts]
    out = []
    for i, f in enumerate(facts):
        for j in [*range(i + 1, len(facts)), *range(i)]:  # the next one, around the end
            g = facts[j]
            if length[j] == length[i] and one_token(tokenizer, g.target) != \
                    one_token(tokenizer, f.target):
                out.append((length[i], PromptPair(f.prompt, g.prompt, f.target, g.target)))
                break
    if not out:
        raise BadValue("`pairs` capitals: no two capital facts of one length on this "
                       "model's tokenizer")
    common = Counter(n for n, _ in out).most_common(1)[0][0]
    return [p for n, p in out if n == common]


def ioi(tokenizer, prepend_bos: bool, n: int, seed: int) -> list[PromptPair]:
    """`n` pairs of the `ioi` set on this tokenizer (see the module), drawn with `seed`."""
    from blockscope.inputs.text import tokenize

    def ones(words):
        return [w for w in words if one_token(tokenizer, f" {w}") is not None]

    names, places, objects = ones(IOI_NAMES), ones(IOI_PLACES), ones(IOI_OBJECTS)
    if len(names) < 3 or not places or not objects:
        raise BadValue(f"`pairs` ioi: this tokenizer has {len(names)} of the names, "
                       f"{len(places)} of the places and {len(objects)} of the objects as "
                       "one token (3 names, a place and an object are needed)")
    fill = {"A": names[0], "B": names[1], "PLACE": places[0], "OBJECT": objects[0]}
    length = [tokenize(tokenizer, t.format(**fill), prepend_bos=prepend_bos).shape[-1]
              for t in IOI_TEMPLATES]
    common = Counter(length).most_common(1)[0][0]
    templates = [t for t, k in zip(IOI_TEMPLATES, length, strict=True) if k == common]
    rng = random.Random(seed)
    out = []
    for k in range(n):
        a, b, c = rng.sample(names, 3)
        slots = {"A": a, "B": b, "PLACE": rng.choice(places), "OBJECT": rng.choice(objects)}
        template = templates[k % len(templates)]
        clean = template.format(**slots)
        head, tail = clean.rsplit(f" {b} ", 1)  # the subject's second mention -> C
        out.append(PromptPair(clean, f"{head} {c} {tail}", f" {a}", f" {b}"))
    return out


def tokenized(tokenizer, pairs: list[PromptPair], where: str, prepend_bos: bool,
              n_ctx: int | None = None) -> list[Tokens]:
    """Every pair tokenized and checked, the line named in a refusal: the two prompts of
    one length, the answers one token each, within the context."""
    from blockscope.experiments.logit_lens import target_id
    from blockscope.inputs.text import tokenize

    out = []
    for p in pairs:
        said = f"`pairs` {where}" + (f", line {p.line}" if p.line else "")
        a, b = (tokenize(tokenizer, t, prepend_bos=prepend_bos) for t in (p.clean, p.corrupted))
        if a.shape[-1] != b.shape[-1]:
            raise BadValue(f"{said}: the clean prompt is {a.shape[-1]} tokens, the corrupted "
                           f"{b.shape[-1]} (a pair must be the same number of tokens)")
        if n_ctx is not None and a.shape[-1] > n_ctx:
            raise BadValue(f"{said}: {a.shape[-1]:,} tokens, the model's context is "
                           f"{n_ctx:,}")
        try:
            ids = [None if t is None else target_id(tokenizer, t, name)
                   for name, t in (("target", p.target), ("contrast", p.contrast))]
        except BadValue as exc:
            raise BadValue(f"{said}: {exc}")
        out.append(Tokens(p, a, b, *ids))
    return out


def check_aligned(items: list[Tokens], sites, where: str) -> None:
    """Position sites line up across pairs only where every pair has one length."""
    from blockscope.experiments.patch import HEADS

    lengths = sorted({t.length for t in items})
    by_position = [s for s in sites if s not in HEADS]
    if len(lengths) > 1 and by_position:
        raise BadValue(f"`pairs` {where}: the pairs are {lengths[0]} to {lengths[-1]} tokens, "
                       f"so site {by_position[0]}'s positions do not line up across them "
                       "(give pairs of one length, or head sites: z, q, k, v)")


def over(items: list, run, comm=None, kept=None, progress=None, noun: str = "pairs") -> list:
    """`run(item)` for every item, in order on every process: under torchrun item k runs on
    rank k mod N and the results are gathered; with `kept` (`inputs.partial.Partial`) each
    is kept as it finishes, and those an interrupted run kept are read back."""
    from blockscope.inputs.parallel import Comm

    comm = comm or Comm()
    scope = kept.scope(noun, len(items)) if kept is not None else None
    mine = []
    for k, item in enumerate(items):
        if not comm.owns(k):
            continue
        mine.append((k, run(item) if scope is None else scope.unit(k, lambda i=item: run(i))))
        if progress:
            progress()
    done = sorted((x for part in comm.gather(mine) for x in part), key=lambda kx: kx[0])
    return [x for _, x in done]


def ratio(changes: np.ndarray, gaps: np.ndarray, n_boot: int = N_BOOT, seed: int = 0,
          chunk: int = 4096) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over pairs p, per cell c: sum_p changes[p, c] / sum_p gaps[p] (the mean change as a
    share of the mean gap), and its 95% percentile bootstrap interval over pairs (NaN with
    one pair, or where a resample's gap sums to 0). changes (P, C), gaps (P,) or (P, C)."""
    changes = np.asarray(changes, dtype=np.float64)
    gaps = np.asarray(gaps, dtype=np.float64)
    gaps = gaps[:, None] if gaps.ndim == 1 else gaps  # (P, 1): one gap for every cell
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(gaps.sum(0) == 0, np.nan, changes.sum(0) / gaps.sum(0))
    lo = np.full(changes.shape[1], np.nan)
    hi = lo.copy()
    n = len(changes)
    if n > 1 and n_boot:
        idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
        counts = np.zeros((n_boot, n))  # how often each pair is drawn, per resample
        np.add.at(counts, (np.arange(n_boot)[:, None], idx), 1)
        for s in range(0, changes.shape[1], chunk):
            part = slice(s, s + chunk)
            num = counts @ changes[:, part]
            den = counts @ (gaps if gaps.shape[1] == 1 else gaps[:, part])
            with np.errstate(divide="ignore", invalid="ignore"):
                boot = np.where(den == 0, np.nan, num / den)
            lo[part], hi[part] = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    return value, lo, hi


def per_pair(items: list[Tokens], metric: str, clean, corrupted) -> pd.DataFrame:
    """One row per pair: where it came from, its prompts and answers, its token count, and
    the metric of its clean and corrupted runs."""
    out = pd.DataFrame([{"pair": k, "line": t.pair.line or None, "clean": t.pair.clean,
                         "corrupted": t.pair.corrupted, "target": t.pair.target,
                         "contrast": t.pair.contrast, "tokens": t.length,
                         f"clean_{metric}": float(c), f"corrupted_{metric}": float(b)}
                        for k, (t, c, b) in enumerate(zip(items, clean, corrupted,
                                                          strict=True))])
    out["line"] = out["line"].astype("Int64")
    return out


def record(pairs: list[PromptPair], source: str, items: list[Tokens]) -> dict:
    """What the sidecar keeps of the pairs."""
    return {"pairs": source, "n_pairs": len(items), "interval": INTERVAL,
            "lengths": sorted({t.length for t in items}),
            "used": [{"clean": p.clean, "corrupted": p.corrupted, "target": p.target,
                      "contrast": p.contrast} for p in pairs]}


__all__ = ["BUILTIN", "PromptPair", "Tokens", "capitals", "check_aligned", "ioi", "over",
           "per_pair", "ratio", "read_pairs", "record", "tokenized"]
