"""`bs.sweep` with interventions and a metric written here, held to a plain transformers
forward with hooks written here (tests/references.py), with both engines, on GPT-2, Llama
(grouped-query) and GPT-NeoX (parallel blocks, partial rotary); a wrong cached form falls
back loudly; docs/extending.md's examples run as written."""

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

import blockscope as bs
from blockscope.errors import BadValue
from blockscope.model.loading import load_model, spec_for

from ..builders import save_checkpoint
from ..references import hf_capture, hf_modules, hf_run, layers

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
TOKENS = torch.tensor([[50256, 464, 3139, 286, 4881, 318, 257, 1402]])  # BOS The capital ...
SOURCE = torch.tensor([[50256, 464, 3139, 286, 8031, 318, 257, 1402]])  # ... Italy ...
WORDS = (6342, 10598, 11307, 14708, 4881)  # a set of token ids the metric averages over


@dataclass(frozen=True)
class AddVector:
    vector: torch.Tensor

    def apply(self, base, source):
        return base + self.vector


@dataclass(frozen=True)
class Scale:
    factor: float

    def apply(self, base, source):
        return base * self.factor


@dataclass(frozen=True)
class Sized:
    """An intervention that checks itself against the model's config (`check(cfg)`)."""

    n: int

    def apply(self, base, source):
        return base + torch.ones(self.n)

    def check(self, cfg):
        return None if self.n == cfg.d_model else f"the vector has {self.n} values"


@dataclass(frozen=True)
class Toward:
    """base + share * (source - base): part of the way to the source run's value."""

    share: float

    def apply(self, base, source):
        return base + self.share * (source - base)


@dataclass(frozen=True)
class MeanLogProb:
    tokens: tuple
    position: int = -1
    name = "mean_log_prob"

    def __call__(self, logits):
        return logits.double().log_softmax(-1)[:, list(self.tokens)].mean(-1)


