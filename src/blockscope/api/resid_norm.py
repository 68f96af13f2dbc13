"""`blockscope resid-norm`: the residual stream's length after each block."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

from blockscope.api.common import command
from blockscope.api.options import BosTokenOpt, Load, Options, Output, flag, group
from blockscope.api.output import write
from blockscope.api.prompts import prompt_run
from blockscope.api.text_options import Dataset, PositionOpt, Prompt, SeedOpt, ShuffleOpt
from blockscope.errors import BadValue

ProbeBosOpt = Annotated[
    bool,
    flag(
        help="Prepend BOS (see --bos-token). Off by default here, unlike the perplexity "
        'commands: the article measures its 5-token prompt "The capital of France is" with '
        "no BOS, and a BOS's own huge norm would dominate the stream's picture."
    ),
]


@dataclass
class ResidNorm(Options):
    name: ClassVar[str] = "resid-norm"
    prompt: Prompt = group(Prompt)
    data: Dataset = group(Dataset)
    shuffle: ShuffleOpt = False
    seed: SeedOpt = 0
    load: Load = group(Load)
    position: PositionOpt = -1
    all_positions: Annotated[bool, flag("--all-positions", help="Every token.")] = False
    prepend_bos: ProbeBosOpt = False
    bos_token: BosTokenOpt = None
    processed: Annotated[bool, flag(
        "--processed/--raw", help="TransformerLens compatibility mode (folded layer norms, "
        "centred writing weights) or the raw HF weights.")] = False
    out: Output = group(Output)

    def check(self) -> None:
        from blockscope.inputs.parallel import world_size

        if self.all_positions and self.position != -1:
            raise BadValue("give `position` or `all_positions`, not both")
        if self.data.dataset is None:
            if world_size() > 1:
                raise BadValue("under torchrun resid-norm splits a `dataset`; a prompt "
                                      "runs in one process")
            return
        if self.prompt.prompt is not None or self.prompt.text is not None:
            raise BadValue("give a prompt, `text` or `dataset`, one of them")
        if self.all_positions or self.position != -1:
            raise BadValue("`position`/`all_positions` pick a prompt's tokens; with `dataset` "
                           "every position but each document's first counts")

    def check_length(self, n: int) -> None:
        if not self.all_positions:
            from blockscope.experiments.resid_norm import check_positions

            check_positions([self.position], n)

    @property
    def stem(self) -> str:
        return f"{'-processed' * self.processed}{'-bos' * self.prepend_bos}"

    def weights(self) -> str:
        return "processed" if self.processed else "raw"


@command
def resid_norm(o: ResidNorm):
    """Length of the residual stream after the embeddings and after every half-block: at
    a prompt's tokens, or its distribution over a corpus (--dataset).

    Example: blockscope resid-norm "The capital of France is"
    """
    from blockscope.experiments.resid_norm import resid_norms
    from blockscope.model.arch import layout

    started = time.perf_counter()
    if o.data.dataset is not None:
        return corpus_norms(o, started)
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, processed=o.processed, check_length=o.check_length)
    n = run.tokens.shape[-1]
    positions = list(range(n)) if o.all_positions else [o.position]
    df = resid_norms(run.model, run.tokens, positions=positions)
    lay = layout(run.model)
    no_mid = (None if lay.has_mid else f"{lay.family} blocks run attention and MLP in "
              "parallel: the stream has no point between them, so only block outputs are shown")
    label = f"{run.spec.label}, {o.weights()} weights, {'with' if o.prepend_bos else 'no'} BOS"
    said = render_norms(df, f"{label}: residual stream norm", no_mid, run.model.cfg.n_layers)
    meta = run.meta("resid-norm", o.prepend_bos, started, positions=positions,
                    family=lay.family, mid_points=no_mid or "after each block's attention half "
                    "(hook_resid_mid)")
    stem = f"resid-norm-{run.spec.slug}{o.stem}"
    extra = {}
    if o.out.plot:
        from blockscope.results.plots import resid_norm_plot

        extra[f"{stem}.png"] = resid_norm_plot(
            df, f"{run.spec.label} on {run.shown()!r}: residual stream norm "
            f"({'BOS' if o.prepend_bos else 'no BOS'}, {o.weights()} weights)")
    return write(o, stem, {"": df}, meta, extra=extra, shown=said)


def render_norms(df, title: str, no_mid: str | None, n_layers: int) -> list:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    shown = df.assign(token=df["token"].map(visible))
    said = [table(shown, {"after": ("after", "s"), "layer": ("layer (0-based)", "s"),
                          "position": ("pos", "d"), "token": ("token", "s"),
                          "norm": ("L2 norm", ",.1f"),
                          "ratio_to_embed": ("x embeddings", ".1f")}, title=title)]
    if no_mid:
        said.append((no_mid, {"highlight": False}))
    last = df[df["position"] == df["position"].max()]
    said.append((f"growth: after block {n_layers - 1} (the last) the norm is "
                 f"{last['ratio_to_embed'].iloc[-1]:,.1f} times the embeddings' "
                 f"({last['norm'].iloc[0]:,.1f} -> {last['norm'].iloc[-1]:,.1f}, position "
                 f"{int(last['position'].iloc[0])})", {"highlight": False}))
    return said


def corpus_norms(o: ResidNorm, started: float):
    """resid-norm --dataset: the norm's distribution over every token of the corpus."""
    from blockscope.api.corpus_run import corpus_run
    from blockscope.experiments.resid_norm import norm_distribution
    from blockscope.model.arch import layout
    from blockscope.results.render import table

    source = o.data.source(None, shuffle=o.shuffle, seed=o.seed, prepend_bos=o.prepend_bos)
    run = corpus_run(source, o.load, quiet=o.out.quiet, processed=o.processed,
                     bos_token=o.bos_token)
    df = norm_distribution(run.model, run.docs)
    if not run.comm.writes:
        return None
    spec, lay = run.spec, layout(run.model)
    said = table(df, {"after": ("after", "s"), "layer": ("layer (0-based)", "s"),
                      "p10": ("p10", ",.1f"), "median": ("median", ",.1f"),
                      "p90": ("p90", ",.1f"), "median_ratio_to_embed":
                      ("median / embeddings", ".1f")},
                 title=f"{spec.label}, {o.weights()} weights: residual stream norm over "
                 f"{int(df.loc[0, 'n_tokens']):,} tokens of {run.name} (each document's "
                 "first position left out)")
    meta = run.meta("resid-norm", family=lay.family, statistic="median, 10th and 90th "
                    "percentile (numpy linear interpolation) and mean of the L2 norm over every "
                    "token but each document's first", n_measured=int(df.loc[0, "n_tokens"]),
                    mid_points="after each block's attention half (hook_resid_mid)"
                    if lay.has_mid else f"{lay.family} blocks are parallel: no mid point",
                    weights=o.weights(), wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"resid-norm-{spec.slug}{o.stem}-{source.stem}"
    extra = {}
    if o.out.plot:
        from blockscope.results.plots import resid_norm_band_plot

        extra[f"{stem}.png"] = resid_norm_band_plot(
            df, f"{spec.label} on {run.name}: residual stream norm, median and 10-90th "
            "percentile over tokens")
    return write(o, stem, {"": df}, meta, extra=extra, shown=[said])
