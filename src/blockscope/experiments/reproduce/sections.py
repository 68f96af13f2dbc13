"""The reproduce report's sections beyond the article's figures: the article's claims on
any model, pre- vs post-norm (`norm-placement`'s claims) and known head roles (references,
not the article's).

The measures take the reference's settings (src/blockscope/data/article.toml) and return
DataFrames; the `*_section` functions turn them into the report's markdown lines."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from blockscope.experiments.reproduce.figures import no_stage


def norm_measures(settings: dict, stage=None) -> tuple[pd.DataFrame, dict]:
    """`norm-placement` with the reference's [norm_placement] settings: (each claim beside
    what was measured, {"norm-init": per-layer summary, "norm-train": training rows});
    `stage` as `reproduce.model_measures` takes it."""
    from blockscope.experiments import norm_placement as npl
    from blockscope.experiments.norm_stack import StackConfig
    from blockscope.inputs.text import read_passage
    from blockscope.model.configs import load_config

    s = settings["norm_placement"]
    tc = npl.TrainConfig(steps=s.get("train_steps", 300), warmup_steps=s.get("warmup_steps", 100),
                         lrs=tuple(s.get("lrs", (3e-4, 1e-3, 3e-3))),
                         batch_size=s.get("batch_size", 16),
                         seq_len=s.get("seq_len", 64), seed=s.get("seed", 0))
    tc.check()
    init_cfg = StackConfig.from_hf(load_config(s.get("model", "gpt2")),
                                   n_layers=s.get("n_layers"), d_model=s.get("d_model"),
                                   n_heads=s.get("n_heads"))
    init_cfg = replace(init_cfg, n_ctx=min(init_cfg.n_ctx, s.get("max_tokens", 256)))
    train_cfg = StackConfig.gpt2_shaped(s.get("train_layers", 4), s.get("train_d_model", 96),
                                        s.get("train_heads", 4), n_ctx=tc.seq_len,
                                        d_vocab=256)
    data = npl.byte_ids(read_passage(s.get("text", "data/alice.txt")).text)
    seeds = s.get("seeds", 5)
    with (stage or no_stage)("norm-placement: gradients at initialization, then training",
                             4 * seeds + 4 * len(tc.lrs) * tc.steps) as step:
        _, trained, summary, claims = npl.run_all(init_cfg, train_cfg, data, tc,
                                                  max_tokens=s.get("max_tokens", 256),
                                                  seeds=seeds, progress=(step, step))
    return claims, {"norm-init": summary, "norm-train": trained}


def head_role_checks(model, settings: dict, other: str | None = None,
                     top: int = 3) -> pd.DataFrame:
    """For each known head in [head_roles] `known`: its score, its rank in that role, and
    whether it is in the role's top 5 here (`status`: found / not in the top 5 / not in
    this model). The known heads' indices name GPT-2 small's heads: on `other`, another
    model, the same indices mean nothing, so the model's own `top` heads per role are listed
    instead, each saying which GPT-2 heads the role's references are."""
    from blockscope.experiments import head_roles as hr
    from blockscope.inputs.text import read_passage, tokenize

    s = settings["head_roles"]
    text = read_passage(s.get("text", "data/alice.txt")).text
    tokens = tokenize(model.tokenizer, text, prepend_bos=True,
                      max_tokens=s.get("max_tokens", 200))[:, : model.cfg.n_ctx]  # fits
    scores = hr.role_scores(model, tokens, hr.repeated_random(model, s.get("n_random", 50),
                                                              s.get("seed", 0)))
    rows = []
    cfg = model.cfg
    if (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab) != (12, 12, 768, 50257):
        other = other or "this model"  # not GPT-2 small's shape: its indices name other heads
    if other:
        for role in dict.fromkeys(k["role"] for k in s.get("known", [])):
            refs = ", ".join(f"{k['layer']}.{k['head']}" for k in s["known"]
                             if k["role"] == role)
            ranked = scores.sort_values(role, ascending=False, kind="stable").head(top)
            for rank, r in enumerate(ranked.itertuples(), 1):
                rows.append({"role": role, "head": f"{r.layer}.{r.head}",
                             "source": f"{other}'s own top {top}",
                             "score": float(getattr(r, role)), "rank": rank,
                             "status": f"GPT-2 small's references: {refs}"})
        found = pd.DataFrame(rows)
        found.attrs["title"] = (f"{other}'s top heads per role (the reference indices are "
                                "GPT-2 small's)")
        return found
    for known in s.get("known", []):
        role, layer, head = known["role"], int(known["layer"]), int(known["head"])
        row = {"role": role, "head": f"{layer}.{head}", "source": known.get("source", ""),
               "score": None, "rank": None, "status": "not in this model"}
        hit = scores[(scores["layer"] == layer) & (scores["head"] == head)]
        if len(hit):
            ranked = scores.sort_values(role, ascending=False, kind="stable").reset_index()
            where = (ranked["layer"] == layer) & (ranked["head"] == head)
            rank = int(ranked.index[where][0]) + 1
            row.update(score=float(hit[role].iloc[0]), rank=rank,
                       status="found in the top 5" if rank <= 5 else "not in the top 5")
        rows.append(row)
    return pd.DataFrame(rows)


