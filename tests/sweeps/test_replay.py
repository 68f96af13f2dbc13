"""The plain replay of GPT-2 blocks is the HF block's function, and steps aside for hooks."""

import pytest
import torch

from blockscope.experiments.ablate import block_ablation
from blockscope.inputs.text import tokenize
from blockscope.interventions import applied
from blockscope.model import arch
from blockscope.sweeps import replay, selfcheck
from blockscope.sweeps.clean import clean_pass, kept_names
from blockscope.sweeps.engine import Start
from blockscope.sweeps.naive import model_windows, token_nll
from blockscope.sweeps.steps import plain_parts

from ..drive import engine_sweep, perplexity_row

REL = 1e-5


@pytest.fixture(scope="module")
def ids(tiny, alice_text):
    return tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=60)


@pytest.fixture(scope="module")
def clean(tiny, ids):
    names = kept_names(arch.layout(tiny), tiny.cfg.n_layers, z=False)
    return clean_pass(tiny, ids, model_windows(tiny, ids, None)[0], names)


def close(a, b):
    return torch.allclose(a, b, rtol=REL, atol=REL * float(b.abs().max()))


def test_blocks_equal_the_hf_blocks(tiny, hf, ids):
    """Each plain block maps HF's hidden state k to HF's hidden state k + 1."""
    with torch.inference_mode():
        hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
        for k in range(tiny.cfg.n_layers - 1):  # HF's last hidden state is after ln_f
            p = replay.parts(tiny.blocks[k])
            assert p is not None
            assert close(replay.block_forward(p, hidden[k]), hidden[k + 1])


def test_halves_equal_the_bridge_clean_pass(tiny, clean):
    with torch.inference_mode():
        for k, block in enumerate(tiny.blocks):
            p = replay.parts(block)
            mid = replay.attn_half(p, clean.pre[k])
            assert close(mid, clean.act("hook_resid_mid", k))
            assert close(replay.mlp_half(p, clean.act("hook_resid_mid", k)), clean.pre[k + 1])
            batch = torch.cat([clean.pre[k], 2 * clean.pre[k]])  # (2, T, d_model)
            assert close(replay.block_forward(p, batch)[:1], clean.pre[k + 1])


def test_the_engine_replays_gpt2_blocks_plainly(tiny, ids, clean, monkeypatch):
    """So the engine-equals-naive tests cover the plain replay."""
    assert plain_parts(tiny) is not None
    calls = []
    real = replay.mlp_half
    monkeypatch.setattr(replay, "mlp_half", lambda p, x: calls.append(1) or real(p, x))
    df = block_ablation(tiny, ids, layers=[0])
    assert df.attrs["engine"]["replay"] == "plain"
    # the self-check (one block per kind, and the last), then blocks 1..
    assert len(calls) == len(selfcheck.block_kinds(tiny)) + (tiny.cfg.n_layers - 1)


def test_a_block_that_holds_a_hook_runs_as_the_bridge(tiny, ids, clean):
    hooks = [("blocks.1.attn.hook_pattern", lambda p, hook=None: torch.ones_like(p).tril()
              / torch.ones_like(p).tril().sum(-1, keepdim=True))]  # uniform causal attention
    assert not any(replay.hooked(b) for b in tiny.blocks)
    with applied(tiny, hooks):
        assert [replay.hooked(b) for b in tiny.blocks] == [False, True, False]
    wins = model_windows(tiny, ids, None)
    start = Start({}, 1, lambda c: c.pre[1], hooks=hooks)
    fast = engine_sweep(tiny, ids, [start], wins=wins).loc[1, "perplexity"]
    with applied(tiny, hooks):
        naive = perplexity_row(token_nll(tiny, ids, wins))["perplexity"]
    assert fast == pytest.approx(naive, rel=REL)
    assert fast != pytest.approx(perplexity_row(token_nll(tiny, ids, wins))["perplexity"])


