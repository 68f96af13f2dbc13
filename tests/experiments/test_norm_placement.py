"""norm-placement: the stacks against HF GPT-2 and a hand-written post-norm block, the
gradients against finite differences, training's determinism, and the command's refusals."""

import json
import math

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.experiments import norm_placement as np_exp
from blockscope.experiments.norm_stack import (
    WEIGHTS,
    Stack,
    StackConfig,
    init_weights,
    load_gpt2_weights,
)

from ..conftest import ALICE, result

SMALL = StackConfig(n_layers=2, d_model=16, n_heads=2, d_mlp=32, n_ctx=32, d_vocab=50)


def test_pre_norm_stack_with_gpt2_weights_gives_the_hf_loss(tiny_dir, hf, alice_text, tiny):
    """The same blocks: GPT-2 is the pre-norm stack."""
    stack = load_gpt2_weights(Stack(StackConfig.from_hf(hf.config), "pre"), hf).eval()
    ids = tiny.tokenizer(alice_text, return_tensors="pt")["input_ids"][:, :100]  # (1, 100)
    with torch.no_grad():
        want = hf(ids, labels=ids, use_cache=False).loss
        got = stack.loss(ids)
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def _layer_norm(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def test_post_norm_block_is_the_2017_formula():
    """One post-norm layer written out: x1 = LN(x0 + attn(x0)), x2 = LN(x1 + mlp(x1)),
    logits = x2 @ wte^T (no final norm)."""
    cfg = StackConfig(n_layers=1, d_model=8, n_heads=2, d_mlp=16, n_ctx=8, d_vocab=11)
    stack = init_weights(Stack(cfg, "post"), scaled=False, seed=3).double()
    with torch.no_grad():
        for p in stack.parameters():  # non-trivial biases and norm gains
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.tensor([[1, 4, 2, 9, 0]])
    t, b = stack.transformer, stack.transformer.h[0]
    T, d, H = ids.shape[1], cfg.d_model, cfg.n_heads
    x0 = t.wte.weight[ids[0]] + t.wpe.weight[:T]  # (T, d)
    qkv = x0 @ b.attn.c_attn.weight + b.attn.c_attn.bias  # (T, 3d)
    heads = []
    for h in range(H):
        sl = slice(h * d // H, (h + 1) * d // H)
        q, k, v = qkv[:, :d][:, sl], qkv[:, d : 2 * d][:, sl], qkv[:, 2 * d :][:, sl]
        scores = q @ k.T / math.sqrt(d // H)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    attn = torch.cat(heads, -1) @ b.attn.c_proj.weight + b.attn.c_proj.bias
    x1 = _layer_norm(x0 + attn, b.ln_1)
    hidden = x1 @ b.mlp.c_fc.weight + b.mlp.c_fc.bias
    gelu = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
    x2 = _layer_norm(x1 + gelu @ b.mlp.c_proj.weight + b.mlp.c_proj.bias, b.ln_2)
    with torch.no_grad():
        assert torch.allclose(stack(ids)[0], x2 @ t.wte.weight.T, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["pre", "post"])
def test_reported_gradients_equal_finite_differences(layout):
    stack = init_weights(Stack(SMALL, layout), scaled=True, seed=1).double()
    ids = torch.randint(0, SMALL.d_vocab, (1, 12))
    stack.loss(ids).backward()
    d = SMALL.d_model
    where = {("attn", "W_Q"): ("attn.c_attn", 0), ("attn", "W_K"): ("attn.c_attn", d),
             ("attn", "W_V"): ("attn.c_attn", 2 * d), ("attn", "W_O"): ("attn.c_proj", 0),
             ("mlp", "W_in"): ("mlp.c_fc", 0), ("mlp", "W_out"): ("mlp.c_proj", 0)}
    for layer in range(SMALL.n_layers):
        grads = stack.weight_grads(layer)
        for key in WEIGHTS:
            path, col0 = where[key]
            weight = stack.transformer.h[layer].get_submodule(path).weight
            i, j = 1, 2  # one entry of this matrix
            eps = 1e-6
            with torch.no_grad():
                weight[i, col0 + j] += eps
                up = float(stack.loss(ids))
                weight[i, col0 + j] -= 2 * eps
                down = float(stack.loss(ids))
                weight[i, col0 + j] += eps
            assert float(grads[key][i, j]) == pytest.approx((up - down) / (2 * eps),
                                                            rel=1e-5, abs=1e-9), (layer, key)


def test_scaled_init_shrinks_only_the_stream_writes():
    a = init_weights(Stack(SMALL, "pre"), scaled=False, seed=0)
    b = init_weights(Stack(SMALL, "pre"), scaled=True, seed=0)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if name.endswith("c_proj.weight"):
            assert torch.allclose(pb, pa / math.sqrt(2 * SMALL.n_layers))
        else:
            assert torch.equal(pa, pb), name


def test_at_init_rows_and_summary():
    ids = torch.randint(0, SMALL.d_vocab, (1, 20))
    df = np_exp.at_init(SMALL, ids, seeds=[0, 1])
    assert len(df) == 2 * 2 * 2 * SMALL.n_layers * 6
    assert (df["grad_norm"] > 0).all() and (df["resid_norm"] > 0).all()
    summary = np_exp.layer_summary(df)
    first = summary[summary["layer"] == 0]
    assert (first["grad_vs_first"] == 1).all()


def test_training_is_deterministic_and_learns():
    data = torch.tensor(list(ALICE.read_bytes()), dtype=torch.long)
    cfg = StackConfig(n_layers=2, d_model=32, n_heads=2, d_mlp=128, n_ctx=32, d_vocab=256)
    tc = np_exp.TrainConfig(steps=20, warmup_steps=5, lrs=(1e-3, 3e-3), batch_size=4,
                            seq_len=32, seed=7)
    a, b = np_exp.train(cfg, data, tc), np_exp.train(cfg, data, tc)
    pd.testing.assert_frame_equal(a, b)
    steps = a[a["kind"] == "step"]
    for key, run in steps.groupby(["layout", "warmup_steps", "peak_lr"]):
        assert run["loss"].iloc[-3:].mean() < run["loss"].iloc[:3].mean(), key
    assert set(np_exp.final_losses(a)) == {(lay, w, lr) for lay in ("pre", "post")
                                           for w in (0, 5) for lr in (1e-3, 3e-3)}
    warm = steps[(steps["warmup_steps"] == 5) & (steps["peak_lr"] == 3e-3)]["lr"].iloc[:5]
    assert warm.tolist() == pytest.approx([3e-3 * k / 5 for k in range(1, 6)])
    # every run at a rate starts from the same weights and sees the same batches: its first
    # loss (before any update) is the same for both warm-ups, and for the rates
    first = steps[steps["step"] == 0].groupby("layout")["loss"].nunique()
    assert (first == 1).all()


def test_the_same_batches_for_every_run(monkeypatch):
    data = torch.tensor(list(ALICE.read_bytes()), dtype=torch.long)
    cfg = StackConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=64, n_ctx=16, d_vocab=256)
    tc = np_exp.TrainConfig(steps=3, warmup_steps=1, lrs=(1e-3, 3e-3), batch_size=2,
                            seq_len=16, seed=1)
    seen = []
    loss = np_exp.Stack.loss
    monkeypatch.setattr(np_exp.Stack, "loss", lambda self, ids, resid=None: (
        seen.append((self.layout, ids.clone())), loss(self, ids, resid))[1])
    np_exp.train(cfg, data, tc)
    assert len(seen) == 2 * 2 * 2 * 3  # layouts x warm-ups x rates x steps
    for k in range(3):
        assert all(torch.equal(seen[k][1], seen[r * 3 + k][1]) for r in range(8))


def test_largest_trainable_rate_on_hand_made_tables():
    plateau = 3.0
    finals = {("post", 0, 1e-3): 2.5, ("post", 0, 3e-3): 2.75, ("post", 0, 1e-2): math.nan,
              ("post", 100, 1e-3): 2.4, ("post", 100, 3e-3): 2.6, ("post", 100, 1e-2): 2.69,
              ("pre", 0, 1e-3): 2.3, ("pre", 0, 3e-3): 2.4, ("pre", 0, 1e-2): 2.5,
              ("pre", 100, 1e-3): 2.3, ("pre", 100, 3e-3): 2.3, ("pre", 100, 1e-2): 3.2}
    # 2.75 is below the plateau but not by 0.3; 2.69 is; NaN (diverged) never trains
    assert np_exp.trains(2.69, plateau) and not np_exp.trains(2.75, plateau)
    assert not np_exp.trains(math.nan, plateau) and not np_exp.trains(3.2, plateau)
    assert np_exp.largest_trainable(finals, "post", 0, plateau) == 1e-3
    assert np_exp.largest_trainable(finals, "post", 100, plateau) == 1e-2
    assert np_exp.largest_trainable(finals, "pre", 100, plateau) == 3e-3
    claims = {c["claim"]: c for c in np_exp.training_claims(finals, 100, plateau)}
    assert all(c["shown"] for c in claims.values())
    finals[("pre", 0, 1e-2)] = 2.8  # pre-norm without warm-up fails where post-norm with it
    finals[("post", 0, 3e-3)] = 2.6  # trains: now post-norm's largest without warm-up is 3e-3
    claims = [c["shown"] for c in np_exp.training_claims(finals, 100, plateau)]
    assert claims == [True, False]
    finals = {k: math.nan for k in finals}  # nothing trains: neither claim can show
    assert [c["shown"] for c in np_exp.training_claims(finals, 100, plateau)] == [False, False]


def test_plateau_is_the_unigram_entropy():
    data = torch.tensor([0, 0, 1, 2])
    assert np_exp.plateau(data) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 *
                                                   math.log(0.25)))


