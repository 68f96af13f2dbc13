"""How sweeps run: one definition per intervention, a user's hooks honoured by the engine,
and a broken replay caught by the self-check, which falls back to the naive loop."""

import pytest
import torch

from blockscope.experiments.ablate import block_ablation
from blockscope.experiments.heads import single_head_ablation
from blockscope.inputs.text import tokenize
from blockscope.interventions import applied, hooks
from blockscope.interventions import intervention as Edit
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps import unembed
from blockscope.sweeps.settings import RunSettings

from ..builders import save_checkpoint

REL = 1e-5


def same(a, b):
    assert torch.allclose(torch.tensor(a["nll"].tolist()), torch.tensor(b["nll"].tolist()),
                          rtol=REL, atol=0), (a["nll"].tolist(), b["nll"].tolist())


@pytest.fixture(scope="module")
def ids(tiny, alice_text):
    return tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=40)


def test_an_edit_is_defined_once_as_hooks():
    fill = torch.ones(4, 16)
    (name, _), = hooks([Edit("heads", 2, fill, torch.tensor([1.0, 0, 1, 1]))])
    assert name == "blocks.2.attn.hook_z"
    assert [n for n, _ in hooks([Edit("block", 1)])] == ["blocks.1.hook_resid_post",
                                                          "blocks.1.hook_resid_pre"]
    assert [n for n, _ in hooks([Edit("mlp", 0)])] == ["blocks.0.hook_mlp_out"]
    with pytest.raises(ValueError):
        Edit("heads", 0)  # heads need `keep`


@pytest.mark.parametrize("point", ["blocks.1.hook_resid_post", "blocks.1.hook_resid_mid",
                                   "blocks.1.attn.hook_z", "blocks.0.hook_resid_pre"])
def test_a_users_hook_gives_the_same_numbers_through_the_engine(tiny, ids, point):
    # a shift along a fixed direction: a scale or a uniform shift would vanish in a norm
    direction = torch.linspace(-1.0, 1.0, tiny.cfg.d_model)
    shift = [(point, lambda act, hook=None: act + (direction if act.shape[-1] == direction.numel()
                                                    else 0.5))]
    with applied(tiny, shift):
        runs = {e: (block_ablation(tiny, ids, part="attn", settings=RunSettings(engine=e)),
                    block_ablation(tiny, ids, part="block", settings=RunSettings(engine=e)),
                    single_head_ablation(tiny, ids, layers=[0, 1], settings=RunSettings(engine=e)))
                for e in ("naive", "cached")}
    for naive, cached in zip(runs["naive"], runs["cached"], strict=True):
        assert "fallback" not in cached.attrs["engine"]
        same(naive, cached)
    unhooked = single_head_ablation(tiny, ids, layers=[0, 1])
    assert (unhooked["nll"] - runs["naive"][2]["nll"]).abs().max() > 1e-3  # the hook matters


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, alice_text):
    model = load_model(spec_for(str(save_checkpoint(
        "gemma2", tmp_path_factory.mktemp("g2") / "gemma2")), device="cpu"))
    return model, tokenize(model.tokenizer, alice_text, prepend_bos=True, max_tokens=30)


def test_a_broken_replay_is_caught_and_the_naive_loop_runs(gemma2, monkeypatch):
    """Softcapping left out of the replayed unembedding: the self-check sees it against the
    model's own logits, the sweep falls back, and the numbers are the naive loop's."""
    model, ids = gemma2
    naive = block_ablation(model, ids, settings=RunSettings(engine="naive"))
    monkeypatch.setattr(unembed, "softcapped", lambda logits, cap: logits)
    cached = block_ablation(model, ids)
    assert "unembedding" in cached.attrs["engine"]["fallback"]
    assert cached.attrs["engine"]["replay"] == "naive"
    same(naive, cached)


def test_a_broken_block_replay_is_caught(tiny, ids, monkeypatch):
    from blockscope.sweeps import steps

    naive = block_ablation(tiny, ids, part="mlp", settings=RunSettings(engine="naive"))
    monkeypatch.setattr(steps, "plain_parts", lambda model: None)  # the bridge's blocks
    monkeypatch.setattr(steps, "block_step", lambda m, c, j, x, p: 1.001 * x)
    cached = block_ablation(tiny, ids, part="mlp")
    assert "replaying block" in cached.attrs["engine"]["fallback"]
    same(naive, cached)


def test_a_clean_pass_is_checked_once_per_entry_kinds(tiny, ids, monkeypatch):
    """A pruning curve scores many masks from the same clean passes: one self-check each."""
    from blockscope.experiments.prune_heads import pruning_curve
    from blockscope.sweeps import selfcheck

    calls = []
    real = selfcheck._verify
    monkeypatch.setattr(selfcheck, "_verify", lambda *a: calls.append(1) or real(*a))
    curve = pruning_curve(tiny, ids, order="random", step=0.25, settings=RunSettings(seed=1))
    # one window, one set of entry kinds; checked once for steps whose variants run only
    # the plain replay and once for those that bring hooks (the bridge's blocks then run)
    assert len(curve) > 3 and len(calls) <= 2


