"""Patching, causal tracing and knockout, each cell held to plain HF models with hooks or a
4-D attention mask written here (tests/references.py), with both engines, on GPT-2, Llama
(grouped-query) and GPT-NeoX (parallel blocks, partial rotary)."""

import warnings

import pytest
import torch
import transformers

from blockscope.experiments import knockout as knockout_exp
from blockscope.experiments import patch as patch_exp
from blockscope.experiments import trace as trace_exp
from blockscope.interventions.interchange import Edit, Site
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps import engine, resume
from blockscope.sweeps.interchange import Run, sweep
from blockscope.sweeps.metrics import LogitDiff
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

from ..builders import save_checkpoint
from ..references import hf_capture, hf_knockout_mask_hook, hf_modules, hf_run

FAMILIES = ["gpt2", "llama", "gpt_neox"]
CLEAN = torch.tensor([[50256, 464, 3139, 286, 4881, 318]])  # BOS The capital of France is
CORRUPTED = torch.tensor([[50256, 464, 3139, 286, 8031, 318]])  # ... of Italy is
SPAN = (4, 5)  # the subject's tokens
TARGET = CONTRAST = None  # set per model: see `pair`


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """The bridge and the plain HF model of one checkpoint. A random model knows no capital:
    the target and contrast are the tokens the corruption moves most, up and down (a gap
    of a few logits, far above float32 rounding), and the trace's target the clean top-1."""
    global TARGET, CONTRAST
    d = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = load_model(spec_for(str(d), device="cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    moved = hf_run(hf, CLEAN, []) - hf_run(hf, CORRUPTED, [])
    TARGET, CONTRAST = int(moved.argmax()), int(moved.argmin())
    return model, hf


def close(got, want, gap):
    assert abs(got - want) <= 1e-5 * max(abs(gap), 1e-3), (got, want, gap)


def at(pos, value, head=None, d_head=None):
    """fn(tensor) writing `value` at position(s) `pos` (columns of `head` if given)."""
    def fn(t):
        if head is None:
            t[:, pos] = value
        else:
            t[:, pos, head * d_head:(head + 1) * d_head] = value
        return t

    return fn


def qkv_columns(hf, layer: int, site: str, head: int, d_head: int):
    """(the HF module whose output holds one head's query, key or value before any rotary
    embedding, that head's columns there), per family: GPT-2's joined c_attn (all queries,
    then keys, then values), GPT-NeoX's query_key_value (per head: its query, key, value),
    the Llama family's q_proj, k_proj, v_proj (keys and values per key/value head)."""
    kind = hf.config.model_type
    if kind == "gpt2":
        d = hf.config.n_embd
        start = "qkv".index(site) * d + head * d_head
        return hf.transformer.h[layer].attn.c_attn, slice(start, start + d_head)
    if kind == "gpt_neox":
        start = (3 * head + "qkv".index(site)) * d_head
        return (hf.gpt_neox.layers[layer].attention.query_key_value,
                slice(start, start + d_head))
    attn = hf.model.layers[layer].self_attn
    return getattr(attn, f"{site}_proj"), slice(head * d_head, (head + 1) * d_head)


def at_columns(value, cols):
    """fn(tensor) writing `value` into columns `cols` at every position."""
    def fn(t):
        t[:, :, cols] = value
        return t

    return fn


def logit_diff(logits):
    return float(logits[0, TARGET] - logits[0, CONTRAST])


@pytest.mark.parametrize("engine", ["cached", "naive"])
def test_patch_every_cell_equals_hf_hooks(pair, engine):
    """Every cell of every site held to HF hooks written here; q, k and v (inside the
    attention: the cached engine does not resume there) on the naive loop."""
    model, hf = pair
    mods = hf_modules(hf)
    sites = [s for s in patch_exp.SITES if engine == "naive" or s not in ("q", "k", "v")]
    df = patch_exp.patch(model, CLEAN, CORRUPTED, target=TARGET, contrast=CONTRAST,
                         sites=sites, settings=RunSettings(engine=engine))
    assert df.attrs["how"]["engine"] == engine
    clean, corrupted = logit_diff(hf_run(hf, CLEAN, [])), logit_diff(hf_run(hf, CORRUPTED, []))
    gap = clean - corrupted
    close(df.attrs["clean"], clean, gap)
    close(df.attrs["corrupted"], corrupted, gap)
    d_head = model.cfg.d_head
    for r in df.itertuples():
        if r.site == "z":
            module, when = mods["o"][r.layer], "pre"
            src = hf_capture(hf, CLEAN, module, when)
            cols = slice(r.head * d_head, (r.head + 1) * d_head)
            fn = at(slice(None), src[:, :, cols], r.head, d_head)
        elif r.site in ("q", "k", "v"):
            module, cols = qkv_columns(hf, r.layer, r.site, r.head, d_head)
            when = "out"
            src = hf_capture(hf, CLEAN, module, when)[:, :, cols]
            fn = at_columns(src, cols)
        else:
            module, when = {"resid-pre": (mods["layers"][r.layer], "pre"),
                            "attn-out": (mods["attn"][r.layer], "out"),
                            "mlp-out": (mods["mlp"][r.layer], "out")}[r.site]
            fn = at(r.position, hf_capture(hf, CLEAN, module, when)[:, r.position])
        want = logit_diff(hf_run(hf, CORRUPTED, [(module, when, fn)]))
        close(r.logit_diff, want, gap)
        assert r.normalized == pytest.approx((r.logit_diff - corrupted) / gap, abs=1e-4)


def test_trace_every_cell_equals_hf_with_the_noise_redrawn_from_its_seed(pair):
    model, hf = pair
    mods = hf_modules(hf)
    S, seed = 3, 7
    top = int(hf_run(hf, CLEAN, []).argmax())
    df = trace_exp.trace(model, CLEAN, SPAN, target=top, samples=S, window=2,
                         sever="mlp", settings=RunSettings(seed=seed, engine="cached"))
    assert df.attrs["how"]["engine"] == "cached"
    # the noise, redrawn from the rule the sidecar records, not from blockscope's function
    std = float(hf.get_input_embeddings().weight.detach().double().std())
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(S, SPAN[1] - SPAN[0], model.cfg.d_model, generator=g) * (3 * std)
    assert df.attrs["noise_scale"] == pytest.approx(3 * std, rel=1e-9)
    tokens = CLEAN.expand(S, -1)

    def noised(t):
        t[:, SPAN[0]:SPAN[1]] += eps
        return t

    noise = (mods["embed"], "out", noised)

    def p(hooks):
        return float(torch.softmax(hf_run(hf, tokens, [noise, *hooks]), -1)[:, top].mean())

    low, high = p([]), float(torch.softmax(hf_run(hf, CLEAN, []), -1)[0, top])
    close(df.attrs["p_corrupted"], low, high - low)
    close(df.attrs["p_clean"], high, high - low)
    n = model.cfg.n_layers
    clean_out = {(k, j): hf_capture(hf, CLEAN, mods[k][j] if k != "layers" else mods[k][j])
                 for k in ("layers", "mlp", "attn") for j in range(n)}
    corrupted_mlp = {j: hf_capture(hf, tokens, mods["mlp"][j], hooks=[noise]) for j in range(n)}
    for r in df.itertuples():
        t, L = r.position, r.layer
        if r.kind == "resid":
            hooks = [(mods["layers"][L], "out", at(t, clean_out["layers", L][:, t]))]
        elif r.kind in ("mlp", "attn"):
            hooks = [(mods[r.kind][j], "out", at(t, clean_out[r.kind, j][:, t]))
                     for j in trace_exp.window_layers(L, n, 2)]
        else:  # resid with the later MLPs frozen at the corrupted run's outputs
            hooks = [(mods["layers"][L], "out", at(t, clean_out["layers", L][:, t]))]
            hooks += [(mods["mlp"][j], "out", at(t, corrupted_mlp[j][:, t]))
                      for j in range(L + 1, n)]
        close(r.p_target, p(hooks), high - low)
        close(r.indirect_effect, r.p_target - low, high - low)


def test_knockout_every_window_equals_a_4d_mask_in_hf(pair):
    model, hf = pair
    mods = hf_modules(hf)
    T = CLEAN.shape[-1]
    top = int(hf_run(hf, CLEAN, []).argmax())
    df = knockout_exp.knockout(model, CLEAN, SPAN, target=top, window=1, bos=True)
    assert df.attrs["how"]["engine"] == "cached"
    clean = float(torch.softmax(hf_run(hf, CLEAN, []), -1)[0, top])
    close(df.attrs["p_clean"], clean, clean)
    assert set(df["from"]) == set(knockout_exp.EDGES)
    for r in df.itertuples():
        keys = knockout_exp.keys(r[1], SPAN, T, bos=True)  # r[1]: the `from` column
        assert 0 not in keys
        handles = [mods["attn"][j].register_forward_pre_hook(hf_knockout_mask_hook(T, keys),
                                                             with_kwargs=True)
                   for j in range(r.layer_start, r.layer_end + 1)]
        try:
            want = float(torch.softmax(hf_run(hf, CLEAN, []), -1)[0, top])
        finally:
            for h in handles:
                h.remove()
        close(r.p_target, want, clean)  # 1e-5 of the whole clean probability


class Halfway:
    """A toy intervention written only here: halfway between the base and the source."""

    def apply(self, base, source):
        return 0.5 * base + 0.5 * source


def test_a_new_intervention_class_runs_on_both_engines_unchanged(pair):
    model, hf = pair
    mods = hf_modules(hf)
    vs = [Variant({"layer": L, "position": t},
                  (Edit(Site("hook_attn_out", L, (t,)), Halfway(), "clean"),))
          for L in range(model.cfg.n_layers) for t in (2, 4, 5)]
    metric = LogitDiff(TARGET, CONTRAST)
    got = {e: sweep(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, vs, metric,
                    settings=RunSettings(engine=e))
           for e in ("cached", "naive")}
    assert got["cached"].how["engine"] == "cached"
    gap = logit_diff(hf_run(hf, CLEAN, [])) - logit_diff(hf_run(hf, CORRUPTED, []))
    for v, a, b in zip(vs, got["cached"].values[:, 0], got["naive"].values[:, 0], strict=True):
        L, t = v.label["layer"], v.label["position"]
        mine = hf_capture(hf, CORRUPTED, mods["attn"][L])[:, t]
        theirs = hf_capture(hf, CLEAN, mods["attn"][L])[:, t]
        want = logit_diff(hf_run(hf, CORRUPTED, [(mods["attn"][L], "out",
                                                  at(t, 0.5 * mine + 0.5 * theirs))]))
        close(a, want, gap)
        close(b, want, gap)


def test_a_resume_from_the_wrong_position_falls_back_loudly(pair, monkeypatch):
    model, _ = pair
    right = resume.entry
    monkeypatch.setattr(resume, "entry", lambda v: (right(v)[0], right(v)[1] + 1))
    vs = patch_exp.variants(model.cfg, 6, ["attn-out"])
    vs = [v for v in vs if v.label["position"] < 5]
    metric = LogitDiff(TARGET, CONTRAST)
    slipped = sweep(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, vs, metric)
    assert slipped.how["engine"] == "naive" and "self-check failed" in slipped.how["fallback"]
    monkeypatch.setattr(resume, "entry", right)
    naive = sweep(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, vs, metric,
                  settings=RunSettings(engine="naive"))
    assert (slipped.values == naive.values).all()


@pytest.mark.parametrize("unembedding", ["a bias of random values", "a hook on its input"])
def test_the_cached_engine_unembeds_as_the_bridge_with_a_bias_or_a_hook(pair, unembedding):
    """The resume writes the unembedding's product into a held buffer, adding the bias only
    where it is not zeros; with a hook it calls the bridge. Either way it equals the naive
    loop (the model's own forward), and the self-check does not fall back."""
    model, _ = pair
    linear = model.unembed.original_component
    before = linear.bias.detach().clone()  # the bridge's zeros, where the checkpoint has none
    vs = [v for v in patch_exp.variants(model.cfg, 6, ["mlp-out"])
          if v.label["position"] >= 4]
    metric = LogitDiff(TARGET, CONTRAST)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(linear.out_features, generator=gen)
    try:
        if unembedding.startswith("a bias"):
            linear.bias.data.copy_(bias)
        else:
            model.unembed.hook_in.add_hook(lambda t, hook: t * 1.5)
        got = {e: sweep(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, vs, metric,
                        settings=RunSettings(engine=e)) for e in ("cached", "naive")}
    finally:
        linear.bias.data.copy_(before)
        model.unembed.hook_in.remove_hooks()
    assert got["cached"].how["engine"] == "cached", got["cached"].how
    plain = sweep(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, vs, metric,
                  settings=RunSettings(engine="naive"))
    assert not torch.allclose(torch.as_tensor(plain.values), torch.as_tensor(
        got["naive"].values)), "the bias or hook changed nothing: the test would see no slip"
    assert torch.allclose(torch.as_tensor(got["cached"].values),
                          torch.as_tensor(got["naive"].values), rtol=0, atol=1e-4)


def test_the_resume_counts_its_held_logits_in_the_batch_budget(pair, monkeypatch):
    """A batch's logits (rows x d_vocab, held for the sweep) fit the engine's budget, and a
    batch cut to fit gives the same cells."""
    model, _ = pair
    S = 2
    kw = dict(target=TARGET, samples=S, kinds=["resid"])
    whole = trace_exp.trace(model, CLEAN, SPAN, **kw)
    budget = 3 * S * 4 * model.cfg.d_vocab  # three variants' logits, and no room for more
    monkeypatch.setattr(engine, "BUDGET_BYTES", budget)
    cut = trace_exp.trace(model, CLEAN, SPAN, **kw)
    assert cut.attrs["how"]["engine"] == "cached"
    assert 1 <= cut.attrs["how"]["batch_size"] < 3 < whole.attrs["how"]["batch_size"]
    assert (cut["p_target"] - whole["p_target"]).abs().max() <= 1e-6


def test_the_cached_engine_runs_less_than_the_naive_loop(pair):
    model, _ = pair
    df = trace_exp.trace(model, CLEAN, SPAN, target=TARGET, samples=2, kinds=["resid"])
    how = df.attrs["how"]
    n, T = model.cfg.n_layers, CLEAN.shape[-1]
    # restoring (layer j, position t) runs blocks j+1.. at positions t..
    assert how["block_positions"] == 2 * sum((n - j - 1) * (T - t)
                                             for j in range(n) for t in range(T))
    assert how["naive_block_positions"] == 2 * n * T * n * T


def test_the_commands_write_their_columns_and_refuse_unequal_prompts(tiny_dir, tmp_path):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import result

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in (*args, "--model", tiny_dir,
                                                         "--out-dir", tmp_path)])

    res = run("patch", "--clean", "The capital of France is", "--corrupted",
              "The capital of Italy is", "--target", " Paris", "--contrast", " Rome",
              "--site", "resid-pre", "--site", "z")
    assert res.exit_code == 0, res.output
    # tokens in the title as in the table, so that it wraps between words, not in a token
    assert "logit(␣Paris) - logit(␣Rome)" in " ".join(res.output.split())
    # the strongest sites of each kind: resid-pre alone would fill the table
    assert res.stdout.count("│ z L") == res.stdout.count("│ resid-pre L") == 5
    df = pd.read_csv(result(tmp_path, "patch-tiny-gpt2.csv"))
    assert list(df.columns) == ["site", "layer", "head", "position", "token", "logit_diff",
                                "normalized"]
    assert set(df["site"]) == {"resid-pre", "z"}
    res = run("trace", "The capital of France is", "--subject", "France", "--samples", 2)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(result(tmp_path, "trace-tiny-gpt2.csv"))
    assert list(df.columns) == ["kind", "layer", "position", "token", "p_target",
                                "indirect_effect"]
    meta = json.loads(result(tmp_path, "trace-tiny-gpt2.json").read_text())
    assert meta["seed"] == 0 and meta["noise_scale"] > 0 and "randn" in meta["noise_rule"]
    # how the sweep ran: the same flat fields as every command's sidecar (sweeps.how.How)
    assert meta["engine"] == "cached" and "fallback" not in meta
    assert 0 < meta["block_positions"] < meta["naive_block_positions"]
    assert meta["batch_size"] >= 1
    res = run("knockout", "The capital of France is", "--subject", "France", "--window", 2)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(result(tmp_path, "knockout-tiny-gpt2.csv"))
    assert list(df.columns) == ["from", "layer_start", "layer_end", "p_target",
                                "relative_change"]
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run("patch", "--clean", "The capital of France is", "--corrupted",
              "The capital of the United Kingdom is", "--target", " Paris")
    assert res.exit_code != 0
    assert "same number of tokens" in res.output and "Traceback" not in res.output
    assert "loading" not in res.output  # refused from the tokenizer, before the load
    res = run("trace", "The capital of France is", "--subject", "Spain")
    assert res.exit_code != 0 and "not in the prompt" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_fact_averages_and_intervals_equal_a_direct_resampling():
    import numpy as np
    import pandas as pd

    from blockscope.experiments.facts import averaged, category, read_facts

    facts = read_facts("builtin")
    assert len(facts) >= 150 and all(f.subject in f.prompt for f in facts)
    assert [category(t, (2, 4), 7) for t in range(7)] == [
        "before subject", "before subject", "first subject", "last subject", "first after",
        "further", "last"]
    rng = np.random.default_rng(1)
    # "c" only in facts 0 and 1: a tenth of the resamples of the six draw neither
    per_fact = pd.DataFrame([{"fact": f, "layer": j, "category": c, "v": rng.normal()}
                             for f in range(6) for j in range(2)
                             for c in ("a", "a", "b", *("c" * (f < 2)))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cell some resamples lack is no numpy warning
        avg = averaged(per_fact, ["layer", "category"], "v", n_boot=200, seed=3)
    idx = np.random.default_rng(3).integers(0, 6, size=(200, 6))
    for r in avg.itertuples():
        cell = per_fact[(per_fact.layer == r.layer) & (per_fact.category == r.category)]
        each = cell.groupby("fact")["v"].mean()  # one value per fact that has the cell
        assert r.v == pytest.approx(each.mean())
        boot = [each[[f for f in draw if f in each.index]].mean() for draw in idx
                if any(f in each.index for f in draw)]  # resamples that draw none: left out
        lo, hi = np.percentile(boot, [2.5, 97.5])
        assert (r.ci_low, r.ci_high) == pytest.approx((lo, hi))
        assert r.n_facts == len(each) == (2 if r.category == "c" else 6)


@pytest.mark.parametrize("family, name", [("gptj", "GPT-J"), ("gpt_neo", "GPT-Neo"),
                                          ("opt", "OPT")])
def test_knockout_is_refused_where_the_scores_hook_does_not_reach_the_softmax(tmp_path, family,
                                                                             name):
    from blockscope.errors import BlockscopeError

    d = save_checkpoint(family, tmp_path / family)
    model = load_model(spec_for(str(d), device="cpu"))
    with pytest.raises(BlockscopeError, match=f"cannot run on {name}:"), \
            warnings.catch_warnings():  # the refusal is the one line a user sees
        warnings.simplefilter("error")
        knockout_exp.knockout(model, CLEAN, SPAN, target=5, window=1, bos=True)


def test_facts_run_the_known_ones_or_all_and_average_them(tiny_dir, tmp_path):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import result

    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps(f) + "\n" for f in [
        {"prompt": "The capital of France is", "subject": "France", "target": " Paris"},
        {"prompt": "The Eiffel Tower is in the city of", "subject": "Eiffel Tower",
         "target": " Paris"}]))
    out = tmp_path / "out"

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in (*args, "--model", tiny_dir,
                                                         "--out-dir", out)])

    bad = tmp_path / "bad.jsonl"
    bad.write_text(facts.read_text() + '{"prompt": "x", "subject"\n')
    res = run("knockout", "--facts", bad)
    assert res.exit_code != 0 and "line 3: not JSON" in res.output
    assert "loading" not in res.output  # refused before the model loads
    res = run("knockout", "--facts", facts)  # a random model knows no fact
    assert res.exit_code != 0 and "knows none of the 2 facts" in res.output
    res = run("knockout", "--all-facts")
    assert res.exit_code != 0 and "--all-facts goes with --facts" in res.output
    res = run("knockout", "--facts", facts, "--all-facts", "--window", 2)
    assert res.exit_code == 0, res.output
    avg = pd.read_csv(result(out, "knockout-tiny-gpt2-facts.csv"))
    per = pd.read_csv(result(out, "knockout-tiny-gpt2-facts-per-fact.csv"))
    assert set(per["fact"]) == {0, 1} and (avg["n_facts"] == 2).all()
    mean = per.groupby(["from", "layer_start"])["relative_change"].mean()
    for r in avg.itertuples():
        assert r.relative_change == pytest.approx(mean[r[1], r.layer_start])
        assert r.ci_low <= r.relative_change <= r.ci_high
    meta = json.loads(result(out, "knockout-tiny-gpt2-facts.json").read_text())
    assert meta["n_facts"] == 2 and meta["n_used"] == 2 and meta["n_known"] == 0


