"""`blockscope logit-lens`: what each point of the stream predicts, and who writes the answer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

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
    PromptArg,
    PromptFileOpt,
    QuietOpt,
    app,
    early_tokens,
    flag,
    handled,
    load,
    model_record,
    out,
    prompt_text,
)
from blockscope.cli.output import write
from blockscope.cli.prompts import pick_positions
from blockscope.errors import BlockscopeError

READ_AS = ("the lens reads every point with the model's final norm and unembedding; before "
           "the last block the model was never trained to be read that way, so early points "
           "show a basis, not what the model will say")


@app.command("logit-lens")
@handled
def logit_lens(
    prompt: PromptArg = None,
    text: PromptFileOpt = None,
    target: Annotated[str | None, typer.Option(
        help="The token followed (one token, e.g. ' Paris', with its space). Default: the "
        "model's own top-1 at the last point.", show_default=False)] = None,
    contrast: Annotated[str | None, typer.Option(
        help="Attribute the logit difference target - contrast (e.g. ' London').",
        show_default=False)] = None,
    position: Annotated[int, typer.Option(help="Token index; negative counts from the end.")
                        ] = -1,
    all_positions: Annotated[bool, flag("--all-positions", help="Every token: a points x "
                                        "positions grid of top-1 tokens.")] = False,
    top_k: Annotated[int, typer.Option(help="Tokens shown per point.")] = 3,
    attribution: Annotated[bool, flag("--attribution/--no-attribution", help="Direct logit "
                                      "attribution of the target at the position.")] = True,
    prepend_bos: Annotated[bool, flag(help="Prepend BOS (see --bos-token), as the model saw "
                                      "documents start.")] = True,
    bos_token: BosTokenOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.float32,
    allow_pickle: PickleOpt = False,
    out_dir: OutDirOpt = Path("results"),
    plot: PlotOpt = True,
    quiet: QuietOpt = False,
    no_overwrite: NoOverwriteOpt = False,
) -> None:
    """The logit lens: at every point of the residual stream, the model's own final norm and
    unembedding; and each component's direct contribution to the target's logit.

    Example: blockscope logit-lens "The capital of France is" --target " Paris"
    """
    from blockscope.experiments import logit_lens as experiment
    from blockscope.model.loading import spec_for
    from blockscope.results.files import check_out_dir, sidecar

    started = time.perf_counter()
    if all_positions and position != -1:
        raise BlockscopeError("give --position or --all-positions, not both")
    if top_k < 1:
        raise BlockscopeError(f"--top-k must be at least 1 (got {top_k})")
    text_, source = prompt_text(prompt, text)
    spec = spec_for(model, device=device, dtype=dtype.value, bos_token=bos_token)
    out_path = check_out_dir(out_dir)
    early = early_tokens(spec, text_, prepend_bos)
    if early is not None:
        pick_positions(early.shape[-1], position, all_positions)
    lm = load(spec, allow_pickle, quiet)
    from blockscope.inputs.text import tokenize

    tokens = tokenize(lm.tokenizer, text_, prepend_bos=prepend_bos)
    positions = pick_positions(tokens.shape[-1], position, all_positions)
    wanted = None if target is None else experiment.target_id(lm.tokenizer, target)
    against = None if contrast is None else experiment.target_id(lm.tokenizer, contrast,
                                                                  "--contrast")
    df = experiment.lens(lm, tokens, positions=positions, k=top_k, target=wanted)
    pos = positions[-1]
    chosen = int(df["target_id"].iloc[-1])  # the target at the position attributed
    attrs = (experiment.attribution(lm, tokens, position=pos, target=chosen, contrast=against)
             if attribution else None)
    if not quiet:
        render(df, attrs, spec.label, all_positions, contrast)
    meta = sidecar(command="logit-lens", model=model_record(spec, lm), text=source,
                   tokens=tokens[0].tolist(), prepend_bos=prepend_bos, positions=positions,
                   target=df["target"].iloc[-1], contrast=contrast, top_k=top_k,
                   read_as=READ_AS, attribution=None if attrs is None else {
                       "position": pos, "logit": attrs.attrs["logit"],
                       "final_norm": "scale frozen at the clean pass (ln_final.hook_scale), "
                       "as TransformerLens's logit_attrs; each write centred first where the "
                       "norm is a LayerNorm", "softcap": "attributes the logit before any "
                       "final softcapping"},
                   dtype=spec.dtype, device=spec.device,
                   wall_time_s=round(time.perf_counter() - started, 3))
    frames = {"": df} if attrs is None else {"": df, "-attribution": attrs}
    stem = f"logit-lens-{spec.slug}{'-all' if all_positions else ''}"
    extra = {}
    if plot:
        from blockscope.results import mlp_plots as plots

        shown = text_ if len(text_) <= 40 else text_[:37] + "..."
        title = f"{spec.label} on {shown!r}"
        extra[f"{stem}.png"] = (plots.lens_grid_plot(df, title) if all_positions
                                else plots.lens_plot(df, attrs, title))
    write(out_path, stem, frames, meta, quiet, extra=extra)


def render(df, attrs, label: str, grid: bool, contrast: str | None) -> None:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    if grid:
        top = df.pivot(index="point", columns="position", values="top1").reindex(
            df["point"].unique())
        shown = top.map(visible).reset_index()
        out.print(table(shown, {"point": ("after", "s"), **{c: (str(c), "s") for c in
                                                           top.columns}},
                        title=f"{label}: the lens's top-1 token at every point and position",
                        caption=READ_AS))
        return
    k = sum(c.startswith("top") for c in df.columns)
    shown = df.assign(top=[" ".join(f"{visible(r[f'top{i}'])}:{r[f'p{i}']:.2f}"
                                    for i in range(1, k + 1)) for _, r in df.iterrows()])
    target = visible(df["target"].iloc[-1])
    out.print(table(shown, {"point": ("after", "s"), "top": (f"top {k} (probability)", "s"),
                            "target_rank": (f"rank of {target}", ",d"),
                            "target_prob": ("its probability", ".4f"),
                            "kl_from_final": ("KL from final", ".3f")},
                    title=f"{label}: the logit lens at position {int(df['position'].iloc[-1])}"
                    f" ({visible(df['token'].iloc[-1])})", caption=READ_AS))
    if attrs is not None:
        blocks = attrs[attrs["level"] == "block"]
        top = blocks.reindex(blocks["contribution"].abs().sort_values(ascending=False).index)
        what = f"{target} - {visible(contrast)}" if contrast else target
        out.print(table(top.head(8), {"component": ("component", "s"),
                                      "contribution": ("direct logit", "+.3f")},
                        title=f"largest direct contributions to the logit of {what} "
                        f"({attrs.attrs['logit']:.3f})",
                        caption="blocks counted from 1, as the lens's points; every "
                        "component, and each head (layer.head from 0), is in the CSV"))