def mean_log_prob(logits) -> float:
    return float(logits.double().log_softmax(-1)[0, list(WORDS)].mean())


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt_neox"])
def pair(request, tmp_path_factory):
    d = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = load_model(spec_for(str(d), device="cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    return model, hf


def variants(model):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(model.cfg.d_model, generator=g)
    steer = bs.Edit(bs.Site("hook_resid_pre", 1), AddVector(v))
    half = bs.Edit(bs.Site("attn.hook_z", 0, head=1), Scale(0.5))
    toward = bs.Edit(bs.Site("hook_resid_pre", 0, positions=4), Toward(0.5), "italy")
    return [bs.Variant("steer", [steer]), bs.Variant("half", [half]),
            bs.Variant("toward", [toward]), bs.Variant({"variant": "all three"},
                                                         (steer, half, toward))], v


def references(model, hf, v, position: int = -1) -> dict:
    """Each variant's metric, at `position`, from the plain transformers model with hooks
    written here."""
    mods = hf_modules(hf)
    d_head = model.cfg.d_head

    def steer(t):
        return t + v

    def half(t):
        t[..., d_head:2 * d_head] *= 0.5  # head 1's columns of the output projection's input
        return t

    italy = hf_capture(hf, SOURCE, mods["layers"][0], "pre")

    def toward(t):
        t[:, 4] += 0.5 * (italy[:, 4] - t[:, 4])
        return t

    hooks = {"steer": [(mods["layers"][1], "pre", steer)], "half": [(mods["o"][0], "pre", half)],
             "toward": [(mods["layers"][0], "pre", toward)]}
    hooks["all three"] = [*hooks["steer"], *hooks["half"], *hooks["toward"]]
    return {name: mean_log_prob(hf_run(hf, TOKENS, h, position)) for name, h in hooks.items()}


@pytest.mark.parametrize("engine", ["cached", "naive"])
def test_sweep_with_a_users_interventions_and_metric_equals_hf_hooks(pair, engine):
    model, hf = pair
    vs, v = variants(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bs.EngineFallback)
        result = bs.sweep(model, vs, MeanLogProb(WORDS), base=bs.Run(TOKENS),
                          sources={"italy": bs.Run(SOURCE)}, engine=engine)
    assert result.meta["how"]["engine"] == engine
    assert list(result.table.columns) == ["variant", "mean_log_prob"]
    base = mean_log_prob(hf_run(hf, TOKENS, []))
    # float32 logits: a few ulps of their size through 2 blocks and the log-softmax
    tol = 1e-5 * (1 + abs(base))
    assert abs(result.meta["base"]["mean_log_prob"] - base) <= tol
    assert abs(result.meta["sources"]["italy"]["mean_log_prob"]
               - mean_log_prob(hf_run(hf, SOURCE, []))) <= tol
    want = references(model, hf, v)
    for row in result.table.itertuples():
        assert abs(want[row.variant] - base) > 100 * tol, row  # each edit is seen
        assert abs(row.mean_log_prob - want[row.variant]) <= tol, (row, want[row.variant])
    work = result.meta["how"]["block_positions"]
    assert work <= len(vs) * model.cfg.n_layers * TOKENS.shape[1]


@pytest.mark.parametrize("engine", ["cached", "naive"])
def test_a_metric_at_a_chosen_position_equals_hf_hooks(pair, engine):
    """The metric at position 3: the steer and the head change it; "toward" edits position
    4 alone, which the model's causality keeps from position 3 (its value is the base
    run's), and "all three" starts at position 0 (the steer) and reads position 3."""
    model, hf = pair
    vs, v = variants(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bs.EngineFallback)
        result = bs.sweep(model, vs, MeanLogProb(WORDS, position=3), base=bs.Run(TOKENS),
                          sources={"italy": bs.Run(SOURCE)}, engine=engine)
    assert result.meta["metric"]["position"] == 3
    base = mean_log_prob(hf_run(hf, TOKENS, [], 3))
    tol = 1e-5 * (1 + abs(base))
    assert abs(result.meta["base"]["mean_log_prob"] - base) <= tol
    assert abs(result.meta["sources"]["italy"]["mean_log_prob"]
               - mean_log_prob(hf_run(hf, SOURCE, [], 3))) <= tol
    assert abs(base - mean_log_prob(hf_run(hf, TOKENS, []))) > 100 * tol  # not the last's
    want = references(model, hf, v, 3)
    assert want["toward"] == pytest.approx(base, abs=tol)
    for row in result.table.itertuples():
        assert abs(row.mean_log_prob - want[row.variant]) <= tol, (row, want[row.variant])
    same = bs.sweep(model, vs[:1], bs.TargetLogProb(WORDS[0], position=-5), base=bs.Run(TOKENS),
                    engine=engine)  # -5 of 8 tokens is position 3
    steer = [(hf_modules(hf)["layers"][1], "pre", lambda t: t + v)]
    at3 = float(hf_run(hf, TOKENS, steer, 3).log_softmax(-1)[0, WORDS[0]])
    assert abs(same.table["log_prob"][0] - at3) <= tol
    with pytest.raises(BadValue, match="position 8 is outside the run's 8 tokens"):
        bs.sweep(model, vs, MeanLogProb(WORDS, position=8), base=bs.Run(TOKENS),
                 sources={"italy": bs.Run(SOURCE)}, engine=engine)


def test_a_wrong_cached_form_falls_back_loudly_to_the_naive_loop(pair, monkeypatch):
    """An edit written wrongly where the engine resumes a variant part-way along the
    sequence (offset > 0: the cached path only) is caught by the self-check."""
    from blockscope.interventions.interchange import Edit

    model, hf = pair
    right = Edit.write

    def wrong(self, act, first, samples, offset, sources, own=None):
        right(self, act, first, samples, offset, sources, own)
        if offset > 0:
            act[first:first + samples] *= 1.5

    monkeypatch.setattr(Edit, "write", wrong)
    _, v = variants(model)
    edit = bs.Edit(bs.Site("hook_resid_pre", 1, positions=(3, 4)), AddVector(v))
    with pytest.warns(bs.EngineFallback, match="self-check failed"):
        result = bs.sweep(model, [bs.Variant("steer late", [edit])], MeanLogProb(WORDS),
                          base=bs.Run(TOKENS))
    how = result.meta["how"]
    assert how["engine"] == "naive" and "every variant was run by the naive loop" in how[
        "fallback"]

    def steer(t):
        t[:, 3:5] += v
        return t

    want = mean_log_prob(hf_run(hf, TOKENS, [(hf_modules(hf)["layers"][1], "pre", steer)]))
    assert abs(result.table.mean_log_prob[0] - want) <= 1e-5 * (1 + abs(want))


def test_sweep_refuses_what_it_cannot_run(tiny):
    one = [bs.Variant("x", [bs.Edit(bs.Site("hook_resid_pre", 1), Scale(0.5))])]
    metric = bs.TargetLogProb(11)
    cases = [
        ([bs.Variant("x", [bs.Edit(bs.Site("hook_resid_pre", 9), Scale(0.5))])], {},
         "layer 9 is outside 0..2"),
        ([bs.Variant("x", [bs.Edit(bs.Site("hook_resid_pre", 1, 40), Scale(0.5))])], {},
         "positions must be within 0..7"),
        ([bs.Variant("x", [bs.Edit(bs.Site("attn.hook_z", 1, head=4), Scale(0.5))])], {},
         "head 4 is outside 0..3"),
        ([bs.Variant("x", [bs.scale_heads(1, torch.ones(3))])], {},
         "scale_heads' keep is (3,); the model has 4 heads"),
        ([bs.Variant("x", [bs.scale_neurons(1, torch.tensor([2, tiny.cfg.d_mlp]))])], {},
         f"neurons must be within 0..{tiny.cfg.d_mlp - 1}"),
        ([bs.Variant("x", [bs.Edit(bs.Site("hook_resid_pre", 1), Sized(tiny.cfg.d_model + 1))])],
         {}, f"variant {{'variant': 'x'}}: the vector has {tiny.cfg.d_model + 1} values"),
        ([bs.Variant("x", [Scale(0.5)])], {}, "edits here are bs.Edit"),
        ([bs.Variant("x", [bs.Edit(bs.Site("hook_resid_pre", 1), object())])], {},
         "has no apply"),
        ([], {}, "variants is empty"),
        (one, {"other": bs.Run(TOKENS[:, :5])}, "source run 'other' is 5 tokens"),
        (one, {"engine": "fast"}, "engine must be one of"),
    ]
    for vs, extra, message in cases:
        sources = {k: r for k, r in extra.items() if isinstance(r, bs.Run)}
        options = {k: r for k, r in extra.items() if not isinstance(r, bs.Run)}
        with pytest.raises(BadValue, match=re.escape(message)):
            bs.sweep(tiny, vs, metric, base=bs.Run(TOKENS), sources=sources, **options)
    with pytest.raises(ValueError, match="`head` goes with"):
        bs.Site("hook_resid_pre", 1, head=0)


def test_sweep_reads_a_string_as_the_commands_do_and_names_its_files(tiny, tmp_path):
    from blockscope.inputs.text import tokenize

    edit = bs.Edit(bs.Site("hook_resid_pre", 1), Scale(0.5))
    text = "The capital of France is"
    a = bs.sweep(tiny, [bs.Variant("half", [edit])], bs.TargetLogProb(11), base=bs.Run(text))
    ids = tokenize(tiny.tokenizer, text, prepend_bos=True)
    b = bs.sweep(tiny, [bs.Variant("half", [edit])], bs.TargetLogProb(11), base=bs.Run(ids))
    assert a.digest == b.digest and a.table.equals(b.table)
    assert a.meta["tokens"] == ids.shape[1]
    other = bs.Edit(bs.Site("hook_resid_pre", 1), Scale(0.25))
    c = bs.sweep(tiny, [bs.Variant("half", [other])], bs.TargetLogProb(11), base=bs.Run(ids))
    assert c.digest != a.digest  # the intervention's fields are in the digest
    names = sorted(p.name for p in a.save(tmp_path))
    assert names == ["plotly.min.js", f"sweep-tiny-gpt2-{a.digest}.csv",
                     f"sweep-tiny-gpt2-{a.digest}.html", f"sweep-tiny-gpt2-{a.digest}.json"]


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)[1:]


def test_the_extending_docs_examples_run_as_written(tmp_path_factory, monkeypatch, capsys):
    """Each worked example of docs/extending.md, on a tiny Llama (smollm2-135m's family) of
    10 blocks in place of smollm2-135m, holds a row per variant, on the cached engine, with
    no fallback."""
    # 10 blocks: the steering example writes at block 8
    d = save_checkpoint("llama", tmp_path_factory.mktemp("llama") / "m",
                        num_hidden_layers=10)
    model = load_model(spec_for(str(d), device="cpu"))
    monkeypatch.setattr(bs, "load", lambda name: model)
    code = examples()
    assert len(code) == 3
    rows = [4, model.cfg.n_layers * model.cfg.n_heads, model.cfg.n_layers]
    for block, n in zip(code, rows, strict=True):
        assert 'bs.load("smollm2-135m")' in block
        scope: dict = {"__name__": "example"}
        with warnings.catch_warnings():
            warnings.simplefilter("error", bs.EngineFallback)
            exec(compile(block, str(DOC), "exec"), scope)
        result = scope["result"]
        assert len(result.table) == n and result.meta["how"]["engine"] == "cached"
        assert result.table.iloc[:, -1].notna().all()
    assert "coefficient" in capsys.readouterr().out


def test_a_family_the_cached_engine_cannot_run_warns_and_gives_the_naive_numbers(
        tmp_path_factory):
    """GPT-J has no plain replay: bs.sweep says so (why_naive) with the same warning, and its
    numbers are the naive loop's, held here to the plain HF model with a hook."""
    d = save_checkpoint("gptj", tmp_path_factory.mktemp("gptj") / "m")
    model = load_model(spec_for(str(d), device="cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    v = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(2))
    steer = bs.Variant("steer", [bs.Edit(bs.Site("hook_resid_pre", 1), AddVector(v))])
    with pytest.warns(bs.EngineFallback, match="no plain replay"):
        result = bs.sweep(model, [steer], MeanLogProb(WORDS), base=bs.Run(TOKENS))
    how = result.meta["how"]
    assert how["engine"] == "naive" and "why_naive" in how and "fallback" not in how
    want = mean_log_prob(hf_run(hf, TOKENS, [(layers(hf)[1], "pre", lambda t: t + v)]))
    assert abs(result.table.mean_log_prob[0] - want) <= 1e-5 * (1 + abs(want))


def test_the_removals_are_edits_that_bs_sweep_runs_as_hf_hooks_do(pair):
    """`bs.scale_heads`, `bs.remove_write` and `bs.skip_block` (which reads its own run's
    block input) run on the cached resume, the first of each kind checked against the
    naive loop, and on the naive loop; each equals plain transformers with hooks written
    here."""
    model, hf = pair
    mods, d_head = hf_modules(hf), model.cfg.d_head
    keep = torch.ones(model.cfg.n_heads)
    keep[1] = 0
    vs = [bs.Variant("head 0.1", [bs.scale_heads(0, keep)]),
          bs.Variant("mlp 1", [bs.remove_write("mlp", 1)]),
          bs.Variant("skip 1", [bs.skip_block(1)]),
          bs.Variant("skip 0 at 5..", [bs.Edit(bs.Site("hook_resid_post", 0, positions=(5, 6, 7)),
                                                bs.Patch(), bs.Site("hook_resid_pre", 0,
                                                                    positions=(5, 6, 7)))])]
    runs = {}
    for engine in ("cached", "naive"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", bs.EngineFallback)
            runs[engine] = bs.sweep(model, vs, MeanLogProb(WORDS), base=bs.Run(TOKENS),
                                    engine=engine)
        assert runs[engine].meta["how"]["engine"] == engine
    work = runs["cached"].meta["how"]["block_positions"]
    assert work < runs["cached"].meta["how"]["naive_block_positions"]  # resumed, not rerun

    def head(t):
        t[..., d_head:2 * d_head] = 0  # head 1's columns of the output projection's input
        return t

    received = {}

    def stash(t):
        received["x"] = t
        return t

    def late(t):  # block 0's output at positions 5.. := its input there
        t[:, 5:] = received["x"][:, 5:]
        return t

    want = {"head 0.1": [(mods["o"][0], "pre", head)],
            "mlp 1": [(mods["mlp"][1], "out", torch.zeros_like)],
            "skip 1": [(mods["layers"][1], "pre", stash),
                       (mods["layers"][1], "out", lambda t: received["x"])],
            "skip 0 at 5..": [(mods["layers"][0], "pre", stash),
                              (mods["layers"][0], "out", late)]}
    base = mean_log_prob(hf_run(hf, TOKENS, []))
    tol = 1e-5 * (1 + abs(base))  # as above
    for row in [*runs["cached"].table.itertuples(), *runs["naive"].table.itertuples()]:
        value = mean_log_prob(hf_run(hf, TOKENS, want[row.variant]))
        assert abs(value - base) > 10 * tol, row  # each removal is seen
        assert abs(row.mean_log_prob - value) <= tol, (row, value)
