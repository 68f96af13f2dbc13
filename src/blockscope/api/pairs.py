"""The options of the commands that set two runs side by side (patch, attribute, circuit):
one prompt pair, or many (--pairs, loaded as `ManyPairs`), and the sites patched."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from blockscope.api.options import Options
from blockscope.errors import BadValue, BlockscopeError

SiteOpt = Annotated[list[str] | None, typer.Option(
    help="What is patched (repeatable): resid-pre, attn-out, mlp-out (every layer x "
    "position), or z, q, k, v (every layer x head, all positions: a head's output, query, "
    "key or value). Default: resid-pre.", show_default=False)]


def sites_of(site: list[str] | None) -> list[str]:
    """--site's values, once each, in order (resid-pre when none)."""
    return list(dict.fromkeys(site or ["resid-pre"]))


@dataclass
class Pair(Options):
    """Two prompts of the same length, the clean answer and its contrast (patch, attribute,
    circuit)."""

    clean: Annotated[str | None, typer.Option(help="The clean prompt, e.g. 'The capital of "
                                              "France is'.", show_default=False)] = None
    corrupted: Annotated[str | None, typer.Option(
        help="The corrupted prompt, the same number of tokens, e.g. 'The capital of Italy "
        "is'.", show_default=False)] = None
    target: Annotated[str | None, typer.Option(help="The clean answer, one token with its "
                                               "space (' Paris').", show_default=False)] = None
    contrast: Annotated[str | None, typer.Option(
        help="The corrupted answer (' Rome'): the metric is then the logit difference; "
        "without it, log P(target).", show_default=False)] = None

    def check(self) -> None:
        from blockscope.api.options import tokens_given

        if getattr(self, "pairs", None) is None:
            missing = [f"`{k}`" for k in ("clean", "corrupted", "target")
                       if getattr(self, k) is None]
            if missing:
                raise BadValue(f"give {', '.join(missing)}" + (
                    " (or many pairs with `pairs`)" if hasattr(self, "pairs") else ""))
        tokens_given(target=self.target, contrast=self.contrast)

    def open(self, load, prepend_bos: bool, bos_token, quiet: bool):
        """(the prompts loaded as `two_prompts` loads them, the target's id, the contrast's
        or None): their lengths and answers refused before the load where the tokenizer
        can say."""
        from blockscope.api.prompts import one_token_each, two_prompts
        from blockscope.experiments.logit_lens import target_id
        from blockscope.experiments.patch import check_lengths

        run = two_prompts(self.clean, self.corrupted, load, prepend_bos, bos_token, quiet,
                          check_lengths, one_token_each(target=self.target,
                                                        contrast=self.contrast))
        tokenizer = run.model.tokenizer
        return run, target_id(tokenizer, self.target), (
            None if self.contrast is None else target_id(tokenizer, self.contrast, "contrast"))

    def record(self, run) -> dict:
        """What the sidecar records of the pair, beside the clean prompt's own fields."""
        return {"corrupted": self.corrupted, "corrupted_tokens": run.other[0].tolist(),
                "target": self.target, "contrast": self.contrast}

    def metric_text(self) -> str:
        """The metric as the tables name it, tokens shown as they show them (␣Paris)."""
        from blockscope.inputs.text import visible

        if self.contrast:
            return f"logit({visible(self.target)}) - logit({visible(self.contrast)})"
        return f"log_prob({visible(self.target)})"


