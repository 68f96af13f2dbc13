"""`ablate --decompose`: each removal's change in the correct token's centred logit split
into direct, downstream and final-norm terms, every term held to a plain HF model with the
component removed by a hook, each block's write captured by hooks, the final norm applied
with the clean run's scale, and the target's unembedding row (written here)."""

import pytest
import torch
import transformers

from blockscope.experiments.ablate import decomposed
from blockscope.model.loading import load_model, spec_for

from ..builders import save_checkpoint
from ..references import hf_modules

T = 24


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    d = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    return load_model(spec_for(str(d), device="cpu")), hf.eval()


def hf_run(hf, ids, remove=None):
    """Each layer's input and output, the final norm's input and output, and the logits, with
    `remove` = (part, k) zeroed (a block: its output := its input) by hooks."""
    mods = hf_modules(hf)
    norm = hf.transformer.ln_f if hf.config.model_type == "gpt2" else hf.model.norm
    ins, outs, handles, kept = {}, {}, [], {}
    for j, layer in enumerate(mods["layers"]):
        def pre(m, args, kwargs, j=j):
            ins[j] = (args[0] if args else kwargs["hidden_states"]).detach().double()[0]

        def post(m, args, out, j=j):
            if remove == ("block", j):
                h = ins[j].float()[None]
                out = (h, *out[1:]) if isinstance(out, tuple) else h
            o = out[0] if isinstance(out, tuple) else out
            outs[j] = o.detach().double()[0]
            return out

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                    layer.register_forward_hook(post)]
    for j, mlp in enumerate(mods["mlp"]):
        def written(m, a, out, j=j):
            if remove == ("mlp", j):
                out = torch.zeros_like(out)
            kept[f"mlp{j}"] = out.detach().double()[0]
            return out

        handles.append(mlp.register_forward_hook(written))
    handles.append(norm.register_forward_hook(lambda m, a, out: kept.update(
        h=a[0].detach().double()[0], normed=out.detach().double()[0])))
    try:
        with torch.no_grad():
            logits = hf(ids, use_cache=False).logits[0].double()
    finally:
        for h in handles:
            h.remove()
    return ins, outs, kept, logits, norm


