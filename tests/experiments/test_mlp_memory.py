"""mlp-memory's neurons, held to plain-transformers references."""

import json

import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.errors import BlockscopeError
from blockscope.experiments.logit_lens import target_id
from blockscope.experiments.mlp_memory import neurons, triggers
from blockscope.inputs.text import tokenize

from ..conftest import result
from ..references import hf_stream

PROMPT = "The capital of France is"


def hf_prob(hf, ids, pos, target, out_proj=None, zero=None):
    """HF's probability of `target`, with the neurons `zero` {layer: indices} zeroed at the
    input of each layer's output projection (`out_proj(hf, layer)`)."""
    handles = []
    for layer, idx in (zero or {}).items():
        def pre(module, args, idx=idx):
            x = args[0].clone()
            x[..., idx] = 0
            return (x,)
        handles.append(out_proj(hf, layer).register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            return float(hf(ids).logits[0, pos].softmax(-1)[target])
    finally:
        for h in handles:
            h.remove()


def gpt2_proj(hf, layer):
    return hf.transformer.h[layer].mlp.c_proj


def test_a_neurons_contribution_is_its_activation_times_its_value(tiny, hf):
    """By hand from HF: the activation entering c_proj, times c_proj's row for the neuron,
    centred, over ln_f's frozen scale, times ln_f's weight, dotted with lm_head's row."""
    ids = tokenize(tiny.tokenizer, PROMPT, prepend_bos=True)
    pos, t = ids.shape[1] - 1, target_id(tiny.tokenizer, " Paris")
    layers, df = neurons(tiny, ids, position=pos, target=t, n_layers=2, per_layer=3)
    acts = {}
    handles = [hf.transformer.h[i].mlp.c_proj.register_forward_pre_hook(
        lambda m, a, i=i: acts.__setitem__(i, a[0].detach())) for i in range(3)]
    try:
        _, records = hf_stream(hf, ids)
    finally:
        for h in handles:
            h.remove()
    ln, W = hf.transformer.ln_f, hf.lm_head.weight.detach().double()[t]
    x = records[-1]["out"][0, pos].double()
    scale = ((x - x.mean()).pow(2).mean() + ln.eps).sqrt()
    for r in df.itertuples():
        v = hf.transformer.h[r.layer].mlp.c_proj.weight.detach()[r.neuron].double()
        a = float(acts[r.layer][0, pos, r.neuron])
        ref = a * float(((v - v.mean()) / scale * ln.weight.detach().double()) @ W)
        assert r.activation == pytest.approx(a, rel=1e-5, abs=1e-6)
        assert r.contribution == pytest.approx(ref, abs=1e-6)
    assert len(df) == 6 and set(df["layer"]) == set(layers["layer"])
    chosen = {int(la): df[df["layer"] == la]["neuron"].tolist() for la in layers["layer"]}
    assert df.attrs["prob_before"] == pytest.approx(hf_prob(hf, ids, pos, t), rel=1e-4)
    assert df.attrs["prob_after"] == pytest.approx(
        hf_prob(hf, ids, pos, t, gpt2_proj, chosen), rel=1e-4)


def test_removing_neurons_of_a_gated_mlp_matches_hf(tmp_path):
    """A tiny Llama (SwiGLU): the activation is act(gate) x up, the input of down_proj;
    zeroing the chosen neurons there moves the target's probability as in plain HF."""
    from transformers import AutoModelForCausalLM

    from blockscope.model.loading import load_model, spec_for

    from ..builders import save_checkpoint

    path = save_checkpoint("llama", tmp_path / "llama")
    model = load_model(spec_for(str(path)))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = tokenize(model.tokenizer, PROMPT, prepend_bos=True)
    pos = ids.shape[1] - 1
    with torch.no_grad():
        t = int(hf(ids).logits[0, pos].argmax())
    layers, df = neurons(model, ids, position=pos, target=t, n_layers=2, per_layer=4)
    chosen = {int(la): df[df["layer"] == la]["neuron"].tolist() for la in layers["layer"]}
    assert df.attrs["prob_after"] == pytest.approx(
        hf_prob(hf, ids, pos, t, lambda m, i: m.model.layers[i].mlp.down_proj, chosen),
        rel=1e-4)
    assert df.attrs["prob_after"] != pytest.approx(df.attrs["prob_before"], rel=1e-6)


def test_a_norm_after_the_mlp_is_refused(tmp_path):
    from blockscope.model.loading import load_model, spec_for

    from ..builders import save_checkpoint

    model = load_model(spec_for(str(save_checkpoint("olmo2", tmp_path / "olmo2"))))
    ids = tokenize(model.tokenizer, PROMPT, prepend_bos=True)
    with pytest.raises(BlockscopeError, match="not linear in the stream"):
        neurons(model, ids, position=-1, target=1)


def test_command_writes_neurons_layers_keys_and_sidecar(tiny_dir, tmp_path):
    from ..conftest import ALICE

    res = CliRunner().invoke(app, ["mlp-memory", PROMPT, "--model", str(tiny_dir), "--target",
                                   " Paris", "--method", "mean", "--text", str(ALICE),
                                   "--n-examples", "2", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    import pandas as pd

    keys = pd.read_csv(result(tmp_path, "mlp-memory-tiny-gpt2-keys.csv"))
    assert len(keys) == 15 * 2 and set(keys["rank"]) == {1, 2}
    assert "removing these 15 neurons (mean)" in " ".join(res.stdout.split())
    meta = json.loads(result(tmp_path, "mlp-memory-tiny-gpt2.json").read_text())
    assert meta["removal"]["method"] == "mean" and meta["target"] == " Paris"
    assert result(tmp_path, "mlp-memory-tiny-gpt2-layers.csv").exists()
    bad = CliRunner().invoke(app, ["mlp-memory", PROMPT, "--model", str(tiny_dir), "--method",
                                   "max", "--out-dir", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "--method must be zero or mean" in bad.stderr
    assert not (tmp_path / "b").exists()


def test_trigger_contexts_equal_a_brute_force_scan_with_hf_hooks(tiny, hf):
    """Geva 2020's keys: the positions where a neuron fires most over a small corpus, from
    the streamed top-k heaps, equal a brute-force scan of every position with a plain HF
    forward hook on c_proj's input (each document's first token left out)."""
    from blockscope.inputs.corpus import Docs

    from ..builders import paragraphs

    texts = [p[:300] for p in paragraphs()[:4]]
    ids = [tokenize(tiny.tokenizer, t, prepend_bos=True) for t in texts]
    docs = Docs(ids=ids, index=list(range(len(ids))), unit="document")
    picks = [(1, 7, 1.0), (2, 30, -1.0)]
    got = triggers(tiny, docs, picks, n_examples=4)
    for layer, neuron, sign in picks:
        seen = []
        for d, x in enumerate(ids):
            acts = {}
            h = hf.transformer.h[layer].mlp.c_proj.register_forward_pre_hook(
                lambda m, a: acts.__setitem__("a", a[0].detach()))
            try:
                with torch.no_grad():
                    hf(x)
            finally:
                h.remove()
            seen += [(sign * float(acts["a"][0, p, neuron]), d, p)
                     for p in range(1, x.shape[1])]
        want = sorted(seen, reverse=True)[:4]
        rows = got[(got["layer"] == layer) & (got["neuron"] == neuron)].sort_values("rank")
        assert list(zip(rows["doc"], rows["position"], strict=True)) == [(d, p) for _, d, p
                                                                          in want]
        for (a, _, _), act in zip(want, rows["activation"], strict=True):
            assert sign * act == pytest.approx(a, abs=1e-4)
        r = rows.iloc[0]
        assert r["context"].endswith(r["trigger"].strip()) or r["trigger"].isspace()
