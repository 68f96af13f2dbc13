"""`blockscope mlp-memory`: the MLP neurons that write the answer, as keys and values."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
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
    group,
    tokens_given,
)
from blockscope.api.output import write
from blockscope.api.prompts import one_token_each, pick_positions, prompt_run
from blockscope.api.text_options import Dataset, PositionOpt, Prompt
from blockscope.errors import BadValue

KEYS_READ = ("every document's tokens but its first, each position once, ranked by "
             "activation x the sign it has on the prompt")


@dataclass
class MlpMemory(Options):
    name: ClassVar[str] = "mlp-memory"
    prompt: Annotated[str, typer.Argument(help="The prompt.")]
    text: Annotated[Path | None, typer.Option(
        "--text", "-t", help="A UTF-8 passage to find each neuron's keys in: the contexts "
        "that trigger it most.", show_default=False)] = None
    data: Dataset = group(Dataset)
    n_examples: Annotated[int, typer.Option(help="Trigger contexts per neuron.")] = 5
    target: TargetOpt = None
    contrast: Annotated[str | None, typer.Option(
        help="Follow the logit difference target - contrast.", show_default=False)] = None
    position: PositionOpt = -1
    n_layers: Annotated[int, typer.Option(help="MLP layers shown: those writing most "
                                          "toward the target.")] = 3
    per_layer: Annotated[int, typer.Option(help="Neurons per layer.")] = 5
    top_k: Annotated[int, typer.Option(help="Tokens a neuron's write promotes and "
                                       "suppresses.")] = 5
    method: Annotated[str, typer.Option(help="How the chosen neurons are removed for the "
                                        "check: zero, or mean (over the prompt).")] = "zero"
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    load: Load = group(Load)
    out: Output = group(Output)

    def check(self) -> None:
        at_least(1, n_layers=self.n_layers, per_layer=self.per_layer, top_k=self.top_k,
                 n_examples=self.n_examples)
        tokens_given(target=self.target, contrast=self.contrast)
        if self.method not in ("zero", "mean"):
            raise BadValue(f"`method` must be zero or mean (got {self.method!r})")

    def check_sizes(self, sizes: dict) -> None:
        if sizes.get("n_layers"):
            at_most(sizes["n_layers"], f"the model's {sizes['n_layers']} blocks",
                    n_layers=self.n_layers)
        if sizes.get("d_mlp"):
            at_most(sizes["d_mlp"], f"the model's {sizes['d_mlp']:,} neurons a layer",
                    per_layer=self.per_layer)
        if sizes.get("d_vocab"):
            at_most(sizes["d_vocab"], f"the model's {sizes['d_vocab']:,} tokens",
                    top_k=self.top_k)

    def position_in(self, n: int) -> int:
        return pick_positions(n, self.position, False)[0]

    def corpus(self):
        """The keys' corpus (--text or --dataset), or None."""
        if self.text is None and self.data.dataset is None:
            return None
        return self.data.source(self.text, prepend_bos=self.prepend_bos)


@command
def mlp_memory(o: MlpMemory):
    """The MLP as a key-value memory (Geva et al.): the neurons whose activation x value
    adds most to the target's logit, what their writes promote, and what removing them does.

    Example: blockscope mlp-memory "The capital of France is" --target " Paris"
    """
    from blockscope.experiments import mlp_memory as experiment

    started = time.perf_counter()
    from blockscope.inputs.text import read_passage

    corpus, docs = o.corpus(), None
    passage = read_passage(o.text) if o.text is not None else None  # refused before the load
    run = prompt_run(Prompt(o.prompt), o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, check_length=o.position_in,
                     check=o.check_all_sizes,
                     check_text=one_token_each(target=o.target, contrast=o.contrast))
    lm, tokens, spec = run.model, run.tokens, run.spec
    if corpus is not None:
        docs = read_keys_corpus(corpus, passage, lm, o.out.quiet)
    pos = o.position_in(tokens.shape[-1])
    wanted, against = targets(o, lm, tokens, pos)
    layers, df = experiment.neurons(lm, tokens, position=pos, target=wanted, contrast=against,
                                    n_layers=o.n_layers, per_layer=o.per_layer, k=o.top_k,
                                    method=o.method)
    label = lm.tokenizer.decode([wanted])
    keys = None if docs is None else experiment.triggers(
        lm, docs, [(int(r.layer), int(r.neuron), 1.0 if r.activation >= 0 else -1.0)
                   for r in df.itertuples()], n_examples=o.n_examples)
    meta = run.meta("mlp-memory", o.prepend_bos, started, position=pos, target=label,
                    contrast=o.contrast, removal=df.attrs, keys=None if docs is None else {
                        "corpus": docs.record, "n_examples": o.n_examples, "read": KEYS_READ},
                    contribution=experiment.CONTRIBUTION)
    frames = {"": df, "-layers": layers, **({} if keys is None else {"-keys": keys})}
    stem = f"mlp-memory-{spec.slug}"
    extra = {}
    if o.out.plot:
        from blockscope.results.mlp_plots import memory_plot

        extra[f"{stem}.png"] = memory_plot(df, keys, f"{spec.label}: the MLP neurons writing "
                                           f"{label!r} on {o.prompt!r}")
    return write(o, stem, frames, meta, extra=extra,
                 shown=render(layers, df, spec.label, label, keys))


