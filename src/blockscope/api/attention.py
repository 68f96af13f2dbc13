"""`blockscope attention`: the attention patterns of chosen heads on a prompt."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import BosTokenOpt, Load, Options, Output, comma_list, flag, group
from blockscope.api.output import write
from blockscope.api.prompts import prompt_run
from blockscope.api.text_options import Prompt
from blockscope.errors import BadValue

AttnBosOpt = Annotated[bool, flag(help="Prepend BOS (see --bos-token), as "
                                          "TransformerLens does by default.")]


@dataclass
class AttentionOptions(Options):
    name: ClassVar[str] = "attention"
    prompt: Prompt = group(Prompt)
    load: Load = group(Load)
    layer: Annotated[str, typer.Option(help="Layers, e.g. 0 or 0,5 (0-based).")] = "0"
    head: Annotated[str | None, typer.Option(help="Heads, e.g. 1,7 (default: all).")] = None
    prepend_bos: AttnBosOpt = True
    bos_token: BosTokenOpt = None
    out: Output = group(Output)

    @property
    def layers(self) -> list[int]:
        return comma_list(self.layer, "layer", int) or []

    def check(self) -> None:
        if not self.layers:
            raise BadValue("`layer` needs at least one layer")
        comma_list(self.head, "head", int)

    def check_sizes(self, sizes: dict) -> None:
        from blockscope.experiments.attention import check_heads

        check_heads(sizes, self.layers, comma_list(self.head, "head", int))


@command
def attention(o: AttentionOptions):
    """The attention patterns of chosen heads on a prompt: a heatmap grid, each query's
    top-3 keys, and a long CSV.

    Example: blockscope attention "The capital of France is" --layer 5 --head 1,5
    """
    from blockscope.api.common import sizes_of
    from blockscope.experiments import attention as experiment

    started = time.perf_counter()
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, check=o.check_all_sizes)
    layers, tokens, spec = o.layers, run.tokens, run.spec
    heads = experiment.check_heads(sizes_of(run.model), layers,
                                   comma_list(o.head, "head", int))
    df = experiment.attention_table(run.model, tokens, layers=layers, heads=heads)
    meta = run.meta("attention", o.prepend_bos, started, layers=layers, heads=heads,
                    read_at="blocks.<layer>.attn.hook_pattern (each query head's own pattern)")
    digest = hashlib.sha256(json.dumps([tokens[0].tolist(), layers, heads],
                                       allow_nan=False).encode())
    stem = f"attention-{spec.slug}-{digest.hexdigest()[:8]}"
    extra = {}
    if o.out.plot:
        from blockscope.results.plots import attention_plot

        extra[f"{stem}.png"] = attention_plot(df, f"{spec.label}: attention on {run.text!r}"
                                              [:120])
    return write(o, stem, {"": df}, meta, extra, render_attention(df, experiment, spec.label))


def render_attention(df, experiment, name: str) -> list:
    from rich.table import Table

    shown = []
    for layer, head in dict.fromkeys(zip(df["layer"], df["head"], strict=True)):
        t = Table(title=f"{name}: layer {layer}, head {head}: top-3 keys per query")
        t.add_column("query", overflow="fold")
        for i in range(3):
            t.add_column(f"#{i + 1}", overflow="fold")
        for query, keys in experiment.top_keys(df, layer, head):
            t.add_row(query, *[f"{k} {w:.2f}" for k, w in keys])
        shown.append(t)
    return shown
