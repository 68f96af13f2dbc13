"""`blockscope shapes`: every tensor's shape through one block, read from hooks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import BosTokenOpt, Load, Options, Written, flag, group
from blockscope.api.output import write
from blockscope.api.prompts import prompt_run
from blockscope.api.text_options import Prompt
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
class Shapes(Options):
    name: ClassVar[str] = "shapes"
    prompt: Prompt = group(Prompt)
    load: Load = group(Load)
    block: Annotated[int, typer.Option(help="Which block to trace (0-based).")] = 0
    prepend_bos: ProbeBosOpt = False
    bos_token: BosTokenOpt = None
    out: Written = group(Written)

    def check_sizes(self, sizes: dict) -> None:
        if not 0 <= self.block < sizes["n_layers"]:
            raise BadValue(f"`block` must be between 0 and {sizes['n_layers'] - 1} (0-based; "
                           f"got {self.block})")


@command
def shapes(o: Shapes):
    """The shape of every tensor through one block, read from a real forward pass.

    Example: blockscope shapes "The capital of France is" --block 0
    """
    from blockscope.experiments.shapes import block_shapes
    from blockscope.results.render import table

    started = time.perf_counter()
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, check=o.check_all_sizes)
    df = block_shapes(run.model, run.tokens, block=o.block)
    shown = df.assign(  # a shape is one label, never wrapped; a mismatch says the expected
        matches=df["matches"].map({True: "yes", False: "NO"}),
        shape=[r.shape.replace(" x ", "\u00d7") + ("" if r.matches else
                                                   f" (expected {r.expected})")
               for r in df.itertuples()])
    shown = table(shown, {"tensor": ("tensor", "s"), "shape": ("shape", "s"),
                          "dims": ("axes", "s"), "matches": ("as config", "s"),
                          "note": ("what it is", "s")},
                  title=f"{run.spec.label}, block {o.block}: {run.tokens.shape[-1]} "
                  "tokens (batch of 1 not shown)")
    meta = run.meta("shapes", o.prepend_bos, started, block=o.block)
    return write(o, f"shapes-{run.spec.slug}-block{o.block}", {"": df}, meta, shown=[shown])
