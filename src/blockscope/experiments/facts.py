"""Many facts: a JSONL of `prompt, subject, target` (the built-in
`src/blockscope/data/facts.jsonl`, 153 facts written for blockscope: capitals, official
languages, landmarks' cities, companies' countries), the facts the model knows (ROME's
"known" filter: the target's first token is its top-1), and averages over facts
with bootstrap intervals.

Positions differ from fact to fact, so averages are taken per position category, as ROME's
averaged plots do: the tokens before the subject, its first, middle and last tokens, the
first token after it, further tokens, and the last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BadValue

BUILTIN = "builtin"
CATEGORIES = ("before subject", "first subject", "middle subject", "last subject",
              "first after", "further", "last")


@dataclass(frozen=True)
class Fact:
    prompt: str
    subject: str
    target: str  # its first token is the answer followed
    line: int = field(default=0, compare=False)  # its line in the file, for a refusal


def read_facts(path: str) -> list[Fact]:
    """The facts of a JSONL file (`builtin`: the package's), read by `datasets`."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # its "Generating train split" bar is not blockscope's output

    where = str(resources.files("blockscope") / "data" / "facts.jsonl") if path == BUILTIN \
        else path
    import datasets
    import pyarrow

    if not Path(where).is_file():
        raise BadValue(f"`facts` {path}: no such file")
    lines = json_lines(Path(where), f"`facts` {path}")
    try:
        rows = load_dataset("json", data_files=where, split="train")
    except (ValueError, OSError, datasets.exceptions.DatasetsError,
            pyarrow.ArrowException) as exc:  # a line that is not JSON, or not one record
        raise BadValue(f"`facts` {path}: cannot read it as JSONL ({type(exc).__name__})")
    missing = {"prompt", "subject", "target"} - set(rows.column_names)
    if missing:
        raise BadValue(f"`facts` {path}: no column {', '.join(sorted(missing))}")
    return [Fact(r["prompt"], r["subject"], r["target"], line)
            for r, line in zip(rows, lines, strict=True)]


def check_texts(tokenizer, facts: list[Fact], path: str, prepend_bos: bool) -> None:
    """Refuse, naming its line, a fact whose prompt, subject or target is empty or whose
    subject is not in its prompt: with the tokenizer alone, before the model loads."""
    from blockscope.experiments.trace import subject_span
    from blockscope.inputs.text import tokenize

    for f in facts:
        where = f"`facts` {path}, line {f.line}"
        for name in ("prompt", "subject", "target"):
            value = getattr(f, name)
            if not isinstance(value, str) or not value.strip():
                raise BadValue(f"{where}: the {name} is empty")
        if not tokenizer.encode(f.target, add_special_tokens=False):
            raise BadValue(f"{where}: the target {f.target!r} is no token")
        tokens = tokenize(tokenizer, f.prompt, prepend_bos=prepend_bos)
        try:
            subject_span(tokenizer, tokens[0].tolist(), f.subject, prompt=f.prompt)
        except BadValue as exc:
            raise BadValue(f"{where}: {exc}")


def json_lines(where: Path, said: str) -> list[int]:
    """Refuse, naming it, the first line that is not one JSON object (datasets' own error
    names neither the line nor the fault, and logs a second line of its own); the numbers
    of the lines that hold a record, in order."""
    import json

    found = []
    with open(where, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            found.append(i)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadValue(f"{said}, line {i}: not JSON ({exc.msg})")
            if not isinstance(record, dict):
                raise BadValue(f"{said}, line {i}: not a JSON object")
    return found


def category(t: int, span: tuple[int, int], n: int) -> str:
    lo, hi = span
    if t == n - 1:
        return "last"
    if t < lo:
        return "before subject"
    if t == hi - 1:
        return "last subject"
    if t == lo:
        return "first subject"
    if t < hi:
        return "middle subject"
    return "first after" if t == hi else "further"


def prepared(model, facts: list[Fact], prepend_bos: bool) -> list[dict]:
    """Each fact's tokens, subject span, target id, and whether the model knows it."""
    from blockscope.experiments.trace import subject_span
    from blockscope.inputs.text import tokenize

    out = []
    for f in facts:
        if not f.target or not model.tokenizer.encode(f.target, add_special_tokens=False):
            raise BadValue(f"fact {f.prompt!r}: the target {f.target!r} is no token")
        tokens = tokenize(model.tokenizer, f.prompt, prepend_bos=prepend_bos)
        target = model.tokenizer.encode(f.target, add_special_tokens=False)[0]
        with torch.inference_mode():
            top = int(model(tokens.to(model.cfg.device), return_type="logits")[0, -1].argmax())
        out.append({"fact": f, "tokens": tokens, "target": target, "known": top == target,
                    "span": subject_span(model.tokenizer, tokens[0].tolist(), f.subject,
                                         prompt=f.prompt)})
    return out


def averaged(per_fact: pd.DataFrame, keys: list[str], value: str, n_boot: int = 1000,
             seed: int = 0) -> pd.DataFrame:
    """Mean of `value` per `keys` over facts (each fact's cell first averaged over its
    positions), with a 95% percentile bootstrap interval over facts and the count. A cell
    only some facts have (a category such as "further") is averaged, in each resample of
    the facts, over the drawn facts that have it; a resample that draws none of them is
    left out of that cell's interval."""
    cells = per_fact.groupby(["fact", *keys], sort=False)[value].mean().reset_index()
    grid = cells.pivot_table(index="fact", columns=keys, values=value, sort=False)
    data = grid.to_numpy()  # (n_facts, cells), NaN where a fact lacks the category
    boot = np.full((1, data.shape[1]), np.nan)
    if n_boot:
        idx = np.random.default_rng(seed).integers(0, len(data), size=(n_boot, len(data)))
        drawn = data[idx]  # (n_boot, n_facts, cells)
        has = (~np.isnan(drawn)).sum(1)  # (n_boot, cells): drawn facts that have the cell
        boot = np.where(has > 0, np.nansum(drawn, 1) / np.maximum(has, 1), np.nan)
    out = grid.columns.to_frame(index=False)
    out[value] = np.nanmean(data, axis=0)
    out["ci_low"], out["ci_high"] = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    out["n_facts"] = (~np.isnan(data)).sum(0)
    return out


def over(items: list[dict], run, keys: list[str], value: str, progress=None, comm=None,
         kept=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`run(tokens, span, target) -> DataFrame` on every fact: (every fact's rows with
    `fact` and, where rows have a position, its `category`; their average over facts by
    `keys`). Under torchrun (`comm`, `inputs.parallel`) fact k runs on rank k mod N, as
    documents do, and every rank gathers every fact's rows: the same table as one process.
    With `kept` (`inputs.partial.Partial`) each fact's rows are kept as they finish, and
    those an interrupted run kept are read back, not run again."""
    from blockscope.inputs.parallel import Comm

    comm = comm or Comm()
    scope = kept.scope("facts", len(items)) if kept is not None else None
    frames = []
    for k, it in enumerate(items):
        if not comm.owns(k):
            continue
        def one(it=it):
            return run(it["tokens"], it["span"], it["target"])

        df = one() if scope is None else scope.unit(k, one)
        df.insert(0, "fact", k)
        if "position" in df:
            n = it["tokens"].shape[-1]
            df["category"] = [category(t, it["span"], n) for t in df["position"]]
        frames.append(df)
        if progress:
            progress()
    frames = [f for part in comm.gather(frames) for f in part]
    per_fact = pd.concat(sorted(frames, key=lambda f: int(f["fact"].iloc[0])),
                         ignore_index=True)
    return per_fact, averaged(per_fact, keys, value)
