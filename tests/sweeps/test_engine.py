"""The cached, batched sweep engine gives the naive hooked loop's numbers, variant by variant."""

import pytest
import torch

from blockscope.experiments.ablate import block_ablation
from blockscope.experiments.heads import head_importance, one_head_per_layer
from blockscope.experiments.heads import single_head_ablation as heads_sweep
from blockscope.experiments.prune_heads import pruning_curve
from blockscope.inputs.text import tokenize
from blockscope.sweeps.clean import clean_pass
from blockscope.sweeps.engine import CPU_BATCH, default_batch_size
from blockscope.sweeps.naive import model_windows, token_nll
from blockscope.sweeps.settings import RunSettings

from ..drive import engine_sweep, perplexity_row

REL = 1e-5


@pytest.fixture(scope="module", params=["short", "windows"])
def ids(request, tiny, alice_text):
    if request.param == "short":
        return tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=60)
    # stride 100, context 128: windows (0, 128) and (100, 200), the second scored from 128
    return tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=200)


@pytest.fixture(scope="module")
def naive_of():
    """Each naive sweep once per module, however many batch sizes it is held against."""
    cache = {}

    def get(key, compute):
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    return get


def same(a, b):
    assert list(a["variant"]) == list(b["variant"])
    assert a["n_scored"].tolist() == b["n_scored"].tolist()
    assert torch.allclose(torch.tensor(a["perplexity"].tolist()),
                          torch.tensor(b["perplexity"].tolist()), rtol=REL, atol=0)
    # the KL from the clean distribution: to the NLL's own precision, relative where large
    if "kl" in a:
        assert not a["kl"].isna().any() and not b["kl"].isna().any()
        assert a["kl"].tolist() == pytest.approx(b["kl"].tolist(), rel=10 * REL,
                                                 abs=REL * float(a["nll"].iloc[0]))


# None: one batch. The short text takes every part with every method; over windows each
# part takes one method, the methods taking turns (the windows' arithmetic is the same).
@pytest.mark.parametrize("ids, part, method, batch_size", [
    *[("short", part, *m) for part in ("block", "attn", "mlp")
      for m in (("zero", None), ("mean", 1))],
    ("windows", "block", "mean", 1), ("windows", "attn", "zero", None),
    ("windows", "mlp", "mean", 1)], indirect=["ids"])
def test_block_sweep_equals_naive(tiny, ids, part, method, batch_size, naive_of):
    naive = naive_of(("blocks", ids.shape[-1], part, method), lambda: block_ablation(
        tiny, ids, part=part, method=method, settings=RunSettings(stride=100, engine="naive")))
    fast = block_ablation(tiny, ids, part=part, method=method,
                          settings=RunSettings(stride=100, batch_size=batch_size))
    same(naive, fast)
    assert naive[["layer", "part", "method"]].equals(fast[["layer", "part", "method"]])


# 5 of 12: a short last batch. Over windows the mean fill, whose means come from every
# window; the zero method's windows are held by the pruning curve's test.
@pytest.mark.parametrize("ids, method, batch_size", [
    ("short", "zero", 5), ("short", "mean", 1), ("windows", "mean", 1)], indirect=["ids"])
def test_single_head_sweep_equals_naive(tiny, ids, method, batch_size, naive_of):
    naive = naive_of(("heads", ids.shape[-1], method), lambda: heads_sweep(
        tiny, ids, method=method, settings=RunSettings(stride=100, engine="naive")))
    fast = heads_sweep(tiny, ids, method=method,
                       settings=RunSettings(stride=100, batch_size=batch_size))
    same(naive, fast)
    assert naive[["layer", "head"]].equals(fast[["layer", "head"]])


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # the single-head windows suffice
def test_one_head_per_layer_equals_naive(tiny, ids):
    importance, _ = head_importance(tiny, ids, settings=RunSettings(stride=100))
    for method in ("zero", "mean"):
        same(one_head_per_layer(tiny, ids, importance, method=method,
                                settings=RunSettings(stride=100, engine="naive")),
             one_head_per_layer(tiny, ids, importance, method=method,
                                settings=RunSettings(stride=100)))


