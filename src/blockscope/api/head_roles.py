"""`blockscope head-roles`: previous-token, duplicate-token and induction scores per head."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command, err
from blockscope.api.options import BosTokenOpt, Load, Options, Output, at_least, flag, group
from blockscope.api.output import write
from blockscope.api.text_options import TextFileOpt
from blockscope.errors import BadValue

AttnBosOpt = Annotated[bool, flag(help="Prepend BOS (see --bos-token), as "
                                          "TransformerLens does by default.")]


@dataclass
class HeadRoles(Options):
    name: ClassVar[str] = "head-roles"
    text: TextFileOpt = Path("data/alice.txt")
    load: Load = group(Load)
    max_tokens: Annotated[int | None, typer.Option(
        help="Text tokens for the previous-token score (default 200, or what the model's "
        "context holds after BOS).", show_default=False)] = None
    n_random: Annotated[int, typer.Option(help="Random tokens, repeated once, for the "
                                          "duplicate-token and induction scores.")] = 50
    seed: Annotated[int, typer.Option(help="Seed of the random tokens.")] = 0
    bos_token: BosTokenOpt = None
    from_prune_heads: Annotated[Path | None, typer.Option(
        help="A prune-heads CSV to join (default: the one for this model and text in "
        "--out-dir, if there).")] = None
    out: Output = group(Output)

    def check(self) -> None:
        at_least(2, max_tokens=self.max_tokens)
        if self.n_random < 2:
            raise BadValue(f"`n_random` must be at least 2 (got {self.n_random})")
        if self.from_prune_heads is not None and not self.from_prune_heads.is_file():
            raise BadValue(f"`from_prune_heads` {self.from_prune_heads}: no such file")

    def check_sizes(self, sizes: dict) -> None:
        top = (sizes["n_ctx"] - 1) // 2  # BOS + twice the random tokens must fit
        if self.n_random > top:
            raise BadValue(f"`n_random` must be between 2 and half the context ({top}), got "
                           f"{self.n_random}")


@command
def head_roles(o: HeadRoles):
    """Score every head as previous-token, duplicate-token and induction head
    (TransformerLens's head detector, "mul" measure), beside prune-heads' importance.

    Example: blockscope head-roles --text data/alice.txt
    """
    import pandas as pd

    from blockscope.api.corpus_run import corpus_run
    from blockscope.experiments import head_roles as experiment
    from blockscope.inputs.corpus import Source

    started = time.perf_counter()
    run = corpus_run(Source(text=o.text, max_tokens=o.max_tokens or 200), o.load,
                     quiet=o.out.quiet, check=o.check_all_sizes, bos_token=o.bos_token)
    lm, spec, tokens = run.model, run.spec, context_tokens(o, run)
    random_ids = experiment.repeated_random(lm, o.n_random, o.seed)
    joined = _prune_heads_csv(o.from_prune_heads, o.out.out_dir, spec, run.passage)
    df = experiment.role_scores(lm, tokens, random_ids)
    corr = None
    if joined is not None:
        df, corr = experiment.join_importance(df, pd.read_csv(joined))
    tops = {role: experiment.top_heads(df, role) for role in experiment.ROLES}
    said = ([] if joined is None or o.from_prune_heads is not None
            else [(f"joining {joined}", {"highlight": False, "soft_wrap": True})])
    said += render_roles(tops, corr, spec.label)
    meta = run.meta(
        "head-roles", measure=experiment.MEASURE, n_random=o.n_random, seed=o.seed,
        sequences={"previous_token": tokens[0].tolist(),
                   "duplicate_token and induction": random_ids[0].tolist()},
        joined_prune_heads=None if joined is None else str(joined), spearman=corr,
        top5={r: [f"{layer}.{head}" for layer, head, _ in t] for r, t in tops.items()},
        wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"head-roles-{spec.slug}-{run.passage.path.stem}"
    extra = {}
    if o.out.plot:
        from blockscope.results.plots import head_roles_plot

        extra[f"{stem}.png"] = head_roles_plot(df, experiment.ROLES, lm.cfg.n_layers,
                                               lm.cfg.n_heads, f"{spec.label}: head roles")
    return write(o, stem, {"": df}, meta, extra, shown=said)


def context_tokens(o: HeadRoles, run):
    """The passage's tokens for the previous-token score: the default cut to the context,
    a --max-tokens past it refused."""
    tokens, n_ctx = run.tokens, run.model.cfg.n_ctx
    if tokens.shape[-1] <= n_ctx:
        return tokens
    if o.max_tokens is not None:
        raise BadValue(f"{tokens.shape[-1]} tokens, the model's context is {n_ctx:,}: lower "
                       "`max_tokens`")
    if not o.out.quiet:
        err.print(f"note: the previous-token score uses the first {n_ctx:,} tokens (the "
                  "model's context)", highlight=False, soft_wrap=True)
    return tokens[:, :n_ctx]


def _prune_heads_csv(explicit: Path | None, out_dir: Path, spec, passage) -> Path | None:
    """The prune-heads CSV to join: the one given (refused if its sidecar names another
    model or text), else the newest one in out_dir for this model and text, if any."""
    import re

    if explicit is not None:
        if _same_run(explicit, spec, passage):
            return explicit
        raise BadValue(f"`from_prune_heads` {explicit} was not made with {spec.name} on "
                       f"{passage.path.name} (by its sidecar)")
    name = re.compile(re.escape(f"prune-heads-{spec.slug}-{passage.path.stem}")
                      + r"(-mean)?-[0-9a-f]{8}\.csv")
    found = [p for p in Path(out_dir).glob("prune-heads-*.csv") if name.fullmatch(p.name)]
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        if _same_run(path, spec, passage):
            return path
    return None


def _same_run(csv: Path, spec, passage) -> bool:
    """Whether the prune-heads sidecar beside `csv` names this model and this text."""
    try:
        meta = json.loads(csv.with_suffix(".json").read_text(encoding="utf-8"))
        return meta["model"]["name"] == spec.name and meta["text"]["sha256"] == passage.sha256
    except (OSError, ValueError, KeyError, TypeError):
        return False


def render_roles(tops: dict, corr: dict | None, name: str) -> list:
    from rich.table import Table

    said = []
    t = Table(title=f"{name}: top heads per role (layer.head score)")
    t.add_column("role", overflow="fold")
    for i in range(max(len(v) for v in tops.values())):
        t.add_column(f"#{i + 1}", justify="right", overflow="fold")
    for role, heads in tops.items():
        t.add_row(role.replace("_", " "), *[f"{layer}.{head} {s:.2f}" for layer, head, s in heads])
    said.append(t)
    if corr:
        said.append(("Spearman correlation of role score with importance: " + ", ".join(
            f"{k} {v:+.2f}" for k, v in corr.items()), {"highlight": False, "soft_wrap": True}))
    return said