def test_tied_and_untied_unembeddings():
    tied = init_weights(Stack(SMALL, "pre"), scaled=True, seed=0)
    untied = init_weights(Stack(SMALL, "pre", tie=False), scaled=True, seed=0)
    ids = torch.randint(0, SMALL.d_vocab, (1, 8))
    with torch.no_grad():
        h = tied.transformer.ln_f(tied.transformer.h[1](tied.transformer.h[0](
            tied.transformer.wte(ids) + tied.transformer.wpe(torch.arange(8)))))
        assert torch.allclose(tied(ids), h @ tied.transformer.wte.weight.T, atol=1e-6)
        assert not hasattr(tied, "lm_head") and untied.lm_head.weight.shape == (
            SMALL.d_vocab, SMALL.d_model)
        assert not torch.allclose(untied(ids), tied(ids))
        untied.lm_head.weight.copy_(untied.transformer.wte.weight)  # the same matrix again
        assert torch.allclose(untied(ids), tied(ids), atol=1e-6)


FAST = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--seeds", "2",
        "--max-tokens", "40", "--train-steps", "12", "--warmup-steps", "4", "--train-layers",
        "2", "--train-d-model", "32", "--train-heads", "2", "--batch-size", "4", "--seq-len",
        "16", "--text", str(ALICE)]


