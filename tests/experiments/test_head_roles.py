"""head-roles and attention: scores against the "mul" definition written out on HF's own
attention weights, a hand-built previous-token head, the CSVs, the join, bad input."""

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.experiments.head_roles import ROLES, repeated_random, role_scores
from blockscope.inputs.text import tokenize
from blockscope.model.loading import load_model, spec_for
from blockscope.model.toy import save_gpt2_checkpoint

from ..builders import save_checkpoint
from ..conftest import ALICE, result


def mul_score(att: torch.Tensor, mask: torch.Tensor) -> float:
    """The head detector's "mul" measure: attention mass on the pattern / total mass."""
    return float((att * mask).sum() / att.sum())


def masks(tokens: list[int]) -> dict[str, torch.Tensor]:
    T = len(tokens)
    prev, dup, ind = (torch.zeros(T, T) for _ in range(3))
    for i in range(T):
        for j in range(i + 1):  # causal: keys up to the query
            prev[i, j] = float(j == i - 1)
            dup[i, j] = float(j < i and tokens[j] == tokens[i])
            ind[i, j] = float(1 <= j and tokens[j - 1] == tokens[i] and j - 1 < i)
    return {"previous_token": prev, "duplicate_token": dup, "induction": ind}


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # llama: grouped-query K/V
def test_scores_equal_the_mul_definition_on_hf_attention(tmp_path, alice_text, family):
    from transformers import AutoModelForCausalLM

    path = save_checkpoint(family, tmp_path / family)
    model = load_model(spec_for(str(path), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    text = tokenize(model.tokenizer, alice_text, prepend_bos=True, max_tokens=30)
    rand = repeated_random(model, 12, seed=3)
    assert rand[0, 0] == model.tokenizer.bos_token_id
    assert (rand[0, 1:] != model.tokenizer.bos_token_id).all()
    assert torch.equal(rand[0, 1:13], rand[0, 13:])
    got = role_scores(model, text, rand)
    with torch.no_grad():
        att_text = hf(text, output_attentions=True, use_cache=False).attentions
        att_rand = hf(rand, output_attentions=True, use_cache=False).attentions
    m_text, m_rand = masks(text[0].tolist()), masks(rand[0].tolist())
    for r in got.itertuples():
        want = {"previous_token": mul_score(att_text[r.layer][0, r.head],
                                            m_text["previous_token"]),
                "duplicate_token": mul_score(att_rand[r.layer][0, r.head],
                                             m_rand["duplicate_token"]),
                "induction": mul_score(att_rand[r.layer][0, r.head], m_rand["induction"])}
        for role in ROLES:
            assert getattr(r, role) == pytest.approx(want[role], abs=1e-5), (r, role)


def previous_token_checkpoint(directory):
    """A tiny GPT-2 whose layer-0 head 0 attends to the previous token, by construction:
    token embeddings zero, position p embedded as R(cos tp, sin tp, -cos tp, -sin tp, 0...)
    (zero mean, so ln_1 only rescales it), and that head's W_Q a rotation by -t in those
    two dimensions, W_K the identity there: its score peaks at key p - 1."""
    from transformers import GPT2LMHeadModel

    path = save_gpt2_checkpoint(directory, n_layer=2, n_embd=64, n_head=4, n_positions=32)
    hf = GPT2LMHeadModel.from_pretrained(path)
    theta, scale = 0.25, 40.0
    with torch.no_grad():
        t = hf.transformer
        t.wte.weight.zero_()
        t.wpe.weight.zero_()
        p = torch.arange(32, dtype=torch.float32) * theta
        t.wpe.weight[:, 0], t.wpe.weight[:, 1] = p.cos(), p.sin()
        t.wpe.weight[:, 2], t.wpe.weight[:, 3] = -p.cos(), -p.sin()
        attn = t.h[0].attn.c_attn  # Conv1D (64 in, 3 x 64 out): head 0 is columns 0:16
        attn.weight[:, 0:16] = 0
        attn.weight[:, 64:80] = 0
        attn.bias[0:16] = 0
        attn.bias[64:80] = 0
        c, s = torch.cos(torch.tensor(theta)), torch.sin(torch.tensor(theta))
        attn.weight[0, 0], attn.weight[1, 0] = scale * c, scale * s
        attn.weight[0, 1], attn.weight[1, 1] = -scale * s, scale * c
        attn.weight[0, 64], attn.weight[1, 65] = 1.0, 1.0
    hf.save_pretrained(path)
    return path


def test_a_hand_built_previous_token_head_scores_about_1_and_tops_the_table(tmp_path):
    path = previous_token_checkpoint(tmp_path / "prev")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["head-roles", "--model", str(path), "--text", str(ALICE),
                                   "--max-tokens", "20", "--n-random", "8", "--out-dir",
                                   str(out), "--no-plot"])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(result(out, "head-roles-prev-alice.csv"))
    assert list(df.columns[:5]) == ["layer", "head", *ROLES]
    best = df.sort_values("previous_token", ascending=False).iloc[0]
    assert (best["layer"], best["head"]) == (0, 0)
    assert best["previous_token"] > 0.9  # 20 of its 21 queries have a previous token
    meta = json.loads((result(out, "head-roles-prev-alice.json")).read_text())
    assert len(meta["sequences"]["previous_token"]) == 21
    assert len(meta["sequences"]["duplicate_token and induction"]) == 17
    assert meta["top5"]["previous_token"][0] == "0.0"


def test_attention_csv_sums_to_one_and_is_causal(tiny_dir, tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["attention", "The capital of France is", "--model",
                                   str(tiny_dir), "--layer", "0,2", "--head", "1,3",
                                   "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    (csv,) = out.glob("attention-*.csv")
    df = pd.read_csv(csv, keep_default_na=False)
    assert list(df.columns) == ["layer", "head", "query_pos", "query_token", "key_pos",
                                "key_token", "weight"]
    assert set(zip(df["layer"], df["head"], strict=True)) == {(0, 1), (0, 3), (2, 1), (2, 3)}
    sums = df.groupby(["layer", "head", "query_pos"])["weight"].sum()
    assert sums.to_numpy() == pytest.approx(1.0, abs=1e-6)
    assert (df[df["key_pos"] > df["query_pos"]]["weight"] == 0).all()
    assert df[df["query_pos"] == 0]["query_token"].iloc[0] == "<|endoftext|>"  # BOS's text
    assert " capital" in set(df["query_token"])  # the token's own text, not the table's ␣
    assert "␣capital" in res.stdout and "top-3 keys per query" in res.stdout
    from blockscope.experiments.attention import top_keys

    for i, (_, keys) in enumerate(top_keys(df, 0, 1)):  # only keys the query can see
        assert all(int(key.split(":")[0]) <= i for key, _ in keys), (i, keys)
    assert len(top_keys(df, 0, 1)[0][1]) == 1  # the first query sees only itself
    assert csv.with_suffix(".png").exists()


def test_head_roles_join_prune_heads_by_layer_and_head(tiny_dir, tmp_path):
    out = tmp_path / "out"
    run = CliRunner().invoke
    res = run(app, ["prune-heads", "--model", str(tiny_dir), "--text", str(ALICE),
                    "--max-tokens", "30", "--order", "random", "--step", "0.5",
                    "--out-dir", str(out), "--no-plot", "--quiet"])
    assert res.exit_code == 0, res.output
    res = run(app, ["head-roles", "--model", str(tiny_dir), "--text", str(ALICE),
                    "--max-tokens", "30", "--n-random", "8", "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    roles = pd.read_csv(result(out, "head-roles-tiny-gpt2-alice.csv"))
    prune = pd.read_csv(result(out, "prune-heads-tiny-gpt2-alice.csv"))
    merged = roles.merge(prune, on=["layer", "head"])
    assert len(merged) == len(roles) == 12
    assert merged["ablation_delta"].tolist() == pytest.approx(merged["delta"].tolist())
    assert merged["gradient_importance_x"].tolist() == pytest.approx(
        merged["gradient_importance_y"].tolist())
    meta = json.loads((result(out, "head-roles-tiny-gpt2-alice.json")).read_text())
    assert set(meta["spearman"]) == {f"{r} ~ {i}" for r in ROLES
                                     for i in ("ablation_delta", "gradient_importance")}
    assert "Spearman" in res.stdout
    assert (result(out, "head-roles-tiny-gpt2-alice.png")).exists()


@pytest.mark.parametrize("args, message", [
    (["attention", "The capital", "--layer", "3"], "--layer 3 is out of range"),
    (["attention", "The capital", "--head", "4"], "--head 4 is out of range"),
    (["attention", "Hi", "--no-prepend-bos"], "the text gives 1 token: fewer than 2"),
    (["head-roles", "--n-random", "1"], "--n-random must be at least 2"),
    (["head-roles", "--n-random", "64"], "--n-random must be between 2 and half the context"),
])
def test_bad_input_one_line_exit_2_nothing_written(tiny_dir, tmp_path, args, message):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, [*args, "--model", str(tiny_dir), "--out-dir", str(out)]
                             + (["--text", str(ALICE), "--max-tokens", "30"]
                                if args[0] == "head-roles" else []))
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()
