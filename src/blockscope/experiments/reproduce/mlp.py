"""The reproduce report's MLP section: the article's Step 2 ("the MLP, a memory per token")
and Step 3 (the last block "writes its notes right before the vector becomes logits"),
tested on the loaded model with `logit-lens` and `mlp-memory`'s own functions.

The article gives no figures here, only claims; each is set beside what was measured and
the test used, and "NOT shown" where the measurement does not bear it out."""

from __future__ import annotations

import pandas as pd

from blockscope.experiments.reproduce.figures import no_stage


def mlp_measures(model, settings: dict, stage=no_stage) -> tuple[pd.DataFrame, dict]:
    """The [mlp] settings' prompt and target through the lens, the direct logit
    attribution and the MLP neurons (their values, their keys on the text): (each claim
    beside what was measured, {"mlp-lens", "mlp-attribution", "mlp-neurons", "mlp-keys"})."""
    from blockscope.errors import BadValue
    from blockscope.experiments import logit_lens, mlp_memory
    from blockscope.inputs.corpus import Source, passage_docs
    from blockscope.inputs.text import read_passage, tokenize

    s = settings["mlp"]
    tokens = tokenize(model.tokenizer, s["prompt"], prepend_bos=True)
    try:
        target = logit_lens.target_id(model.tokenizer, s["target"])
    except BadValue as exc:  # " Paris" is several tokens in this tokenizer
        return _not_measured(s, str(exc)), {}
    causal = "subject" in s
    with stage("the MLP section: lens, attribution, neurons and their keys"
               + ", causal trace" * causal, 4 + causal) as step:
        lens = logit_lens.lens(model, tokens, positions=[-1], k=10, target=target)
        step()
        attrs = logit_lens.attribution(model, tokens, position=-1, target=target)
        step()
        _, top = mlp_memory.neurons(model, tokens, position=-1, target=target,
                                    n_layers=s.get("n_layers", 3),
                                    per_layer=s.get("per_layer", 5), k=10)
        _, every = mlp_memory.neurons(model, tokens, position=-1, target=target,
                                      n_layers=model.cfg.n_layers, per_layer=2, k=1)
        step()
        source = Source(text=s.get("text", "data/alice.txt"), max_tokens=s.get("key_tokens"))
        docs = passage_docs(read_passage(source.text), model.tokenizer, source)
        keys = mlp_memory.triggers(model, docs, [(int(r.layer), int(r.neuron),
                                                  1.0 if r.activation >= 0 else -1.0)
                                                 for r in every.itertuples()],
                                   n_examples=s.get("n_examples", 5))
        step()
        traced = None
        if causal:
            from blockscope.experiments import trace

            span = trace.subject_span(model.tokenizer, tokens[0].tolist(), s["subject"])
            std, _ = trace.noise_std(model, "subjects", [s["subject"]])  # trace's default
            traced = trace.trace(model, tokens, span, target=target, kinds=("mlp", "attn"),
                                 std=std)
            step()
    rows = [_written_late(lens, model.cfg.n_layers, s["target"]),
            _last_block(attrs, model.cfg.n_layers), _values(top, s["target"]),
            _keys(keys, model.cfg.n_layers, source.text)]
    if traced is not None:
        rows += causal_claims(traced, span, model.cfg.n_layers, tokens.shape[-1])
    frames = {"mlp-lens": lens, "mlp-attribution": attrs, "mlp-neurons": top, "mlp-keys": keys}
    if traced is not None:
        frames["mlp-trace"] = traced
    return pd.DataFrame(rows), frames


CAUSAL_MIN = 0.5  # the peak restores at least half of what the noise took away


def causal_claims(traced: pd.DataFrame, span: tuple[int, int], n_layers: int,
                  n_tokens: int) -> list[dict]:
    """ROME's two findings, tested on a causal trace of the prompt: the MLP restoration
    effect peaks at the subject's last token in the first half of the blocks, and the
    attention effect at the last token in a later block. Each needs the noise to have taken
    the answer away (p_clean - p_corrupted above 0.1) and the peak to restore at least
    CAUSAL_MIN of that: a random model, which knows nothing, shows neither."""
    a = traced.attrs
    lost = a["p_clean"] - a["p_corrupted"]

    def peak(kind):
        part = traced[traced["kind"] == kind]
        return part.loc[part["indirect_effect"].idxmax()]

    mlp, attn = peak("mlp"), peak("attn")
    enough = lambda r: lost > 0.1 and r["indirect_effect"] >= CAUSAL_MIN * lost  # noqa: E731
    where = lambda r: (f"block {int(r['layer'])} (window centre) at position "  # noqa: E731
                       f"{int(r['position'])} {r['token']!r}, indirect effect "
                       f"{r['indirect_effect']:+.3f}")
    said = f"P(target) {a['p_clean']:.3f} clean, {a['p_corrupted']:.3f} with the subject noised"
    mlp_ok = (enough(mlp) and int(mlp["position"]) == span[1] - 1
              and int(mlp["layer"]) < n_layers / 2)
    attn_ok = (enough(attn) and int(attn["position"]) == n_tokens - 1
               and int(attn["layer"]) > int(mlp["layer"]))
    need = (f"the noise takes P(target) down by over 0.1 and the peak restores at least "
            f"{CAUSAL_MIN:.0%} of that, ")
    return [
        _row("Causally (ROME's trace): the fact is recalled by MLPs at the subject's last "
             "token, in the lower half of the blocks",
             f"{said}; restoring 10 MLP outputs peaks at {where(mlp)}",
             need + "at the subject's last token, centred in the first half of the blocks",
             mlp_ok),
        _row("Causally (ROME's trace): attention then moves it to the last token, later",
             f"restoring 10 attention outputs peaks at {where(attn)}",
             need + "at the last token, in a later block than the MLP peak", attn_ok)]


