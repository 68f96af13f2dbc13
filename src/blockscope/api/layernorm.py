"""`blockscope layernorm`: layer normalization worked by hand, checked against torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import Options, Written, comma_list, group
from blockscope.api.output import write


@dataclass
class LayerNorm(Options):
    name: ClassVar[str] = "layernorm"
    values: Annotated[list[float], typer.Argument(help="The numbers to normalize (at least 2).")]
    gain: Annotated[str | None, typer.Option(help="Gain: one number or one per input, "
                                             "comma-separated.")] = None
    bias: Annotated[str | None, typer.Option(help="Bias, like --gain.")] = None
    eps: Annotated[float, typer.Option(help="Added to the variance (GPT-2: 1e-5).")] = 1e-5
    out: Written = group(Written)

    def check(self) -> None:
        comma_list(self.gain, "gain"), comma_list(self.bias, "bias")


@command
def layernorm(o: LayerNorm):
    """Layer normalization worked step by step, checked against torch's layer_norm.

    Example: blockscope layernorm 2 4 6 8   (options first, then -- before negatives: -- -1 2 3)
    """
    from blockscope.experiments.layernorm import layer_norm_steps
    from blockscope.results.files import sidecar
    from blockscope.results.render import fmt

    values = o.values
    df = layer_norm_steps(values, gain=comma_list(o.gain, "gain"),
                          bias=comma_list(o.bias, "bias"), eps=o.eps)
    from rich.table import Table

    t = Table(title=f"layer norm of {', '.join(fmt(v, 'g') for v in values)} (eps "
              f"{o.eps:g})")
    t.add_column("step", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    for step, group_ in df.groupby("step", sort=False):
        vals = [fmt(v, ".3f") if step != "max abs difference" else fmt(v, ".1e")
                for v in group_["value"]]
        t.add_row(step, ", ".join(vals) if len(vals) == 1 else "[" + ", ".join(vals) + "]")
    meta = sidecar(command="layernorm", values=values, gain=o.gain, bias=o.bias, eps=o.eps,
                   variance="population (divide by n)", std="sqrt(variance + eps)")
    stem = "layernorm-" + "_".join(fmt(v, "g") for v in values)
    return write(o, stem[:120], {"": df}, meta, shown=[t])