def test_no_plain_replay_when_it_disagrees_or_in_training_mode(tiny, clean, monkeypatch):
    lay, parts = arch.layout(tiny), plain_parts(tiny)
    assert selfcheck.verify(tiny, lay, clean, [], parts) is parts
    real = replay.block_forward
    monkeypatch.setattr(replay, "block_forward", lambda p, x, ctx=None: 1.0001 * real(p, x, ctx))
    monkeypatch.setattr(clean, "checked", {})  # a verdict is kept per clean pass: ask anew
    assert selfcheck.verify(tiny, lay, clean, [], parts) is None  # the bridge's blocks run
    monkeypatch.undo()
    tiny.train()
    try:
        assert plain_parts(tiny) is None
    finally:
        tiny.eval()


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),  # grouped-query
    ("mistral", {}),  # sliding window of 16 tokens: an explicit mask
    ("gpt_neox", {}),  # parallel, partial rotary
    ("gpt_neox", {"use_parallel_residual": False}),
])
def test_rotary_blocks_equal_the_hf_blocks(tmp_path, alice_text, family, overrides):
    """Each plain Llama-family / GPT-NeoX block maps HF's hidden state k to k + 1, with the
    rotary embeddings and mask the clean pass recorded for it."""
    from transformers import AutoModelForCausalLM

    from blockscope.model.loading import load_model, spec_for

    from ..builders import save_checkpoint

    path = save_checkpoint(family, tmp_path / family, **overrides)
    model = load_model(spec_for(str(path), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenize(model.tokenizer, alice_text, prepend_bos=True, max_tokens=40)
    lay = arch.layout(model)
    clean = clean_pass(model, ids, model_windows(model, ids, None)[0],
                       kept_names(lay, model.cfg.n_layers, z=False))
    parts = plain_parts(model)
    assert parts is not None and all(p.parallel == lay.parallel for p in parts)
    with torch.inference_mode():
        hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
        for k in range(model.cfg.n_layers - 1):  # HF's last hidden state is after the norm
            got = replay.block_forward(parts[k], hidden[k], clean.block_args[k])
            assert close(got, hidden[k + 1])
            batch = torch.cat([hidden[k], 2 * hidden[k]])  # (2, T, d_model)
            assert close(replay.block_forward(parts[k], batch, clean.block_args[k])[:1], got)


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_nll_and_its_gradient_equal_log_softmax(bias):
    """The curve's differentiable unembedding: NLL and d NLL / d h equal float64
    log_softmax's and autograd's, and a central finite difference of one coordinate."""
    from blockscope.sweeps.unembed import VOCAB_CHUNK, ChunkedNLL

    g = torch.Generator().manual_seed(0)
    R, d, V = 7, 16, 3 * VOCAB_CHUNK + 5  # a partial last block
    h = torch.randn(R, d, generator=g)
    weight = torch.randn(V, d, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    targets = torch.randint(0, V, (R,), generator=g)
    scale = torch.rand(R, generator=g) + 0.5  # an upstream gradient that is not all ones

    def reference(x):
        logits = x @ weight.double().T + (0 if b is None else b.double())
        return -logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]

    x = h.double().requires_grad_(True)
    want = reference(x)
    (want_grad,) = torch.autograd.grad((want * scale.double()).sum(), x)
    y = h.clone().requires_grad_(True)
    got = ChunkedNLL.apply(y, weight, b, targets)
    (got_grad,) = torch.autograd.grad((got * scale).sum(), y)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got_grad.double(), want_grad, rtol=1e-4, atol=1e-5)
    eps, (i, j) = 1e-6, (3, 5)
    step = torch.zeros_like(x)
    step[i, j] = eps
    with torch.no_grad():
        fd = ((reference(x + step) - reference(x - step)) * scale.double()).sum() / (2 * eps)
    assert float(got_grad[i, j]) == pytest.approx(float(fd), rel=1e-4, abs=1e-6)