@pytest.mark.parametrize("order", ["gradient"])
def test_pruning_curve_equals_naive(tiny, ids, order):
    """The cached curve (gradient order: each step scored by the next gradient's forward)
    equals the naive loop's, intervals included; the whole model's importance handed in
    changes nothing. Over windows the gradient order only: the orders differ in which
    heads go, not in how a step is scored (the short text holds all three)."""
    from blockscope.sweeps.stats import Bootstrap

    run = RunSettings(stride=100, seed=1, ci=Bootstrap(100))
    naive = pruning_curve(tiny, ids, order=order, step=0.5,
                          settings=RunSettings(stride=100, seed=1, ci=Bootstrap(100),
                                               engine="naive"))
    fast = pruning_curve(tiny, ids, order=order, step=0.5, settings=run,
                         importance=head_importance(tiny, ids, settings=run)[1])
    assert naive["heads_removed"].equals(fast["heads_removed"])
    scale = float(naive["perplexity"].max())  # a change's error is relative to perplexity
    for column in ("perplexity", "ci_low", "ci_high", "delta_ci_low", "delta_ci_high"):
        atol = REL * scale if column.startswith("delta") else 0.0
        assert torch.allclose(torch.tensor(naive[column].tolist(), dtype=torch.float64),
                              torch.tensor(fast[column].tolist(), dtype=torch.float64),
                              rtol=REL, atol=atol, equal_nan=True), column
    assert not fast["kl"].isna().any()
    assert fast["kl"].tolist() == pytest.approx(naive["kl"].tolist(), rel=10 * REL,
                                                abs=REL * float(naive["nll"].iloc[0]))


@pytest.mark.parametrize("ids", ["short"], indirect=True)
@pytest.mark.parametrize("order", ["random", "ablation"])
def test_pruning_curve_other_orders_equal_naive(tiny, ids, order):
    test_pruning_curve_equals_naive(tiny, ids, order)


def test_clean_pass_is_the_clean_forward(tiny, ids):
    wins = model_windows(tiny, ids, 100)
    nll = torch.cat([clean_pass(tiny, ids, w).nll for w in wins]).double()
    assert torch.allclose(nll, token_nll(tiny, ids, wins), rtol=1e-6)
    assert not any(hp.has_hooks() for hp in tiny.hook_dict.values())


def test_clean_pass_with_a_hooked_unembedding_materialises_the_logits(tiny, ids):
    """A hook on the unembedding sees every position, and the NLL is still the clean one."""
    from blockscope.interventions import applied
    from blockscope.sweeps.clean import _last_logits_only

    w = model_windows(tiny, ids, 100)[0]
    seen = []
    assert _last_logits_only(tiny)  # GPT-2 takes logits_to_keep: the fast clean pass
    with applied(tiny, [("unembed.hook_out", lambda x, hook=None: seen.append(x.shape))]):
        assert not _last_logits_only(tiny)
        nll = clean_pass(tiny, ids, w).nll
    assert seen == [torch.Size([1, w.end - w.begin, tiny.cfg.d_vocab])]
    assert torch.allclose(nll, clean_pass(tiny, ids, w).nll, rtol=1e-6)


def test_default_batch_size(tiny):
    class Cfg:
        n_heads, d_mlp, d_model, device = 12, 3072, 768, "cuda:0"

    class Small:
        cfg = Cfg

    assert 1 <= default_batch_size(Small, 470) <= 16
    assert default_batch_size(Small, 1024) < default_batch_size(Small, 470)
    assert default_batch_size(tiny, 60) == 1  # through the bridge's blocks on the CPU
    assert default_batch_size(tiny, 60, plain=True) == CPU_BATCH
    Cfg.device = "cpu"
    assert default_batch_size(Small, 4096, plain=True) < CPU_BATCH  # the memory budget


def test_fused_gelu_is_swapped_back(tiny, ids):
    from transformers.activations import NewGELUActivation

    block_ablation(tiny, ids, layers=[0])
    assert all(isinstance(b.mlp.original_component.act, NewGELUActivation) for b in tiny.blocks)


def test_hooks_on_the_unembedding_are_honoured(tiny, ids):
    from blockscope.interventions import applied
    from blockscope.sweeps.engine import Start

    hooks = [("unembed.hook_out", lambda logits, hook=None: 0.5 * logits)]
    wins = model_windows(tiny, ids, 100)
    start = Start({}, tiny.cfg.n_layers, lambda c: c.pre[-1], hooks=hooks)
    fast = engine_sweep(tiny, ids, [start], wins=wins).loc[1, "perplexity"]
    with applied(tiny, hooks):
        naive = perplexity_row(token_nll(tiny, ids, wins))["perplexity"]
    assert fast == pytest.approx(naive, rel=REL)
    assert fast != pytest.approx(perplexity_row(token_nll(tiny, ids, wins))["perplexity"])