def test_command_writes_both_csvs_sidecar_and_pictures(tmp_path):
    res = CliRunner().invoke(app, ["norm-placement", *FAST, "--lr", "1e-3,3e-3", "--no-tie",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    init = pd.read_csv(result(tmp_path, "norm-placement-init.csv"))
    assert list(init.columns) == ["layout", "scaled_init", "seed", "layer", "sublayer",
                                  "weight", "grad_norm", "resid_norm"]
    train = pd.read_csv(result(tmp_path, "norm-placement-train.csv"))
    assert list(train.columns) == ["layout", "warmup_steps", "peak_lr", "seed", "step", "lr",
                                   "loss", "kind"]
    assert (train["kind"] == "final").sum() == 4 * 2  # two rates
    meta = json.loads((result(tmp_path, "norm-placement.json")).read_text())
    assert meta["init_stack"]["n_layers"] == 2 and len(meta["claims"]) == 5
    assert meta["train"]["lrs"] == [1e-3, 3e-3] and meta["train"]["tie"] is False
    assert meta["unembedding"] == "its own matrix (untied)" and meta["plateau_nats"] > 0
    assert (result(tmp_path, "norm-placement-init.png")).exists()
    assert (result(tmp_path, "norm-placement-train.png")).exists()
    assert "the article's claims" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--d-model", "30", "--n-heads", "4"], "does not divide"),
    (["--train-steps", "-1"], "--train-steps must be between 0 and 1,000,000"),
    (["--train-steps", "10", "--warmup-steps", "10"], "is not shorter than the run"),
    (["--train-heads", "3"], "does not divide"),
    (["--lr", "1e-3,x"], "--lr takes numbers"),
    (["--lr", "0"], "--lr takes one or more positive rates"),
])
def test_bad_options_one_line_exit_2(tmp_path, args, message):
    res = CliRunner().invoke(app, ["norm-placement", *FAST, *args, "--out-dir",
                                   str(tmp_path / "out")])
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists()
