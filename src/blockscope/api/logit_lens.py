"""`blockscope logit-lens`: what each point of the stream predicts, and who writes the answer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import typer

from blockscope.api.common import command
from blockscope.api.options import (
    BosTokenOpt,
    Load,
    Options,
    Output,
    PromptBosOpt,
    TargetOpt,
    at_least,
    at_most,
    flag,
    group,
    tokens_given,
)
from blockscope.api.output import write
from blockscope.api.prompts import one_token_each, pick_positions, prompt_run
from blockscope.api.text_options import PositionOpt, Prompt
from blockscope.errors import BadValue

READ_AS = ("the lens reads every point with the model's final norm and unembedding; before "
           "the last block the model was never trained to be read that way, so early points "
           "show a basis, not what the model will say")


@dataclass
class LogitLens(Options):
    name: ClassVar[str] = "logit-lens"
    prompt: Prompt = group(Prompt)
    target: TargetOpt = None
    contrast: Annotated[str | None, typer.Option(
        help="Attribute the logit difference target - contrast (e.g. ' London').",
        show_default=False)] = None
    position: PositionOpt = -1
    all_positions: Annotated[bool, flag("--all-positions", help="Every token: a points x "
                                        "positions grid of top-1 tokens.")] = False
    top_k: Annotated[int, typer.Option(help="Tokens shown per point.")] = 3
    attribution: Annotated[bool, flag("--attribution/--no-attribution", help="Direct logit "
                                      "attribution of the target at the position.")] = True
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    def check(self) -> None:
        if self.all_positions and self.position != -1:
            raise BadValue("give `position` or `all_positions`, not both")
        at_least(1, top_k=self.top_k)
        tokens_given(target=self.target, contrast=self.contrast)

    def check_sizes(self, sizes: dict) -> None:
        if sizes.get("d_vocab"):
            at_most(sizes["d_vocab"], f"the model's {sizes['d_vocab']:,} tokens",
                    top_k=self.top_k)

    def positions(self, n: int) -> list[int]:
        return pick_positions(n, self.position, self.all_positions)


@command
def logit_lens(o: LogitLens):
    """The logit lens: at every point of the residual stream, the model's own final norm and
    unembedding; and each component's direct contribution to the target's logit.

    Example: blockscope logit-lens "The capital of France is" --target " Paris"
    """
    from blockscope.experiments import logit_lens as experiment

    started = time.perf_counter()
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, check_length=o.positions,
                     check=o.check_all_sizes,
                     check_text=one_token_each(target=o.target, contrast=o.contrast))
    lm, tokens, spec = run.model, run.tokens, run.spec
    positions = o.positions(tokens.shape[-1])
    wanted = None if o.target is None else experiment.target_id(lm.tokenizer, o.target)
    against = None if o.contrast is None else experiment.target_id(lm.tokenizer, o.contrast,
                                                                    "contrast")
    df = experiment.lens(lm, tokens, positions=positions, k=o.top_k, target=wanted)
    pos, chosen = positions[-1], int(df["target_id"].iloc[-1])  # the target attributed
    attrs = (experiment.attribution(lm, tokens, position=pos, target=chosen, contrast=against)
             if o.attribution else None)
    meta = run.meta("logit-lens", o.prepend_bos, started, positions=positions,
                    target=df["target"].iloc[-1], contrast=o.contrast, top_k=o.top_k,
                    read_as=READ_AS, attribution=None if attrs is None else {
                        "position": pos, "logit": attrs.attrs["logit"],
                        **experiment.ATTRIBUTION_MEANS})
    stem = f"logit-lens-{spec.slug}{'-all' * o.all_positions}"
    extra = {}
    if o.out.plot:
        from blockscope.results import mlp_plots as plots

        title = f"{spec.label} on {run.shown()!r}"
        extra[f"{stem}.png"] = (plots.lens_grid_plot(df, title) if o.all_positions
                                else plots.lens_plot(df, attrs, title))
    return write(o, stem, {"": df} if attrs is None else {"": df, "-attribution": attrs}, meta,
                 extra=extra, shown=render(df, attrs, spec.label, o.all_positions, o.contrast))


def render(df, attrs, label: str, grid: bool, contrast: str | None) -> list:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    said = []
    if grid:
        top = df.pivot(index="point", columns="position", values="top1").reindex(
            df["point"].unique())
        shown = top.map(visible).reset_index()
        said.append(table(shown, {"point": ("after", "s"), **{c: (str(c), "s") for c in
                                                           top.columns}},
                        title=f"{label}: the lens's top-1 token at every point and position",
                        caption=READ_AS))
        return said
    k = sum(c.startswith("top") for c in df.columns)
    shown = df.assign(top=[" ".join(f"{visible(r[f'top{i}'])}:{r[f'p{i}']:.2f}"
                                    for i in range(1, k + 1)) for _, r in df.iterrows()])
    target = visible(df["target"].iloc[-1])
    said.append(table(shown, {"point": ("after", "s"), "top": (f"top {k} (probability)", "s"),
                            "target_rank": (f"rank of {target}", ",d"),
                            "target_prob": ("its probability", ".4f"),
                            "kl_from_final": ("KL from final", ".3f")},
                    title=f"{label}: the logit lens at position {int(df['position'].iloc[-1])}"
                    f" ({visible(df['token'].iloc[-1])})", caption=READ_AS))
    if attrs is not None:
        blocks = attrs[attrs["level"] == "block"]
        top = blocks.reindex(blocks["contribution"].abs().sort_values(ascending=False).index)
        what = f"{target} - {visible(contrast)}" if contrast else target
        said.append(table(top.head(8), {"component": ("component", "s"),
                                      "contribution": ("direct logit", "+.3f")},
                        title=f"largest direct contributions to the logit of {what} "
                        f"({attrs.attrs['logit']:.3f})",
                        caption="blocks count from 0; every "
                        "component, and each head (layer.head from 0), is in the CSV"))
    return said