@pytest.mark.parametrize("part", ["block", "mlp"])
def test_every_term_equals_hf(pair, alice_text, part):
    model, hf = pair
    ids = model.tokenizer(alice_text, return_tensors="pt").input_ids[:, :T]
    df, _ = decomposed(model, ids, part=part, method="zero")
    n = hf.config.num_hidden_layers
    ins, outs, clean, logits, norm = hf_run(hf, ids)
    rows, targets = torch.arange(T - 1), ids[0, 1:]
    W = hf.get_output_embeddings().weight.detach().double()
    u = W[targets] - W.mean(0)  # (T-1, d): the centred target rows
    rms = hf.config.model_type != "gpt2"
    eps = norm.variance_epsilon if rms else norm.eps
    centre = (lambda x: x) if rms else (lambda x: x - x.mean(-1, keepdim=True))
    scale = (centre(clean["h"][rows]).pow(2).mean(-1, keepdim=True) + eps).sqrt()
    gain = norm.weight.detach().double() / scale  # the clean run's scale, frozen
    beta = 0 if rms else norm.bias.detach().double()

    def r(x):
        return (centre(x[rows]) * gain * u).sum(-1)

    def centred(z):
        return z[rows].gather(-1, targets[:, None])[:, 0] - z[rows].mean(-1)

    for k in range(n):
        ins2, outs2, run, logits2, _ = hf_run(hf, ids, (part, k))
        row = df[df["layer"] == k].iloc[0]
        total = float((centred(logits2) - centred(logits)).mean())
        writes = [float(r((outs2[j] - ins2[j]) - (outs[j] - ins[j])).mean())
                  for j in range(n)]
        # the component's own write: the block's, or the MLP's (zero in the variant)
        direct = writes[k] if part == "block" else float(
            r(run[f"mlp{k}"] - clean[f"mlp{k}"]).mean())
        down = sum(writes[k + 1:]) + (0.0 if part == "block" else writes[k] - direct)
        own = (run["normed"][rows] * u).sum(-1)  # with the variant's own final-norm scale
        frozen = (centre(run["h"][rows]) * gain * u).sum(-1) + (u * beta).sum(-1)
        final = float((own - frozen).mean())
        assert row["direct"] == pytest.approx(direct, abs=1e-5)
        for j in range(k + 1, n):
            assert row[f"downstream_{j}"] == pytest.approx(writes[j], abs=1e-5)
        assert row["total"] == pytest.approx(total, abs=1e-5)
        assert row["final_norm"] == pytest.approx(final, abs=1e-5)
        assert row["downstream"] == pytest.approx(down, abs=1e-5)
        assert row["direct"] + row["downstream"] + row["final_norm"] == pytest.approx(
            row["total"], abs=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_cached_reads_equal_the_naive_loop_and_a_slip_falls_back(family, tmp_path,
                                                                 alice_text, monkeypatch):
    """Every part, both engines, per token: the same terms to float32 rounding (sequential
    and parallel blocks; the attention half enters mid-block where the layout allows). An
    entry that writes the wrong residual is caught by the self-check: the naive loop's
    numbers, and the sidecar says why."""
    from dataclasses import replace

    from blockscope.sweeps import streams
    from blockscope.sweeps.settings import RunSettings

    model = load_model(spec_for(str(save_checkpoint(family, tmp_path / family)), device="cpu"))
    ids = model.tokenizer(alice_text, return_tensors="pt").input_ids[:, :T]
    cols = ["total", "direct", "final_norm", "downstream"]
    for part in ("block", "attn", "mlp"):
        ticks = {"cached": [], "naive": []}  # progress: one step per removal, as each is read
        got = {e: decomposed(model, ids, part=part, settings=RunSettings(
            engine=e, batch_size=2, progress=lambda t=ticks[e]: t.append(1)))[1]
               for e in ("cached", "naive")}
        assert (got["cached"][cols] - got["naive"][cols]).abs().max().max() < 1e-5
        assert len(ticks["cached"]) == len(ticks["naive"]) == model.cfg.n_layers
    honest = decomposed(model, ids, part="mlp")[0]
    assert honest.attrs["engine"] == {"engine": "cached"}
    original = streams.start

    def slipped_start(*a):
        s = original(*a)
        return replace(s, resid=lambda c: 1.01 * s.resid(c))

    monkeypatch.setattr(streams, "start", slipped_start)
    slipped = decomposed(model, ids, part="mlp")[0]
    assert slipped.attrs["engine"]["engine"] == "naive"
    assert "self-check failed" in slipped.attrs["engine"]["fallback"]
    assert (slipped[cols] - honest[cols]).abs().max().max() < 1e-5


def test_the_command_writes_the_split_and_refuses_per_token_alone(tiny_dir, tmp_path):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import ALICE, result

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in (
            "ablate", "--text", ALICE, "--max-tokens", 40, "--model", tiny_dir, "--out-dir",
            tmp_path, *args)])

    res = run("--per-token")
    assert res.exit_code != 0 and "--per-token goes with --decompose" in res.output
    res = run("--decompose", "--per-token")
    assert res.exit_code == 0, res.output
    assert "the article's reading predicts" in res.stdout
    df = pd.read_csv(result(tmp_path, "ablate-tiny-gpt2-alice-decompose.csv"))
    assert list(df.columns[:9]) == ["component", "layer", "part", "method", "total", "direct",
                                    "downstream", "final_norm", "self_repair"]
    assert [c for c in df.columns[9:]] == ["downstream_0", "downstream_1", "downstream_2"]
    tokens = pd.read_csv(result(tmp_path, "ablate-tiny-gpt2-alice-decompose-tokens.csv"))
    assert len(tokens) == 3 * 40  # 3 blocks x (BOS + 40 tokens - 1) scored tokens
    mean = tokens.groupby("layer")["total"].mean()
    assert df["total"].to_numpy() == pytest.approx(mean.to_numpy())
    meta = json.loads(result(tmp_path, "ablate-tiny-gpt2-alice-decompose.json").read_text())
    assert meta["decompose"] is True and meta["engine"] == "cached" and meta["headline"]