@dataclass
class Pairs(Pair):
    """One pair, or many (attribute, circuit): a JSONL file or a built-in set, averaged."""

    pairs: Annotated[str | None, typer.Option(
        help="Many pairs instead of one: a JSONL file of clean, corrupted, target and "
        "contrast (optional) rows, or a built-in set, capitals or ioi. Scores are averaged "
        "over pairs, with bootstrap intervals; under torchrun the pairs are shared.",
        show_default=False)] = None
    n_pairs: Annotated[int | None, typer.Option(
        help="At most this many pairs (ioi: how many to draw, default 32; a file "
        "and capitals: every pair).", show_default=False)] = None

    def check(self) -> None:
        from blockscope.api.options import within
        from blockscope.experiments.pairs import BUILTIN, MAX_PAIRS
        from blockscope.inputs.parallel import world_size

        within(1, MAX_PAIRS, n_pairs=self.n_pairs)
        if self.pairs is None:
            if world_size() > 1:
                raise BlockscopeError("under torchrun the pairs of `pairs` are shared across "
                                      "processes; one pair runs in one process")
            if self.n_pairs is not None:
                raise BadValue("`n_pairs` goes with `pairs`")
        elif any(v is not None for v in (self.clean, self.corrupted, self.target,
                                          self.contrast)):
            raise BadValue("give one pair (`clean`, `corrupted`, `target`) or `pairs`, "
                           "not both")
        elif self.pairs not in BUILTIN and not Path(self.pairs).is_file():
            raise BadValue(f"`pairs` {self.pairs}: no such file, nor a built-in set "
                           f"({', '.join(BUILTIN)})")
        super().check()

    def open_many(self, load, prepend_bos: bool, bos_token, quiet: bool, *, sites=(),
                  seed: int = 0):
        """The pairs read (a file's lines checked before the load), the model loaded, every
        pair tokenized and refused, naming its line, before the weights where the tokenizer
        is at hand: a `ManyPairs`. Under torchrun, this process's device and group."""
        from blockscope.api.common import checked_load, model_spec
        from blockscope.experiments import pairs as px
        from blockscope.inputs import parallel

        given = None if self.pairs in px.BUILTIN else px.read_pairs(self.pairs)
        spec = model_spec(load.model, load.held, device=parallel.local_device(load.device),
                          dtype=load.dtype.value, bos_token=bos_token)
        comm = parallel.from_env(spec.device)

        def prepared(tokenizer, n_ctx):
            if self.pairs == "capitals":
                chosen = px.capitals(tokenizer, prepend_bos)
            elif self.pairs == "ioi":
                chosen = px.ioi(tokenizer, prepend_bos, self.n_pairs or px.IOI_PAIRS, seed)
            else:
                chosen = given
            chosen = chosen[:self.n_pairs] if self.n_pairs else chosen
            items = px.tokenized(tokenizer, chosen, self.pairs, prepend_bos, n_ctx)
            px.check_aligned(items, sites, self.pairs)
            return chosen, items

        lm = checked_load(spec, load.allow_pickle, quiet or not comm.writes, held=load.held,
                          before=lambda tokenizer, sizes: prepared(
                              tokenizer, (sizes or {}).get("n_ctx")))
        chosen, items = prepared(lm.tokenizer, int(lm.cfg.n_ctx))
        return ManyPairs(self.pairs, spec, lm, chosen, items, comm)


@dataclass
class ManyPairs:
    """Many pairs, loaded: where they came from, the model, the pairs and their tokens, and
    this process's place among torchrun's."""

    source: str
    spec: object
    model: object
    pairs: list
    items: list
    comm: object

    def meta(self, command: str, prepend_bos: bool, started: float, **more) -> dict:
        import time

        from blockscope.api.common import model_record
        from blockscope.experiments.pairs import record
        from blockscope.results.files import sidecar

        return sidecar(command=command, **more, model=model_record(self.spec, self.model),
                       **record(self.pairs, self.source, self.items),
                       processes=self.comm.size, prepend_bos=prepend_bos,
                       dtype=self.spec.dtype, device=self.spec.device,
                       wall_time_s=round(time.perf_counter() - started, 3))

    @property
    def name(self) -> str:
        """The set's name in file stems: the built-in set's, or the file's stem."""
        return Path(self.source).stem

    def metric_text(self) -> str:
        """The metric as the tables name it, over pairs."""
        one = self.pairs[0]
        return ("logit(target) - logit(contrast)" if one.contrast is not None
                else "log_prob(target)")
