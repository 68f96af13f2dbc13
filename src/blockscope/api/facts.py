"""What the fact commands (`trace`, `knockout`) share: the subject and target options, one
prompt's subject span and answer, and the run over many facts (--facts), shared across
processes under torchrun."""

from __future__ import annotations

from typing import Annotated

import typer

SubjectOpt = Annotated[str, typer.Option(help="The subject as it appears in the prompt "
                                         "('France').", show_default=False)]
FactsOpt = Annotated[str | None, typer.Option(
    help="Run every fact of a JSONL file (prompt, subject, target; 'builtin': blockscope's "
    "153) and average over them, with bootstrap intervals over facts.", show_default=False)]
AllFactsOpt = Annotated[bool, typer.Option(
    "--all-facts", help="Keep every fact, not only those the model knows (its top-1 is the "
    "target), e.g. to time a random-weight model.")]
FactTargetOpt = Annotated[str | None, typer.Option(
    help="The answer, one token with its space (' Paris'). Default: the model's own top-1.",
    show_default=False)]


def window_of(o, lm, paper: int) -> int:
    """`o.window` (checked against the block count), or the paper's where not given: every
    block of a model with fewer."""
    return o.window if o.window is not None else min(paper, lm.cfg.n_layers)


def check_facts(o) -> None:
    """A prompt or --facts, not both; --all-facts only with --facts."""
    from blockscope.errors import BadValue, BlockscopeError
    from blockscope.inputs.parallel import world_size

    given = o.prompt.prompt is not None or o.prompt.text is not None
    if o.facts is None and world_size() > 1:
        raise BlockscopeError("under torchrun the facts of `facts` are shared across "
                              "processes; one prompt runs in one process")
    if o.facts is not None and (given or o.subject or o.target):
        raise BadValue("give a prompt (with `subject`) or `facts`, not both")
    if o.all_facts and o.facts is None:
        raise BadValue("`all_facts` goes with `facts`")


def many_facts(o, name: str, run, keys: list[str], value: str, started: float,
               before=None):
    """Every fact of --facts (those the model knows, unless --all-facts) through `run(model,
    tokens, span, target)`, after `before(model, the facts kept)`: the per-fact rows, their
    averages, and the sidecar's record (None on a process that does not write, under
    torchrun). The facts are read and their texts checked before the model loads."""
    from blockscope.api.common import checked_load, err, model_spec
    from blockscope.errors import BadValue
    from blockscope.experiments import facts as fx
    from blockscope.inputs import parallel
    from blockscope.results.progress import progress_bar

    facts = fx.read_facts(o.facts)
    spec = model_spec(o.load.model, o.load.held, device=parallel.local_device(o.load.device),
                      dtype=o.load.dtype.value, bos_token=o.bos_token)
    comm = parallel.from_env(spec.device)
    quiet = o.out.quiet or not comm.writes
    lm = checked_load(spec, o.load.allow_pickle, quiet, o.check_all_sizes, o.load.held,
                      # every fact's texts checked before the model loads
                      before=lambda tokenizer, sizes: fx.check_texts(tokenizer, facts, o.facts,
                                                                     o.prepend_bos))
    items = fx.prepared(lm, facts, o.prepend_bos)
    kept = items if o.all_facts else [i for i in items if i["known"]]
    if not kept:
        raise BadValue(f"{spec.label} knows none of the {len(facts)} facts (its top-1 "
                              "is the target for none); `all_facts` keeps every fact")
    if not quiet:
        err.print(f"{len(kept)} of {len(facts)} facts {'kept' if o.all_facts else 'known'} "
                  f"({spec.label}'s top-1 is the target's first token for "
                  f"{sum(i['known'] for i in items)})", highlight=False, soft_wrap=True)
    if before is not None:
        before(lm, kept)
    with progress_bar(err, len(kept), f"{name} over facts", not quiet,
                      o.out.reporter) as tick:
        per_fact, avg = fx.over(kept, lambda t, s, g: run(lm, t, s, g), keys, value, tick,
                                comm, o.out.partial)
    record = {"facts": o.facts, "n_facts": len(facts), "n_known": sum(i["known"] for i in items),
              "n_used": len(kept), "all_facts": o.all_facts, "categories": list(fx.CATEGORIES),
              "interval": "95% percentile bootstrap over facts, 1000 resamples, seed 0",
              "used": [{"prompt": i["fact"].prompt, "subject": i["fact"].subject,
                        "target": i["fact"].target} for i in kept], "processes": comm.size}
    if not comm.writes:  # rank 0 alone prints and writes
        return None
    return spec, lm, per_fact, avg, record


def answer(lm, tokens, target: str | None) -> int:
    """The target's token id, or the model's own top-1 at the last position."""
    import torch

    from blockscope.experiments.logit_lens import target_id

    if target is not None:
        return target_id(lm.tokenizer, target)
    with torch.inference_mode():
        return int(lm(tokens.to(lm.cfg.device), return_type="logits")[0, -1].argmax())


def fact_prompt(o):
    """The prompt run, the subject's token span, the target id and its text."""
    from blockscope.api.prompts import one_token_each, prompt_run
    from blockscope.experiments.trace import subject_span

    text = o.prompt.read()[0]

    def check_text(tokenizer, tokens) -> None:
        subject_span(tokenizer, tokens[0].tolist(), o.subject, prompt=text)
        one_token_each(target=o.target)(tokenizer, tokens)

    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token, check_text=check_text, check=o.check_all_sizes)
    span = subject_span(run.model.tokenizer, run.tokens[0].tolist(), o.subject, prompt=text)
    target = answer(run.model, run.tokens, o.target)
    return run, span, target, run.model.tokenizer.decode([target])