@pytest.mark.parametrize("plain", [True, False])
def test_one_batch_of_mixed_entry_points(tiny, ids, plain, monkeypatch):
    """Variants entering at every block, before or after its attention, in one growing
    batch: clean residuals give the baseline; perturbed ones what they give one at a time."""
    from blockscope.sweeps import steps
    from blockscope.sweeps.engine import Start

    if not plain:
        monkeypatch.setattr(steps, "plain_parts", lambda *a: None)
    n, wins = tiny.cfg.n_layers, model_windows(tiny, ids, 100)

    def starts(scale):
        def resid(c, k, m):
            return scale * (c.act("hook_resid_mid", k) if m else c.pre[k])

        out = [Start({"k": k, "mid": m}, k, lambda c, k=k, m=m: resid(c, k, m), mid=m)
               for k in range(n) for m in (True, False)]  # mixed order on purpose
        return out + [Start({"k": n, "mid": False}, n, lambda c: scale * c.pre[n])]

    clean = engine_sweep(tiny, ids, starts(1.0), wins=wins, batch_size=2 * n + 1)
    ppl = torch.tensor(clean["perplexity"].tolist(), dtype=torch.float64)
    assert torch.allclose(ppl, ppl[0].expand_as(ppl), rtol=REL, atol=0)
    batched = engine_sweep(tiny, ids, starts(1.3), wins=wins, batch_size=2 * n + 1)
    same(batched, engine_sweep(tiny, ids, starts(1.3), wins=wins, batch_size=1))
    assert (batched["ratio"].iloc[1:-1] - 1).abs().min() > 1e-3  # (ln_final undoes a scale)


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
def test_a_broken_plain_gradient_is_caught_and_falls_back(tiny, ids, monkeypatch):
    """If the plain replay applied the head mask wrongly (here: not at all), the self-check
    against the hooked model catches it: the bridge's gradient is used, and that is said."""
    from blockscope.sweeps import replay, scoring
    from blockscope.sweeps.gradient import gradient_pass

    keep = torch.ones(3, 4)
    keep[2, 1] = 0
    want = gradient_pass(tiny, ids, keep=keep)
    monkeypatch.setattr(replay, "scaled", lambda z, keep: z)
    prepared = scoring.prepare(tiny, ids, heads=True, settings=RunSettings(engine="cached"))
    got = gradient_pass(tiny, ids, keep=keep, prepared=prepared)
    assert "head-mask gradient differs" in got[2].how["fallback"]
    assert got[2].how["replay"] == "bridge"
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
def test_leaving_out_removed_heads_is_checked_before_it_is_used(tiny, ids, monkeypatch):
    """The plain replay leaves out the heads a mask removes (`replay.kept_heads`). The
    self-check holds that path too, even after a check at a mask that removes no head (as in
    prune-heads: the importance of the whole model, then the pruning steps): a replay that
    left out the wrong head is caught, and the bridge's gradient is used."""
    from blockscope.sweeps import replay, scoring
    from blockscope.sweeps.gradient import gradient_pass

    prepared = scoring.prepare(tiny, ids, heads=True, settings=RunSettings(engine="cached"))
    whole = gradient_pass(tiny, ids, prepared=prepared)
    assert whole[2].how["replay"] == "plain" and "fallback" not in whole[2].how
    keep = torch.ones(3, 4)
    keep[2, 1] = 0
    want = gradient_pass(tiny, ids, keep=keep)
    right = replay.kept_heads
    monkeypatch.setattr(replay, "kept_heads", lambda k, width: right(k.roll(1, -1), width))
    got = gradient_pass(tiny, ids, keep=keep, prepared=prepared)
    assert "head-mask gradient differs" in got[2].how["fallback"]
    assert got[2].how["replay"] == "bridge"
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
def test_a_checked_gradient_pass_is_not_run_twice(tiny, ids, monkeypatch):
    """The self-check's own plain pass is the result: with a check at the whole model and one
    at the first mask that removes a head, three gradient passes run the plain replay three
    times a window, not five, and give what they gave when the check's pass was run again."""
    from blockscope.sweeps import replay, scoring
    from blockscope.sweeps.gradient import gradient_pass

    prepared = scoring.prepare(tiny, ids, heads=True, settings=RunSettings(engine="cached"))
    keep = torch.ones(3, 4)
    keep[1, 2] = 0
    calls, real = [], replay.masked_nll
    monkeypatch.setattr(replay, "masked_nll", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = [gradient_pass(tiny, ids, keep=k, prepared=prepared)[0] for k in (None, keep, keep)]
    assert len(calls) == 3 * len(model_windows(tiny, ids, None))
    assert torch.equal(got[1], got[2])  # the check's pass, then a pass of its own: the same
    hooked = gradient_pass(tiny, ids, keep=keep)[0]
    assert torch.allclose(got[1], hooked, rtol=REL, atol=REL * float(hooked.max()))


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
def test_one_prepared_clean_pass_serves_every_head_experiment(tiny, ids):
    """What `prune-heads` does: one `prepare`, handed to each experiment, gives each one's
    own numbers (the mean method's means included); importance from its clean passes equals
    the hooked model's; a `prepared` of another method is refused. Over windows only the
    mean method, whose means come from every window (the zero method's windows are held
    to the naive loop by the tests above)."""
    from blockscope.experiments.heads import prepare

    windows = len(model_windows(tiny, ids, 100)) > 1
    run = RunSettings(stride=100)
    importance, normalised = head_importance(tiny, ids, settings=run)  # the hooked model's
    for method in ("mean",) if windows else ("zero", "mean"):
        shared = prepare(tiny, ids, method=method, settings=run)
        kw = dict(method=method, settings=run)
        same(heads_sweep(tiny, ids, **kw), heads_sweep(tiny, ids, prepared=shared, **kw))
        got, got_normalised = head_importance(tiny, ids, prepared=shared, settings=run)
        # plain and hooked gradients agree as the self-check holds them: to 1e-5 of the largest
        assert torch.allclose(got, importance, rtol=REL, atol=REL * float(importance.max()))
        assert torch.allclose(got_normalised, normalised, rtol=REL, atol=REL)
        same(one_head_per_layer(tiny, ids, importance, **kw),
             one_head_per_layer(tiny, ids, importance, prepared=shared, **kw))
        curve = dict(order="gradient", step=0.3, importance=normalised, **kw)
        a = pruning_curve(tiny, ids, **curve)
        b = pruning_curve(tiny, ids, prepared=shared, **curve)
        assert a["heads_removed"].equals(b["heads_removed"])
        assert torch.allclose(torch.tensor(a["perplexity"].tolist()),
                              torch.tensor(b["perplexity"].tolist()), rtol=REL, atol=0)
    with pytest.raises(ValueError, match="another engine or method"):
        heads_sweep(tiny, ids, method="mean", settings=run,
                    prepared=prepare(tiny, ids, settings=run))


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
@pytest.mark.parametrize("slip", ["block fill", "heads"])
def test_a_sign_slip_in_an_entry_is_caught_by_the_variant_check(tiny, ids, slip, monkeypatch):
    """The identities the entries rely on all hold here; only what an entry writes is wrong
    (the mean fill subtracted, or a head's change with its sign flipped). The first variant
    of each kind is held to the hooked model, so the run falls back to the naive loop,
    says so, and gives the reference's numbers; without the slip it does not fall back."""
    from dataclasses import replace

    from blockscope.sweeps import entries, scoring

    sweep = ((lambda engine="cached": block_ablation(
                 tiny, ids, part="block", method="mean",
                 settings=RunSettings(stride=100, engine=engine))) if slip == "block fill" else
             (lambda engine="cached": heads_sweep(
                 tiny, ids, method="mean", settings=RunSettings(stride=100, engine=engine))))
    honest = sweep()
    assert "fallback" not in honest.attrs["engine"]
    naive = sweep(engine="naive")
    same(naive, honest)
    original = entries.start

    def slipped(model, lay, v, base=()):
        s = original(model, lay, v, base)
        if slip == "block fill" and s.kind == "block":
            k = s.layer - 1
            return replace(s, resid=lambda c, f=s.resid: 2 * c.pre[k] - f(c))  # pre - fill
        if slip == "heads" and s.kind == "heads":
            base = (lambda c: c.entering(s.layer)) if not s.mid else (
                lambda c: c.act("hook_resid_mid", s.layer))
            return replace(s, resid=lambda c, f=s.resid: 2 * base(c) - f(c))  # - delta
        return s

    monkeypatch.setattr(scoring, "start", slipped)
    caught = sweep()
    kind = "block" if slip == "block fill" else "heads"
    assert f"its {kind} entry" in caught.attrs["engine"]["fallback"]
    assert caught.attrs["engine"]["replay"] == "naive"
    same(naive, caught)


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # checks, not window arithmetic
@pytest.mark.parametrize("cls, patched", [
    ("Skip", lambda self, post, pre: 0.5 * (pre + post)),  # half the block's write
    ("Replace", lambda self, write, source=None: 0.3 * write),  # the write scaled, not removed
    ("ScaleHeads", lambda self, z, source=None: z * self.keep.to(z.dtype)[:, None] * 0.5
     + 0.5 * z),
])
def test_apply_is_the_one_statement_of_what_is_written(tiny, ids, cls, patched, monkeypatch):
    """Change an intervention's `apply` alone: the naive loop (its hooks) and the cached
    engine (its entries) both follow, equal to each other, the variant check content."""
    from blockscope import interventions

    def sweep(engine="cached"):
        run = RunSettings(stride=100, engine=engine)
        if cls == "ScaleHeads":
            return heads_sweep(tiny, ids, settings=run)
        return block_ablation(tiny, ids, part="block" if cls == "Skip" else "mlp",
                              settings=run)

    before = sweep()
    monkeypatch.setattr(getattr(interventions, cls), "apply", patched)
    naive, cached = sweep(engine="naive"), sweep()
    assert "fallback" not in cached.attrs["engine"]
    same(naive, cached)
    moved = (torch.tensor(cached["perplexity"].tolist()[1:])
             / torch.tensor(before["perplexity"].tolist()[1:]) - 1).abs()
    assert moved.max() > 1e-4  # the patch changed what the variants write


@pytest.mark.parametrize("ids", ["short"], indirect=True)  # one window
def test_a_new_metric_is_one_class_the_engine_reads_off_the_final_residual(tiny, ids):
    """A metric written here alone (each position's final-residual norm, and the argmax
    token) goes through the engine's one loop for variants entering at several blocks and
    mid-block, and equals the same metric of the hooked model's final residual with each
    intervention's own hooks."""
    from blockscope.interventions import applied, hooks, remove_write, skip_block
    from blockscope.model.arch import layout
    from blockscope.sweeps import steps
    from blockscope.sweeps.clean import clean_pass, kept_names
    from blockscope.sweeps.engine import run_group
    from blockscope.sweeps.entries import start
    from blockscope.sweeps.variant import Variant

    class NormAndTop:  # the whole of a new metric
        def from_final(self, model, x):  # (B, T, d_model) -> (B, 2, T)
            top = model.unembed(model.ln_final(x)).argmax(-1).double()
            return torch.stack([x.norm(dim=-1).double(), top], 1)

    lay, n = layout(tiny), tiny.cfg.n_layers
    w = model_windows(tiny, ids, 100)[0]
    clean = clean_pass(tiny, ids, w, kept_names(lay, n, z=False))
    edits = [skip_block(0), remove_write("attn", 1), remove_write("mlp", 2)]
    starts = [start(tiny, lay, Variant({}, (e,))) for e in edits]
    assert [s.kind for s in starts] == ["block", "attn", "mlp"]
    with torch.inference_mode():
        got = run_group(tiny, lay, clean, [(s.layer, s.mid, s.resid(clean)) for s in starts],
                        steps.plain_parts(tiny), metric=NormAndTop())
    for e, row in zip(edits, got, strict=True):
        kept = {}
        with torch.inference_mode(), applied(tiny, hooks((e,)) + [(
                "ln_final.hook_in", lambda act, hook=None: kept.update(x=act))]):
            tiny(ids[:, w.begin : w.end], return_type="logits")
        want = NormAndTop().from_final(tiny, kept["x"])[0]
        assert torch.allclose(row[0], want[0], rtol=REL, atol=0)
        assert (row[1] == want[1]).float().mean() > 0.95  # argmax: ties may flip
