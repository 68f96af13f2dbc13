"""`blockscope prune-heads`: which heads matter, and how many can go."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from blockscope.cli.ablate import (
    BatchOpt,
    BosOpt,
    Engine,
    EngineOpt,
    MaxTokensOpt,
    Method,
    MethodOpt,
    StrideOpt,
)
from blockscope.cli.common import (
    BosTokenOpt,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    ModelOpt,
    NoOverwriteOpt,
    OutDirOpt,
    PickleOpt,
    PlotOpt,
    QuietOpt,
    app,
    comma_list,
    engine_record,
    err,
    handled,
    out,
    status,
    styled,
)
from blockscope.cli.data import (
    BootstrapOpt,
    ColumnOpt,
    ConfigOpt,
    DatasetOpt,
    NDocsOpt,
    NTokensOpt,
    RevisionOpt,
    ShuffleOpt,
    SplitOpt,
    TextOpt,
    corpus_run,
    source_of,
)
from blockscope.cli.output import write
from blockscope.errors import BlockscopeError


class Order(str, Enum):
    gradient = "gradient"
    ablation = "ablation"
    random = "random"


@app.command("prune-heads")
@handled
def prune_heads(
    text: TextOpt = None,
    dataset: DatasetOpt = None,
    config: ConfigOpt = None,
    split: SplitOpt = None,
    column: ColumnOpt = "text",
    revision: RevisionOpt = None,
    n_tokens: NTokensOpt = None,
    n_docs: NDocsOpt = None,
    shuffle: ShuffleOpt = False,
    bootstrap: BootstrapOpt = 1000,
    model: ModelOpt = None,
    method: MethodOpt = Method.zero,
    order: Annotated[
        list[Order] | None,
        typer.Option(help="Pruning order: gradient, ablation or random; repeat for several "
                     "curves. Default: gradient.", metavar="ORDER"),
    ] = None,
    step: Annotated[
        float, typer.Option(help="Heads removed per step: a fraction of those left, or a count.")
    ] = 0.1,
    tolerance: Annotated[
        float, typer.Option(help="Perplexity allowed above the baseline, as a fraction.")
    ] = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the random order, the bootstrap and "
                                      "--shuffle.")] = 0,
    layers: Annotated[str | None, typer.Option(help="Single-head sweep only these layers, "
                                               "e.g. 0,5,11.")] = None,
    heads: Annotated[str | None, typer.Option(help="Single-head sweep only these heads.")] = None,
    max_tokens: MaxTokensOpt = None,
    stride: StrideOpt = None,
    prepend_bos: BosOpt = True,
    bos_token: BosTokenOpt = None,
    engine: EngineOpt = Engine.cached,
    batch_size: BatchOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """Which heads matter, and how many can go with perplexity within a tolerance.

    Single-head ablation, Michel et al.'s gradient importance, a pruning curve and one head
    per layer. Example: blockscope prune-heads --text data/alice.txt --max-tokens 469
    """
    from blockscope.experiments import heads as experiment
    from blockscope.experiments import pruning
    from blockscope.results.render import progress_bar
    from blockscope.sweeps.stats import Bootstrap

    started = time.perf_counter()
    orders = [o.value for o in (order or [Order.gradient])]
    layer_ids, head_ids = comma_list(layers, "layers", int), comma_list(heads, "heads", int)
    if "ablation" in orders and (layer_ids or head_ids):
        raise BlockscopeError("--order ablation ranks every head: drop --layers/--heads")
    for o in orders:
        pruning.check_pruning(o, step)
    if not 0 <= tolerance < float("inf"):
        raise BlockscopeError(f"--tolerance must be a fraction of 0 or more (got {tolerance})")

    def check(sizes):
        n_layers, n_heads = sizes["n_layers"], sizes["n_heads"]
        for name, ids, top in (("layers", layer_ids, n_layers), ("heads", head_ids, n_heads)):
            bad = [i for i in ids or [] if not 0 <= i < top]
            if bad:
                raise BlockscopeError(f"--{name} {bad[0]} is out of range: 0 to {top - 1}")
        if step >= 1 and step > n_layers * n_heads:
            raise BlockscopeError(f"--step {step:g} heads is more than the model's "
                                  f"{n_layers * n_heads} heads")

    source = source_of(text=text, dataset=dataset, config=config, split=split, column=column,
                       revision=revision, n_tokens=n_tokens, n_docs=n_docs, shuffle=shuffle,
                       seed=seed, prepend_bos=prepend_bos, max_tokens=max_tokens)
    run = corpus_run(source, model, device=device, dtype=dtype.value, stride=stride,
                     out_dir=out_dir, allow_pickle=allow_pickle, quiet=quiet, check=check,
                     bos_token=bos_token)
    spec, lm, tokens, cfg = run.spec, run.model, run.docs, run.model.cfg
    quiet = quiet or not run.comm.writes
    n_sweep = len(layer_ids or range(cfg.n_layers)) * len(head_ids or range(cfg.n_heads))
    kw = dict(method=method.value, stride=stride, engine=engine.value)
    with status("clean pass, shared by every experiment below", quiet):
        kw["prepared"] = experiment.prepare(lm, tokens, **kw)
    kw["ci"] = Bootstrap(bootstrap, seed)
    with progress_bar(err, n_sweep + 1, "ablating heads one at a time", not quiet) as tick:
        ablation = experiment.single_head_ablation(lm, tokens, layers=layer_ids, heads=head_ids,
                                                   batch_size=batch_size, progress=tick, **kw)
    with status("gradient importance: one forward and backward pass", quiet):
        importance, normalised = experiment.head_importance(lm, tokens, stride=stride,
                                                            prepared=kw["prepared"])
    curves = []
    for o in orders:
        with progress_bar(err, cfg.n_layers * cfg.n_heads + 1, f"pruning ({o} order)",
                          not quiet) as tick:
            curves.append(pruning.pruning_curve(lm, tokens, order=o, step=step, seed=seed,
                                                   ablation=ablation, progress=tick,
                                                   importance=normalised, **kw))
    with progress_bar(err, cfg.n_layers + 1, "one head per layer", not quiet) as tick:
        one = experiment.one_head_per_layer(lm, tokens, importance, batch_size=batch_size,
                                            progress=tick, **kw)
    if not run.comm.writes:
        return
    per_head = head_table(ablation, importance, normalised)
    import pandas as pd

    curve = pd.concat(curves, ignore_index=True)
    n_total = cfg.n_layers * cfg.n_heads
    headline = {o: pruning.prunable(c, tolerance) for o, c in zip(orders, curves, strict=True)}
    exits = {o: pruning.band_exit(c, tolerance) for o, c in zip(orders, curves, strict=True)}
    sentences = [f"{o} order: {int(r.heads_removed)} of {n_total} heads "
                 f"({r.share_removed:.0%}) can go with perplexity {r.perplexity:,.2f} within "
                 f"+{tolerance:.0%} of the baseline {curves[0].loc[0, 'perplexity']:,.2f} "
                 "(the last step before the curve first leaves that band)"
                 + exit_clause(exits[o]) for o, r in headline.items()]
    from blockscope.cli.data import stability_line, uncertainty_record

    uncertainty = uncertainty_record(ablation)
    if not quiet:
        render(per_head, curves, one, sentences, spec.label, cfg)
        out.print(stability_line(uncertainty, "head rankings"),
                  highlight=False, soft_wrap=True)
    meta = run.meta(
        "prune-heads", n_scored=int(curve.loc[0, "n_scored"]), method=method.value,
        engine=engine.value, **engine_record(ablation, *curves, one),
        orders=orders, step=step, tolerance=tolerance, seed=seed,
        layers=layer_ids, heads=head_ids,
        importance="|d mean NLL / d head mask|, mask multiplying z; normalised per layer (L2)",
        gradient_order="normalised importance re-computed after every step; with the cached "
        "engine and --method zero each step's perplexity is read off that same forward pass "
        "(the hooked model with the step's mask), not from a second one",
        one_head_per_layer="kept head = the layer's highest gradient importance",
        headline={o: {"heads_removed": int(r.heads_removed), "share": float(r.share_removed),
                      "perplexity": float(r.perplexity), "left_band": exits[o]}
                  for o, r in headline.items()},
        uncertainty=uncertainty,
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    stem = f"prune-heads-{spec.slug}-{source.stem}{'-mean' if method is Method.mean else ''}"
    extra = {}
    if plot:
        from blockscope.results.plots import prune_heads_plot

        extra[f"{stem}.png"] = prune_heads_plot(
            per_head, curve, n_layers=cfg.n_layers, n_heads=cfg.n_heads, tolerance=tolerance,
            title=f"{spec.label} on {run.name}: which heads matter")
    write(run.out_dir, stem, {"": per_head, "-curve": curve, "-one-head": one}, meta, quiet,
          extra=extra)


def exit_clause(exit: dict | None) -> str:
    """What set the headline's resolution: the step that left the band, and a finer --step
    when that step removed several heads at once."""
    if exit is None:
        return "; the curve never leaves the band"
    text = (f"; step {exit['step']} removed {exit['removed']} head"
            f"{'s' * (exit['removed'] != 1)} and left it (x{exit['ratio']:.3f})")
    return text + (", so a finer --step (e.g. --step 1) may find more" if exit["removed"] > 1
                   else "")


def head_table(ablation, importance, normalised):
    """One row per head: ablation perplexity and change, importance, normalised, rank."""
    df = ablation.iloc[1:].reset_index(drop=True)
    df = df.rename(columns={"perplexity": "ablation_perplexity"})
    layer, head = df["layer"].astype(int), df["head"].astype(int)
    df["gradient_importance"] = importance[layer, head].numpy()
    df["normalized_importance"] = normalised[layer, head].numpy()
    ranks = (-normalised).flatten().argsort(stable=True).argsort() + 1  # 1 = most important
    df["rank"] = ranks.reshape(normalised.shape)[layer, head].numpy()
    return df[["layer", "head", "method", "ablation_perplexity", "delta", "ratio",
               "gradient_importance", "normalized_importance", "rank", "ci_low", "ci_high",
               "delta_ci_low", "delta_ci_high"]]


def render(per_head, curves, one, sentences, name: str, cfg) -> None:
    import torch

    from blockscope.results.render import heat_grid, table

    grid = torch.full((cfg.n_layers, cfg.n_heads), float("nan"))
    for r in per_head.itertuples():
        grid[r.layer, r.head] = r.ratio - 1
    out.print(heat_grid(grid, title=f"{name}: perplexity change with one head removed"))
    for c in curves:
        out.print(table(c, {"step": ("step", "d"), "heads_removed": ("heads removed", "d"),
                            "share_removed": ("share", ".0%"), "perplexity": ("perplexity", ",.2f"),
                            "ratio": ("x baseline", ".3f")},
                        title=f"pruning curve, {c.loc[0, 'order']} order"))
    one = one.assign(layer=[("baseline" if v != v or v is None else str(v))
                            for v in one["layer"].astype(object).fillna(float("nan"))])
    out.print(table(one, {"layer": ("layer", "s"), "kept_head": ("kept head", "s"),
                          "perplexity": ("perplexity", ",.2f"), "ratio": ("x baseline", ".3f")},
                    title="each layer alone down to its most important head"))
    for s in sentences:
        out.print(styled(s, "bold"), highlight=False)