def targets(o: MlpMemory, lm, tokens, pos: int) -> tuple[int, int | None]:
    """The target token (the model's own top-1 when not given) and the contrast's, if any."""
    from blockscope.experiments import logit_lens

    if o.target is None:
        wanted = int(logit_lens.lens(lm, tokens, positions=[pos], k=1)["target_id"].iloc[-1])
    else:
        wanted = logit_lens.target_id(lm.tokenizer, o.target)
    return wanted, (None if o.contrast is None
                    else logit_lens.target_id(lm.tokenizer, o.contrast, "contrast"))


def read_keys_corpus(source, passage, lm, quiet: bool):
    """The keys' corpus as `corpus.Docs` (the --text `passage`, or the --dataset), read
    with the loaded model's tokenizer."""
    from blockscope.api.common import err, status
    from blockscope.inputs.corpus import load_docs, passage_docs
    from blockscope.inputs.parallel import Comm

    if passage is not None:
        docs = passage_docs(passage, lm.tokenizer, source, Comm())
    else:
        with status(f"reading {source.dataset}", quiet):
            docs = load_docs(source, lm.tokenizer, Comm())
    if not quiet:
        n, d = docs.record["n_tokens"], docs.record.get("n_docs", 1)
        err.print(f"keys read in {n:,} tokens of {passage.path.name if passage else source.dataset}"
                  f"{f' ({d:,} documents)' if d > 1 else ''}", highlight=False, soft_wrap=True)
    return docs


def render(layers, df, label: str, target: str, keys=None) -> list:
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    said = []
    shown = layers.assign(block=layers["layer"])  # blocks count from 0, as the CSV
    said.append(table(shown, {"block": ("block", "d"), "contribution": ("MLP's direct logit",
                                                                      "+.3f"),
                            "share_of_logit": ("of the logit", ".1%"),
                            "top_share": ("of it, the neurons below", ".1%")},
                    title=f"{label}: the MLPs writing most toward {visible(target)}",
                    caption="blocks count from 0"))
    neat = df.assign(block=df["layer"],
                     promotes=df["promotes"].map(lambda s: " ".join(map(visible,
                                                                        s.split("|")))))
    said.append(table(neat, {"block": ("block", "d"), "neuron": ("neuron", "d"),
                           "activation": ("activation", "+.2f"),
                           "contribution": ("direct logit", "+.3f"),
                           "target_rank": (f"rank of {visible(target)} in its write", ",d"),
                           "promotes": ("its write promotes", "s")},
                    title="the neurons adding most (activation x value)"))
    if keys is not None:
        first = keys[keys["rank"] == 1].assign(block=keys["layer"], context=keys[
            "context"].map(lambda c: " ".join(c[-60:].split())))  # one line, spaces kept
        said.append(table(first, {"block": ("block", "d"), "neuron": ("neuron", "d"),
                                "activation": ("activation", "+.2f"),
                                "context": ("the context that triggers it most", "s")},
                        title="each neuron's key: the corpus context firing it most",
                        caption="all top contexts are in the -keys CSV"))
    a = df.attrs
    said.append((f"removing these {a['n_removed']} neurons ({a['method']}): the probability "
                 f"of {visible(target)} goes from {a['prob_before']:.4f} to "
                 f"{a['prob_after']:.4f}", {"highlight": False, "soft_wrap": True}))
    return said