ARTICLE_BOS_VARIANT = "no BOS, raw weights"  # the article's 5-token prompt, raw HF weights


def one_correction(split: pd.DataFrame) -> tuple:
    """The article's explanation of its opening experiment, tested on `ablate --decompose`'s
    split: (claim, article, measured, test, shown)."""
    middle = split.iloc[1:-1]  # blocks 1 .. n-2, the middle ones
    ratio = float((middle["total"] / middle["direct"]).median()) if len(middle) else float("nan")
    repair = float(middle["self_repair"].median()) if len(middle) else float("nan")
    return ("removing a block removes one correction: a middle block's effect on the logit "
            "is its own write", "the article's explanation; no figure",
            f"median middle block: total / own write x{ratio:.2f}, self-repair {repair:.0%} "
            "(centred logit of the correct token)",
            "the median middle block's total change is within a factor of 1.5 of its own "
            "write's (x0.67 to x1.5)", len(middle) > 0 and 1 / 1.5 <= ratio <= 1.5)


def article_claims(figures, measured: dict, frames: dict, model: str) -> pd.DataFrame:
    """The article's qualitative claims, each with the article's GPT-2 figures beside what
    was measured on `model`, the test written out, and whether it is shown. For a model
    other than the article's these are the comparison that means something: its own
    figures are not the article's off by a difference."""
    fig = {f.measure: f.value for f in figures}
    rows = []

    def add(claim, article, got, test, shown):
        rows.append({"claim": claim, "article": article, "measured": got, "test": test,
                     "shown": bool(shown)})

    if "ablate" in frames and {"ablate.baseline", "ablate.block1"} <= set(fig):
        ratios = frames["ablate"]["ratio"].iloc[1:].reset_index(drop=True)  # per block
        first, middle = float(ratios.iloc[0]), ratios.iloc[1:-1]
        base = fig["ablate.baseline"]
        lo = fig.get("ablate.middle_min", base) / base
        hi = fig.get("ablate.middle_max", base) / base
        if len(middle):
            med = float(middle.median())
            add("the first block matters far more than a middle one",
                f"the first block x{fig['ablate.block1'] / base:,.0f}; middle "
                f"x{lo:.2f}-x{hi:.2f}",
                f"block 0 (the first) x{first:,.1f}; middle "
                f"x{middle.min():.2f}-x{middle.max():.2f} (median x{med:.2f})",
                "the first block's perplexity increase is at least 10 times the median middle "
                "block's", first - 1 >= 10 * (med - 1))
            add("skipping a middle block costs little",
                f"+{lo - 1:.0%} to +{hi - 1:.0%}",
                f"median +{med - 1:.0%}, at most +{float(middle.max()) - 1:.0%}",
                "the median middle block (1 to n-2) raises perplexity by less than 50%",
                med < 1.5)
    if "ablate-decompose" in frames:
        add(*one_correction(frames["ablate-decompose"]))
    growth = measured.get(f"resid.growth|{ARTICLE_BOS_VARIANT}")
    if growth is not None and "resid.growth" in fig:
        add("the residual stream grows many times", f"x{fig['resid.growth']:,.0f}",
            f"x{growth:,.1f} ({ARTICLE_BOS_VARIANT})",
            "the norm after the last block is at least 10 times the embeddings'", growth >= 10)
    if "prune.heads_removed" in measured:
        add("some share of the heads can go within 5% perplexity",
            "many can (Michel et al., Voita et al.); no figure",
            f"{int(measured['prune.heads_removed'])} of {int(measured['prune.n_heads'])} "
            f"({measured['prune.share']:.0%}), gradient order",
            "at least one head removed with perplexity within +5%",
            measured["prune.heads_removed"] > 0)
    df = pd.DataFrame(rows, columns=["claim", "article", "measured", "test", "shown"])
    df.attrs["headers"] = {"claim": "claim", "article": "the article (GPT-2 small)",
                           "measured": f"measured ({model})", "test": "test", "shown": "shown"}
    return df


