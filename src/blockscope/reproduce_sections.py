"""The reproduce report's sections beyond the article's figures: pre- vs post-norm
(`norm-placement`'s claims) and known head roles (references, not the article's).

Each takes the reference's settings (experiments/article.toml) and returns DataFrames."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd


def norm_measures(settings: dict) -> tuple[pd.DataFrame, dict]:
    """`norm-placement` with the reference's [norm_placement] settings: (each claim beside
    what was measured, {"norm-init": per-layer summary, "norm-train": training rows})."""
    from blockscope import norm_placement as npl
    from blockscope.loading import load_config
    from blockscope.norm_stack import StackConfig
    from blockscope.text import read_passage

    s = settings["norm_placement"]
    tc = npl.TrainConfig(steps=s.get("train_steps", 300), warmup_steps=s.get("warmup_steps", 100),
                         lr=s.get("lr", 3e-3), batch_size=s.get("batch_size", 16),
                         seq_len=s.get("seq_len", 64), seed=s.get("seed", 0))
    tc.check()
    init_cfg = StackConfig.from_hf(load_config(s.get("model", "gpt2")),
                                   n_layers=s.get("n_layers"), d_model=s.get("d_model"),
                                   n_heads=s.get("n_heads"))
    init_cfg = replace(init_cfg, n_ctx=min(init_cfg.n_ctx, s.get("max_tokens", 256)))
    train_cfg = StackConfig.gpt2_shaped(s.get("train_layers", 6), s.get("train_d_model", 128),
                                        s.get("train_heads", 4), n_ctx=tc.seq_len,
                                        d_vocab=256)
    data = npl.byte_ids(read_passage(s.get("text", "data/alice.txt")).text)
    _, trained, summary, claims = npl.run_all(init_cfg, train_cfg, data, tc,
                                              max_tokens=s.get("max_tokens", 256),
                                              seeds=s.get("seeds", 5))
    return claims, {"norm-init": summary, "norm-train": trained}


def head_role_checks(model, settings: dict) -> pd.DataFrame:
    """For each known head in [head_roles] `known`: its score, its rank in that role, and
    whether it is in the role's top 5 here (`status`: found / not in the top 5 / not in
    this model)."""
    from blockscope import head_roles as hr
    from blockscope.text import read_passage, tokenize

    s = settings["head_roles"]
    text = read_passage(s.get("text", "data/alice.txt")).text
    tokens = tokenize(model.tokenizer, text, prepend_bos=True, max_tokens=s.get("max_tokens", 200))
    scores = hr.role_scores(model, tokens, hr.repeated_random(model, s.get("n_random", 50),
                                                              s.get("seed", 0)))
    rows = []
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