def test_facts_shared_across_ranks_give_one_process_table():
    """Fact k runs on rank k mod 2; each rank gathers every rank's rows (a two-rank gather
    written here), and the table equals one process's."""
    import pandas as pd

    from blockscope.experiments.facts import over
    from blockscope.inputs.parallel import Comm

    items = [{"tokens": torch.zeros(1, 4 + k % 2), "span": (1, 2), "target": k}
             for k in range(5)]

    def run(tokens, span, target):  # a stand-in experiment: rows per position
        return pd.DataFrame({"layer": 0, "position": range(tokens.shape[-1]),
                             "v": [target + 0.1 * t for t in range(tokens.shape[-1])]})

    one = over(items, run, ["layer", "category"], "v")
    parts = {}

    class Rank(Comm):
        def gather(self, obj):
            parts[self.rank] = obj
            return [parts.get(r, []) for r in range(self.size)]

    over(items, run, ["layer", "category"], "v", comm=Rank(1, 2))  # rank 1 first: its rows
    per_fact, avg = over(items, run, ["layer", "category"], "v", comm=Rank(0, 2))
    assert {int(f["fact"].iloc[0]) for f in parts[0]} == {0, 2, 4}
    pd.testing.assert_frame_equal(per_fact, one[0])
    pd.testing.assert_frame_equal(avg, one[1])