def claims_section(claims, other: str | None) -> list[str]:
    """The report's section on the article's claims, the article's GPT-2 figures beside
    what was measured."""
    if claims is None or not len(claims):
        return []
    lines = ["## the article's claims", ""]
    if other:
        lines += [f"Measured on {other}, not the article's model: its figures are its own, "
                  "so the claims are what is compared.", ""]
    lines += ["| " + " | ".join(claims.attrs["headers"].values()) + " |",
              "| " + " | ".join("---" for _ in claims.columns) + " |"]
    lines += ["| " + " | ".join(("yes" if v else "NOT shown") if k == "shown" else str(v)
                                for k, v in r.items()) + " |"
              for r in claims.to_dict(orient="records")]
    return lines + [""]


def roles_section(settings: dict, roles, name: str) -> list[str]:
    """The report's head-roles section: which known heads are in each role's top 5."""
    if "head_roles" not in settings:
        return []
    s = settings["head_roles"]
    lines = [f"## {s.get('section', 'head roles')}", ""]
    if roles is None:
        return lines + ["Needs the model: `blockscope head-roles --model MODEL`.", ""]
    intro = (f"Known heads (references, not the article's figures) against blockscope's "
             f"head-roles scores on {name}:")
    if "title" in roles.attrs:  # not GPT-2 small: its own top heads, not GPT-2's indices
        intro = (f"The reference heads' indices name GPT-2 small's heads, so on {name} its "
                 "own top heads per role are listed, by blockscope's head-roles scores:")
    lines += [intro, "",
              "| role | head | score | rank | status | source |",
              "| --- | --- | ---: | ---: | --- | --- |"]
    for r in roles.itertuples():
        score = "" if r.score is None or r.score != r.score else f"{r.score:.3f}"
        rank = "" if r.rank is None or r.rank != r.rank else str(int(r.rank))
        lines.append(f"| {r.role} | {r.head} | {score} | {rank} | {r.status} | {r.source} |")
    return lines + [""]


def norm_section(settings: dict, claims) -> list[str]:
    """The report's pre- vs post-norm section: the article's claims, then what was measured."""
    if claims is None:
        return []
    s = settings["norm_placement"]
    lines = [f"## {s.get('section', 'norm-placement')}", "", "The article says:", ""]
    lines += [f"> {c}" for c in s.get("claims", [])] + [""]
    lines += ["Measured here (`blockscope norm-placement`, no pretrained weights):", "",
              "| claim | measured | test | shown |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.claim} | {r.measured} | {r.test} | {'yes' if r.shown else 'NOT shown'} |"
              for r in claims.itertuples()]
    return lines + [""]
