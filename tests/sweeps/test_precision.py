"""Scoring that means something at float32: the NLL's logsumexp, the engines' agreement at a
49,152-token vocabulary, and a self-check that fails on a wrong replay, not on rounding."""

import pytest
import torch

from blockscope.sweeps.naive import nll_of
from blockscope.sweeps.settings import RunSettings


def test_nll_of_is_the_float64_log_softmax():
    """float32 log_softmax over 49,152 logits is biased (about -4e-6 nats a token here); the
    float64 sum of float32 exponentials is not: what is left is each float32 logit's own
    rounding (an ulp near 20 is 2e-6), which averages out."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=g) * 4).float()
    targets = torch.randint(0, 49152, (64,), generator=g)
    exact = -logits.double().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    error = nll_of(logits, targets) - exact
    assert error.abs().max() < 2e-6 and abs(float(error.mean())) < 1e-7
    assert nll_of(logits, targets).dtype == torch.float64


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """A tiny Llama with SmolLM2's 49,152-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from blockscope.model.loading import load_model, spec_for
    from blockscope.model.toy import gpt2_tokenizer

    path = tmp_path_factory.mktemp("vocab") / "llama-49k"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, num_hidden_layers=2, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         max_position_embeddings=256, initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(path)
    gpt2_tokenizer().save_pretrained(path)
    return load_model(spec_for(str(path), device="cpu"))


def test_engines_agree_far_inside_the_margin_at_a_large_vocabulary(big_vocab):
    from blockscope.experiments.ablate import block_ablation

    ids = torch.randint(0, 49152, (1, 200), generator=torch.Generator().manual_seed(1))
    naive = block_ablation(big_vocab, ids, settings=RunSettings(engine="naive"))
    cached = block_ablation(big_vocab, ids, settings=RunSettings(engine="cached"))
    assert "fallback" not in cached.attrs["engine"]
    rel = ((cached["nll"] - naive["nll"]).abs() / naive["nll"]).max()
    assert rel < 1e-6  # the margin was 92% used (9.2e-6 of 1e-5) before both summed in float64


def test_a_correct_replay_within_float32_noise_does_not_fall_back(tiny, monkeypatch):
    """With the first check made stricter than float32 can meet (as a 30-block model's
    gradients are, at 1e-5), a correct replay is judged against a float64 pass and kept."""
    from blockscope.sweeps import scoring, selfcheck
    from blockscope.sweeps.gradient import gradient_pass

    ids = torch.randint(0, 50257, (1, 100), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(selfcheck, "REL", 1e-13)
    called = []
    float64_pass = selfcheck._float64_pass
    monkeypatch.setattr(selfcheck, "_float64_pass",
                        lambda *a: called.append(1) or float64_pass(*a))
    prepared = scoring.prepare(tiny, ids, heads=True, settings=RunSettings(engine="cached"))
    got = gradient_pass(tiny, ids, prepared=prepared)
    assert called and got[2].how["replay"] == "plain" and "fallback" not in got[2].how
    assert next(tiny.parameters()).dtype == torch.float32  # put back after the float64 pass
    want = gradient_pass(tiny, ids)  # the hooked model's own
    assert torch.allclose(got[0], want[0], rtol=1e-4, atol=0)


def test_a_wrong_replay_still_falls_back_under_the_float64_judge(tiny, monkeypatch):
    from blockscope.sweeps import replay, scoring, selfcheck
    from blockscope.sweeps.gradient import gradient_pass

    ids = torch.randint(0, 50257, (1, 100), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(selfcheck, "REL", 1e-13)
    monkeypatch.setattr(replay, "scaled", lambda z, keep: z)  # the mask not applied
    prepared = scoring.prepare(tiny, ids, heads=True, settings=RunSettings(engine="cached"))
    got = gradient_pass(tiny, ids, prepared=prepared)
    assert "differs from a float64 pass" in got[2].how["fallback"]
    assert got[2].how["replay"] == "bridge"