@pytest.mark.parametrize("rule", ["subjects", "embeddings", "0.25"])
def test_the_noise_scale_is_redrawn_from_the_sidecar(tiny_dir, hf, tmp_path, rule):
    """`trace --noise-std`: the sidecar's std is recomputed here from the plain HF model
    (ROME's collect_embedding_std: every entry of the subjects' embeddings, each subject
    tokenized alone, over every fact kept with --facts; or every entry of W_E; or the number
    given), and the noise redrawn from the sidecar's seed and scale gives the sidecar's
    P(target) with the subject noised, through the HF model."""
    import json

    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import result

    subjects = ["France", "Eiffel Tower", "Germany"]
    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps({"prompt": p, "subject": s, "target": " x"}) + "\n"
                             for p, s in zip(["The capital of France is",
                                              "The Eiffel Tower is in",
                                              "The language of Germany is"], subjects,
                                             strict=True)), encoding="utf-8")
    common = ["--samples", 2, "--kind", "resid", "--noise-std", rule, "--noise", 2.5,
              "--seed", 3, "--model", tiny_dir, "--no-plot"]
    embed = hf.get_input_embeddings()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)

    def want_std(names):
        if rule == "embeddings":
            return float(embed.weight.detach().double().std())
        if rule == "subjects":
            rows = [embed(torch.tensor(tok.encode(s))) for s in names]
            return float(torch.cat(rows).detach().double().std())
        return 0.25

    for args, names, stem in (
            (["The capital of France is", "--subject", "France"], ["France"], "trace-tiny-gpt2"),
            (["--facts", facts, "--all-facts"], subjects, "trace-tiny-gpt2-facts")):
        out = tmp_path / stem
        res = CliRunner().invoke(app, [str(a) for a in ("trace", *args, *common,
                                                        "--out-dir", out)])
        assert res.exit_code == 0, res.output
        meta = json.loads(result(out, f"{stem}.json").read_text())
        std = want_std(names)
        assert meta["noise_std"]["rule"] == ("given" if rule == "0.25" else rule)
        assert meta["noise_std"]["std"] == pytest.approx(std, rel=1e-12)
        assert meta["noise_scale"] == pytest.approx(2.5 * std, rel=1e-12)
    # the one prompt's P(target) with the subject noised, redrawn from the sidecar
    meta = json.loads(result(tmp_path / "trace-tiny-gpt2", "trace-tiny-gpt2.json").read_text())
    tokens = torch.tensor([meta["tokens"]])
    lo, hi = meta["subject_tokens"]
    g = torch.Generator().manual_seed(meta["seed"])
    eps = torch.randn(2, hi - lo, hf.config.n_embd, generator=g) * meta["noise_scale"]

    def noised(t):
        t[:, lo:hi] += eps
        return t

    logits = hf_run(hf, tokens.expand(2, -1), [(embed, "out", noised)])
    p = float(torch.softmax(logits, -1)[:, meta["target_id"]].mean())
    assert meta["p_corrupted"] == pytest.approx(p, rel=1e-5, abs=1e-7)