def _row(claim: str, measured: str, test: str, shown: bool) -> dict:
    return {"claim": claim, "measured": measured, "test": test, "shown": bool(shown)}


def _written_late(lens: pd.DataFrame, n_layers: int, target: str) -> dict:
    """Where the target enters the lens's top 10 and its top 1 (block 0: the embeddings)."""
    def first(rank: int):
        hit = lens[lens["target_rank"] <= rank]
        return None if hit.empty else hit.iloc[0]

    top10, top1 = first(10), first(1)
    block = lambda r: 0 if r is None or r["layer"] != r["layer"] else int(r["layer"]) + 1  # noqa: E731
    said = (f"{target!r} enters the top 10 at {top10['point'] if top10 is not None else 'no point'}"
            f", the top 1 at {top1['point'] if top1 is not None else 'no point'} of {n_layers} "
            f"blocks (final probability {lens['target_prob'].iloc[-1]:.2f})")
    late = top10 is not None and block(top10) > n_layers / 2
    return _row("The answer is written in the upper blocks: under the logit lens it reaches "
                "the top only near the end", said,
                "the target first enters the lens's top 10 in the upper half of the blocks",
                late)


def _last_block(attrs: pd.DataFrame, n_layers: int) -> dict:
    """The last block's direct contribution to the target's logit against every block's."""
    blocks = attrs[(attrs["level"] == "block") & attrs["half"].isin(["attn", "mlp"])]
    per = blocks.groupby("layer")["contribution"].sum()
    last, best = float(per.get(n_layers - 1, 0.0)), int(per.idxmax())
    return _row("The last block writes its notes right before the vector becomes logits",
                f"block {n_layers - 1}'s (the last) direct logit {last:+.2f}; the largest is "
                f"block {best}'s ({per.max():+.2f}) of the logit {attrs.attrs['logit']:.2f}",
                "the last block's direct contribution to the target's logit is the largest "
                "of any block's", best == n_layers - 1)


def _values(top: pd.DataFrame, target: str) -> dict:
    """Whether the neurons writing most toward the target promote it through their values,
    and what removing them does to its probability."""
    a = top.attrs
    rank = int(top["target_rank"].min())
    return _row("An MLP neuron's value pushes the stream toward the next word (Geva et al.): "
                "the keys France and capital trip write toward Paris",
                f"the {a['n_removed']} neurons adding most to {target!r}: removed "
                f"({a['method']}), its probability goes {a['prob_before']:.3f} -> "
                f"{a['prob_after']:.3f}; the best rank of {target!r} among their values' "
                f"top tokens is {rank:,}",
                "removing them lowers the target's probability, and the target is among "
                "the top 10 tokens of at least one of their values",
                a["prob_after"] < a["prob_before"] and rank <= 10)


def _keys(keys: pd.DataFrame, n_layers: int, text) -> dict:
    """Surface patterns below, meaning above, read off each neuron's trigger examples: the
    share of its top contexts that end on its most common trigger token (a surface pattern
    repeats one token; a topic fires on many)."""
    same = keys.groupby(["layer", "neuron"])["trigger"].agg(
        lambda t: t.value_counts().iloc[0] / len(t)).reset_index()
    third = max(1, n_layers // 3)
    low = same[same["layer"] < third]["trigger"].mean()
    high = same[same["layer"] >= n_layers - third]["trigger"].mean()
    return _row("Lower layers' keys catch surface patterns, upper layers' meaning",
                f"the 2 neurons per layer writing most toward the target, keys on "
                f"{getattr(text, 'name', text)}: their top contexts end on one same token "
                f"{low:.0%} of the time in the lowest third of the blocks, {high:.0%} in the "
                "upper third", "a proxy: the lower third's keys repeat one trigger token "
                "more often than the upper third's", low > high)


def _not_measured(s: dict, why: str) -> pd.DataFrame:
    return pd.DataFrame([_row(c, f"not measured: {why}", "", False)
                         for c in s.get("claims", [])])


def mlp_section(settings: dict, claims, name: str) -> list[str]:
    """The report's MLP section: the article's words, then each claim as measured."""
    if "mlp" not in settings:
        return []
    s = settings["mlp"]
    lines = [f"## {s.get('section', 'the MLP')}", "", "The article says:", ""]
    lines += [f"> {c}" for c in s.get("claims", [])] + [""]
    if claims is None:
        return lines + ["Needs the model: `blockscope logit-lens` and `blockscope mlp-memory` "
                        f"with --model MODEL on {s['prompt']!r}.", ""]
    lines += [f"Measured on {name} with `blockscope logit-lens` and `blockscope mlp-memory`, "
              f"prompt {s['prompt']!r}, target {s['target']!r}:", "",
              "| claim | measured | test | shown |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.claim} | {r.measured} | {r.test} | {'yes' if r.shown else 'NOT shown'} |"
              for r in claims.itertuples()]
    return lines + [""]
