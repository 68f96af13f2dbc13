"""Every family blockscope checks, held to plain-transformers references written here.

One tiny random-weight checkpoint per family (tests/builders.py FAMILY_CONFIGS). The references
use only the HF model and torch forward hooks on its own modules: a block skipped by a hook
that returns its input; a half removed (or mean-replaced) at the module whose output joins
the stream; a head removed by zeroing (or mean-filling) its slice of the output projection's
input. Every experiment, both engines, must give the reference's numbers.
"""

import math

import pytest
import torch

from blockscope.experiments.ablate import block_ablation
from blockscope.experiments.heads import single_head_ablation
from blockscope.experiments.prune_heads import pruning_curve
from blockscope.experiments.resid_norm import resid_norms
from blockscope.experiments.shapes import block_shapes
from blockscope.inputs.text import tokenize
from blockscope.model.arch import FAMILIES, layout
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps.settings import RunSettings

from ..builders import FAMILY_CONFIGS, save_checkpoint
from ..references import input_hook, layers, output_hook, sub, writes

REL = 1e-5
N_TOKENS = 24

# Families whose blocks the engine replays as plain torch calls (replay.py, replay_rotary.py)
PLAIN = {"gpt2", "llama", "mistral", "qwen2", "gpt_neox"}


def test_every_checked_family_has_a_tiny_config():
    assert set(FAMILY_CONFIGS) - {"gemma3"} | {"gemma3_text"} == set(FAMILIES)


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def fam(request, tmp_path_factory, alice_text):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = save_checkpoint(family, tmp_path_factory.mktemp(family) / family)
    model = load_model(spec_for(str(path), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = tokenize(model.tokenizer, alice_text, prepend_bos=True, max_tokens=N_TOKENS)
    return family, model, hf, ids


def hf_nll(hf, ids, hooks=()) -> float:
    """Mean next-token NLL from HF's own loss, with forward hooks on its modules."""
    handles = [register(m) for m, register in hooks]
    try:
        with torch.inference_mode():
            return float(hf(ids, labels=ids, use_cache=False).loss)
    finally:
        for h in handles:
            h.remove()


_MEANS: dict = {}  # family -> hf_means, shared by the tests of one family


def family_means(fam) -> dict:
    family, model, hf, ids = fam
    if family not in _MEANS:
        _MEANS[family] = hf_means(hf, ids, family, model.cfg.d_head)
    return _MEANS[family]


def hf_means(hf, ids, family, d_head) -> dict:
    """Clean means over positions: each block's contribution, each write, each head's z."""
    out, hooks = {}, []
    attn_w, mlp_w, o_proj = writes(family)
    for i, layer in enumerate(layers(hf)):
        def keep(key):  # OPT's MLP sees (batch x pos, d): average every row
            return lambda y, x: out.__setitem__(key, y.double().reshape(-1, y.shape[-1])
                                                .mean(0)) or y

        def keep_block(key):
            return lambda y, x: out.__setitem__(key, (y - x).double().mean(dim=(0, 1))) or y

        hooks += [output_hook(layer, keep_block(("block", i))),
                  output_hook(sub(layer, attn_w), keep(("attn", i))),
                  output_hook(sub(layer, mlp_w), keep(("mlp", i))),
                  input_hook(sub(layer, o_proj),
                             lambda z, i=i: out.__setitem__(("heads", i), z.double().reshape(
                                 -1, z.shape[-1]).mean(0).view(-1, d_head)) or z)]
    hf_nll(hf, ids, hooks)
    return out


def reference_part(hf, ids, family, part, layer, fill=None) -> float:
    mod = layers(hf)[layer]
    if part == "block":
        fn = (lambda y, x: x) if fill is None else (lambda y, x: x + fill.to(x))
        return hf_nll(hf, ids, [output_hook(mod, fn)])
    path = writes(family)[0 if part == "attn" else 1]
    fn = (lambda y, x: torch.zeros_like(y)) if fill is None else (
        lambda y, x: fill.to(y).expand_as(y).clone())
    return hf_nll(hf, ids, [output_hook(sub(mod, path), fn)])


def reference_head(hf, ids, family, layer, head, d_head, fill=None) -> float:
    def fn(z):
        z = z.clone()
        sl = slice(head * d_head, (head + 1) * d_head)
        z[..., sl] = 0 if fill is None else fill[head].to(z)
        return z

    return hf_nll(hf, ids, [input_hook(sub(layers(hf)[layer], writes(family)[2]), fn)])


def close(got, want):
    assert got == pytest.approx(want, rel=REL), (got, want)


def test_baseline_and_every_part_and_method_match_the_reference(fam):
    """Every part removed with zero on every family, by both engines against HF; the mean
    fill (the engine alone: the naive loop's hooks are the same for a fill or none) on one
    part per family, the part taking turns down the sorted families."""
    family, model, hf, ids = fam
    n_scored = ids.shape[-1] - 1
    means = family_means(fam)
    baseline = hf_nll(hf, ids)
    mean_part = ("block", "attn", "mlp")[sorted(FAMILY_CONFIGS).index(family) % 3]
    for part in ("block", "attn", "mlp"):
        for method in ("zero", "mean") if part == mean_part else ("zero",):
            # the naive loop's hooks are the same for both methods (a fill or none): it is
            # held to HF with zero on every part, the engine with both methods
            runs = {e: block_ablation(model, ids, part=part, method=method,
                                      settings=RunSettings(engine=e))
                    for e in (("naive", "cached") if method == "zero" else ("cached",))}
            how = runs["cached"].attrs["engine"]
            assert "fallback" not in how, how
            assert how["replay"] == ("plain" if family in PLAIN else "bridge"), how
            want = [reference_part(hf, ids, family, part, i, means[(part, i)] if method ==
                                   "mean" else None) for i in range(model.cfg.n_layers)]
            for df in runs.values():  # both engines against the same HF references
                assert df.loc[0, "nll"] == pytest.approx(baseline, rel=REL)
                assert (df["n_scored"] == n_scored).all()
                for i, ref in enumerate(want):
                    close(df.loc[i + 1, "nll"], ref)
            # the engine's KL (linear in the normed residual, or Gemma2's softcapped logits
            # formed again per chunk) against the naive loop's full distributions
            if method != "zero":
                continue
            kl = {e: r["kl"].tolist() for e, r in runs.items()}
            assert kl["cached"][0] == 0 and min(kl["naive"][1:]) > 0
            assert kl["cached"] == pytest.approx(kl["naive"], rel=10 * REL,
                                                 abs=REL * baseline), (part, method)


def test_single_heads_match_the_reference(fam):
    family, model, hf, ids = fam
    means = family_means(fam)
    layer = model.cfg.n_layers - 2  # one layer with a later block: a full replay after it
    heads = sorted({0, model.cfg.n_heads - 1})  # the first and the last head
    for method in ("zero", "mean"):
        fill = means[("heads", layer)] if method == "mean" else None
        want = {head: reference_head(hf, ids, family, layer, head, model.cfg.d_head, fill)
                for head in heads}
        for engine in ("naive", "cached"):
            df = single_head_ablation(model, ids, method=method, layers=[layer], heads=heads,
                                      settings=RunSettings(engine=engine))
            assert "fallback" not in df.attrs["engine"]
            for row in df.iloc[1:].itertuples():
                close(row.nll, want[row.head])


def test_pruning_curve_engine_equals_naive(fam):
    _, model, _, ids = fam
    half = model.cfg.n_layers * model.cfg.n_heads // 2  # two steps: half the heads, then all
    naive, fast = (pruning_curve(model, ids, order="random", step=half,
                                 settings=RunSettings(engine=e, seed=1))
                   for e in ("naive", "cached"))
    assert naive["heads_removed"].equals(fast["heads_removed"])
    assert torch.allclose(torch.tensor(fast["nll"].tolist()), torch.tensor(naive["nll"].tolist()),
                          rtol=REL, atol=0)


def test_resid_norm_and_shapes_follow_the_layout(fam):
    family, model, hf, ids = fam
    lay = layout(model)
    df = resid_norms(model, ids)
    with torch.inference_mode():
        hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
    posts = df[df["hook"].str.endswith("hook_resid_post")].reset_index()
    # HF's hidden_states[k] is block k's input; its last one is after the final norm
    for k in range(model.cfg.n_layers - 1):
        close(posts.loc[k, "norm"], float(hidden[k + 1][0, -1].norm()))
    close(df.loc[0, "norm"], float(hidden[0][0, -1].norm()))
    assert df["hook"].str.endswith("hook_resid_mid").any() == lay.has_mid
    shapes = block_shapes(model, ids)
    assert shapes["matches"].all(), shapes[~shapes["matches"]]
    assert shapes["hook"].str.endswith("hook_resid_mid").any() == lay.has_mid


def test_params_files_every_parameter_of_every_family():
    """No family's MLP (OPT's fc1/fc2, Mixtral's experts) lands in "block other"."""
    import transformers

    from blockscope.experiments.params import parameter_counts

    for family, (name, kw) in FAMILY_CONFIGS.items():
        config = getattr(transformers, name)(vocab_size=50257, **kw)
        df = parameter_counts(config).set_index("component")
        assert "block other" not in df.index and "other" not in df.index, family
        assert df.loc["MLP", "parameters"] > 0 and df.loc["attention", "parameters"] > 0
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert df.loc["total", "parameters"] == sum(p.numel() for p in model.parameters())


def test_gradient_pass_through_the_plain_replay_equals_the_hooked_model(fam):
    """The head-mask gradient replayed plainly (families with a plain replay) equals the
    hooked bridge's, NLL and importance, at masks with removed heads (which the plain replay
    leaves out): some of a layer's; a whole layer's, and all but one head of another (a
    grouped-query K/V head no kept head reads). Elsewhere it runs through the bridge, and
    nothing falls back. A removed head's importance is 0 either way."""
    from blockscope.sweeps import scoring
    from blockscope.sweeps.gradient import gradient_pass

    family, model, _, ids = fam
    prepared = scoring.prepare(model, ids, heads=True, settings=RunSettings(engine="cached"))
    last = model.cfg.n_layers - 1
    for removed in ([(last, slice(0, 2))], [(0, slice(None)), (last, slice(1, None))]):
        keep = torch.ones(model.cfg.n_layers, model.cfg.n_heads)
        for layer, heads in removed:
            keep[layer, heads] = 0
        fast = gradient_pass(model, ids, keep=keep, prepared=prepared)
        slow = gradient_pass(model, ids, keep=keep)
        assert fast[2].how["replay"] == ("plain" if family in PLAIN else "bridge"), fast[2].how
        assert "fallback" not in fast[2].how and slow[2].how["replay"] == "bridge"
        assert ("why_naive" in fast[2].how) == (family not in PLAIN)  # said why not
        assert "clean passes" in slow[2].how["why_naive"]
        assert torch.allclose(fast[0], slow[0], rtol=REL, atol=REL * float(slow[0].max()))
        assert fast[2].of("nll") == pytest.approx(slow[2].of("nll"), rel=REL)
        assert not fast[0][keep == 0].any() and not slow[0][keep == 0].any()
        assert fast[0][keep == 1].all()


def test_the_registry_is_the_one_place_that_names_a_model_type():
    """No module but arch.py decides by an HF model_type: the registry's records carry it
    (the parallel rule, the replay, the refusals)."""
    import re
    from pathlib import Path

    src = Path(__file__).parents[2] / "src" / "blockscope"
    decides = re.compile(r"model_type\s*(==|!=|in\s*[(\[{])")
    offenders = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if p.name != "arch.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if decides.search(line)]
    assert not offenders, offenders


def test_logit_lens_and_attribution_on_every_family(fam):
    """The lens at the last point is the model's own output, on every family; the direct
    logit attribution adds up to HF's logit, or is refused in one line where a family's
    writes do not sum to its stream."""
    from blockscope.errors import BlockscopeError
    from blockscope.experiments.logit_lens import attribution, lens

    family, model, hf, ids = fam
    ids = ids[:, :12]
    pos = ids.shape[1] - 1
    df = lens(model, ids, positions=[pos], k=1)
    with torch.no_grad():
        logits = hf(ids).logits[0, pos].double()
    t = int(logits.argmax())
    assert df["target_id"].iloc[-1] == t and df["target_rank"].iloc[-1] == 1
    try:
        attrs = attribution(model, ids, position=pos, target=t)
    except BlockscopeError as exc:
        assert family in REFUSED_ATTRIBUTION, (family, str(exc))
        assert "\n" not in str(exc)
        return
    assert family not in REFUSED_ATTRIBUTION
    total = attrs[attrs["level"] == "block"]["contribution"].sum()
    cap = attrs.attrs["softcap"]  # attributed before the softcap; HF's logit is after it
    total = total if cap is None else cap * math.tanh(total / cap)
    assert total == pytest.approx(float(logits[t]), abs=1e-4 * max(1.0, abs(float(logits[t]))))


REFUSED_ATTRIBUTION: set[str] = set()  # none today: every family's writes sum to its stream


def test_the_decomposition_adds_up_with_both_engines(fam):
    """ablate --decompose on every family: direct + downstream + final norm = total with
    either engine (the run-time check raises otherwise), the two engines agree per token,
    and the cached engine runs without falling back; a final-logit softcap is refused."""
    from blockscope.errors import BlockscopeError
    from blockscope.experiments.ablate import decomposed
    from blockscope.model.arch import layout
    from blockscope.sweeps.settings import RunSettings

    _, model, _, ids = fam
    ids = ids[:, :24]
    if layout(model).softcap is not None:
        with pytest.raises(BlockscopeError, match="softcaps its final logits"):
            decomposed(model, ids)
        return
    cols = ["total", "direct", "downstream", "final_norm"]
    for part in ("attn",):  # a half: the entries blocks take are held in test_decompose
        runs = {e: decomposed(model, ids, part=part, method="mean",
                              settings=RunSettings(engine=e)) for e in ("cached", "naive")}
        for df, _ in runs.values():
            left = df["direct"] + df["downstream"] + df["final_norm"] - df["total"]
            assert left.abs().max() < 1e-4
        how = runs["cached"][0].attrs["engine"]  # BLOOM's and OPT's halves have no entry
        assert "fallback" not in how and ("why_naive" in how) == (how["engine"] == "naive")
        a, b = runs["cached"][1][cols], runs["naive"][1][cols]
        assert (a - b).abs().max().max() < 1e-4 * max(1.0, float(b.abs().max().max()))


# Families whose bridge lacks the per-head hooks edges need, or whose sublayers are normed
# before the stream (a head's write is not what the stream receives): refused in one line.
EDGES_REFUSED = {"gpt_neo", "gptj", "opt", "bloom", "falcon", "phi", "gemma2", "gemma3",
                 "olmo2"}


def test_attribution_and_edges_on_every_family(fam):
    """attribute's node estimates run on every family, and the QK fix's stopped forward
    gives the pattern a whole hooked forward gives. Edges either hold their two identities
    (a writer's edges sum to its node estimate; the rewired run with no edge patched is the
    clean run, with every edge the corrupted one) or are refused in one line, the model
    left as it was."""
    import numpy as np

    from blockscope.errors import BlockscopeError
    from blockscope.experiments.patch import variants
    from blockscope.interventions.interchange import Edit, Patch, Site
    from blockscope.sweeps import attribution, edges, qk_fix
    from blockscope.sweeps.interchange import Run
    from blockscope.sweeps.metrics import LogitDiff

    family, model, _, ids = fam
    clean = ids[:, :8]
    corrupted = clean.clone()
    corrupted[0, 4] = clean[0, 5]  # another token of the passage
    metric = LogitDiff(11, 22)
    grid = variants(model.cfg, clean.shape[-1], ["z", "mlp-out"])
    atp = attribution.estimate(model, Run(corrupted), {"clean": Run(clean)}, grid, metric)
    # the QK fix's pattern: the forward stopped at block 0, its queries the clean run's,
    # equals a whole forward with them written by a hook here
    seen = {}

    def keep(key):
        def hook(act, hook=None):
            seen[key] = act.detach().clone()
        return hook

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_q", keep("q"))]):
        model(clean)
    with torch.no_grad(), model.hooks(fwd_hooks=[
            ("blocks.0.attn.hook_q", lambda act, hook=None: seen["q"]),
            ("blocks.0.attn.hook_pattern", keep("pattern"))]):
        model(corrupted)
    edit = Edit(Site("attn.hook_q", 0), Patch(), seen["q"])
    torch.testing.assert_close(qk_fix.patched_pattern(model, corrupted, edit, {}),
                               seen["pattern"][0])
    before = model(clean, return_type="logits").detach()
    try:
        es = edges.scores(model, clean, corrupted, metric)
    except BlockscopeError as exc:
        assert family in EDGES_REFUSED, (family, str(exc))
        assert "\n" not in str(exc)
        torch.testing.assert_close(model(clean, return_type="logits").detach(), before)
        return
    assert family not in EDGES_REFUSED
    node: dict = {}
    for v, e in zip(grid, atp.values, strict=True):
        kind = "head" if v.label["site"] == "z" else "mlp"
        key = edges.Node(kind, v.label["layer"], v.label["head"] if kind == "head" else None)
        node[key] = node.get(key, 0.0) + e
    sums = dict(zip(es.graph.writers, es.values.sum(0), strict=True))
    scale = max(abs(x) for x in node.values())
    assert all(sums[k] == pytest.approx(x, abs=2e-5 * scale) for k, x in node.items())
    g, gap = es.graph, abs(es.source - es.base)
    none = edges.rewired(model, clean, g, np.zeros_like(g.valid), es.replacement, metric)
    every = edges.rewired(model, clean, g, g.valid.copy(), es.replacement, metric)
    assert none == pytest.approx(es.source, abs=1e-5 * gap)
    assert every == pytest.approx(es.base, abs=1e-5 * gap)
