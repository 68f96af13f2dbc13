"""`blockscope params`: where the parameters live, from the config alone (no weights)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import Options, Output, group
from blockscope.api.output import write


@dataclass
class Params(Options):
    name: ClassVar[str] = "params"
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", metavar="MODEL",
        help="A preset (gpt2, gpt3-175b, llama-3.1-8b), a config.json, a checkpoint directory "
        "or a cached hub id. Repeat to compare models.")] = None
    n_heads: Annotated[int | None, typer.Option(
        help="Rebuild the model with this many heads, to see that splitting d_model into more "
        "or fewer heads leaves every parameter count as it was.")] = None
    out: Output = group(Output)

    @property
    def short(self) -> dict[str, str]:
        """Each model as its file or folder name, for file names and the picture."""
        return {n: Path(n).stem if Path(n).suffix == ".json" else Path(n).name
                for n in self.model or ["gpt2"]}


@command
def params(o: Params):
    """Where the parameters live: embeddings, attention, MLP, norms; per block and in all.

    Counted from the real module shapes of a model built on the meta device (no weights).
    Example: blockscope params -m gpt2 -m gpt3-175b -m llama-3.1-8b
    """
    import pandas as pd

    from blockscope.experiments.params import parameter_counts
    from blockscope.model.configs import load_config
    from blockscope.results.files import sidecar
    from blockscope.results.render import table

    started, names, n_heads = time.perf_counter(), list(o.short), o.n_heads
    frames, shown = [], []
    for name in names:
        df = parameter_counts(load_config(name), n_heads=n_heads)
        frames.append(df.assign(model=name))
        shown.append(table(df, {"component": ("component", "s"), "scope": ("scope", "s"),
                                "parameters": ("parameters", ",d"),
                                "share_of_block": ("of block", ".1%"),
                                "share_of_model": ("of model", ".2%"),
                                "shortcut_error": ("shortcut error", "+.2%")},
                           title=f"{name}{f' with {n_heads} heads' if n_heads else ''}"))
    df = pd.concat(frames, ignore_index=True)
    df = df[["model", *[c for c in df.columns if c != "model"]]]
    meta = sidecar(command="params", models=names, n_heads=n_heads,
                   method="named_parameters() of the model built from its config on the meta "
                   "device; tied parameters counted once",
                   wall_time_s=round(time.perf_counter() - started, 3))
    stem = f"params-{'-'.join(o.short.values())}{f'-{n_heads}heads' if n_heads else ''}"
    extra = {}
    if o.out.plot:  # a checkpoint's folder name, not its whole path, under its bar
        from blockscope.results.plots import params_plot

        extra[f"{stem}.png"] = params_plot(df.assign(model=df["model"].map(o.short)),
                                           "where the parameters live: "
                                           + ", ".join(o.short.values()))
    return write(o, stem, {"": df}, meta, extra=extra, shown=shown)