def test_a_removal_sweep_runs_a_users_edit_as_plain_transformers_does(tiny, hf, ids):
    """An intervention written here alone (a steering vector added to one block's input, and
    one block's output halved towards its input), as `Edit`s in a removal sweep: both
    engines give the NLL of the plain HF model with the same change made by torch hooks
    written here, scored by HF's own loss (`labels=`)."""
    from dataclasses import dataclass

    from blockscope.interventions import Edit, Site
    from blockscope.sweeps import scoring
    from blockscope.sweeps.variant import Variant

    @dataclass(frozen=True)
    class Steer:
        vector: torch.Tensor

        def apply(self, base, source=None):
            return base + self.vector

    @dataclass(frozen=True)
    class Halfway:  # the block's output halfway back to its input
        def apply(self, base, source):
            return 0.5 * (base + source)

    vector = torch.linspace(-2.0, 2.0, tiny.cfg.d_model)
    variants = [Variant({"edit": "steer"}, (Edit(Site("hook_resid_pre", 1), Steer(vector)),)),
                Variant({"edit": "halfway"}, (Edit(Site("hook_resid_post", 0), Halfway(),
                                                   Site("hook_resid_pre", 0)),))]
    got = {}
    for engine in ("naive", "cached"):
        run = RunSettings(stride=100, engine=engine)
        df = scoring.run(tiny, ids, variants, run, prepared=scoring.prepare(tiny, ids, run))
        assert "fallback" not in df.attrs["engine"]
        got[engine] = torch.tensor(df["nll"].tolist()[1:], dtype=torch.float64)

    def out_of(out):  # a block's output: a tensor, or a tuple led by one
        return out if isinstance(out, torch.Tensor) else out[0]

    def written(out, x):  # the block's output as it returned it, with x in place
        return x if isinstance(out, torch.Tensor) else (x, *out[1:])

    received = {}

    def keep(module, args, kwargs):
        received["x"] = args[0] if args else kwargs["hidden_states"]

    def steer(module, args, out):  # block 0's output is block 1's input
        return written(out, out_of(out) + vector)

    def halfway(module, args, out):
        return written(out, 0.5 * (out_of(out) + received["x"]))

    block = hf.transformer.h[0]
    want = []
    for fn in (steer, halfway):
        hooks_on = [block.register_forward_pre_hook(keep, with_kwargs=True),
                    block.register_forward_hook(fn)]
        try:
            with torch.inference_mode():
                loss = hf(ids, labels=ids).loss
        finally:
            for h in hooks_on:
                h.remove()
        want.append(float(loss))  # the mean NLL per scored token, as the table's `nll`
    want = torch.tensor(want, dtype=torch.float64)
    assert (want - float(df["nll"].iloc[0])).abs().min() > 1e-2  # each edit is seen
    for engine in ("naive", "cached"):
        assert torch.allclose(got[engine], want, rtol=REL, atol=0), (engine, got, want)


def test_the_one_orchestrator_runs_cached_then_naive_saying_why():
    """`Engine.run`: the cached path's numbers where it holds; the naive loop's, the record
    saying why, where it raises `Fallback` (the check failed, or it cannot run); the naive
    loop alone, the cached path never called, where the naive engine is asked for."""
    from blockscope.sweeps.how import Engine, Fallback, How, fell_back, not_tried

    def failing(how):
        def cached():
            raise Fallback(how)

        return cached

    seen = []

    def naive(how):
        seen.append(how)
        return "naive numbers"

    assert Engine().run(lambda: ("cached numbers", {"engine": "cached"}), naive) == (
        "cached numbers", {"engine": "cached"})
    assert not seen
    got, how = Engine("cached", How("naive", "bridge", 1)).run(
        failing(How(fallback=fell_back("variant x is 1e-2 off"))), naive)
    assert got == "naive numbers" and how == {
        "engine": "naive", "replay": "bridge", "batch_size": 1,
        "fallback": "the cached engine's self-check failed: variant x is 1e-2 off; every "
                    "variant was run by the naive loop"}
    assert seen[-1].fallback == how["fallback"]
    _, how = Engine().run(failing(How(why_naive=not_tried("an edit at hook_embed"))), naive)
    assert how == {"engine": "naive", "why_naive": "the cached engine cannot run an edit at "
                   "hook_embed; every variant was run by the naive loop"}

    def never():
        raise AssertionError("the cached path ran")

    assert Engine("naive").run(never, naive) == ("naive numbers", {"engine": "naive"})
    with pytest.raises(ValueError, match="'cached' or 'naive'"):
        Engine("fast")


def test_a_sweeps_table_has_the_metrics_columns():
    """`Scores` names its sums by the metric's columns: perplexity from `nll`, every other
    column its mean per scored token, `kl` NaN where the metric has none."""
    import numpy as np

    from blockscope.sweeps.units import Scores

    rng = np.random.default_rng(0)
    sums = rng.uniform(1, 2, size=(3, 2, 3))  # 3 units, baseline and one variant, 3 columns
    counts = np.array([4, 5, 6])
    df = Scores([{"variant": "baseline"}, {"variant": "ablated"}], sums, counts, "chunk", {},
                ("nll", "kl", "entropy")).frame()
    assert list(df.columns[:8]) == ["variant", "n_scored", "nll", "perplexity", "delta",
                                    "ratio", "kl", "entropy"]
    assert df["nll"].tolist() == pytest.approx(sums[..., 0].sum(0) / 15, rel=1e-15)
    assert df["perplexity"].tolist() == pytest.approx(np.exp(sums[..., 0].sum(0) / 15))
    assert df["entropy"].tolist() == pytest.approx(sums[..., 2].sum(0) / 15, rel=1e-15)
    only = Scores([{"variant": "baseline"}, {"variant": "ablated"}],
                  sums[..., :1], counts, "chunk", {}, ("nll",)).frame()
    assert only["kl"].isna().all() and only["nll"].tolist() == df["nll"].tolist()
