"""Many prompt pairs (`experiments.pairs`, `attribute --pairs`, `circuit --pairs`): the
averages held to each pair run by itself (`attribute` for the estimates, `patch` for the
exact cells, `edges.rewired` for a circuit), the bootstrap to a loop over resamples written
here, the two built-in sets to what their definitions say, and the sharing of pairs across
processes to one process."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.errors import BadValue
from blockscope.experiments import attribute as attribute_exp
from blockscope.experiments import circuit as circuit_exp
from blockscope.experiments import pairs as px
from blockscope.experiments import patch as patch_exp
from blockscope.inputs.parallel import Comm
from blockscope.sweeps import edges

from ..conftest import result

TEXTS = [("The capital of France is", "The capital of Italy is", " Paris", " Rome"),
         ("The capital of Spain is", "The capital of Japan is", " Madrid", " Tokyo")]


@pytest.fixture(scope="module")
def items(tiny):
    out = []
    for clean, corrupted, target, contrast in TEXTS:
        pair = px.PromptPair(clean, corrupted, target, contrast)
        out += px.tokenized(tiny.tokenizer, [pair], "here", prepend_bos=True)
    return out


def test_the_average_is_each_pair_by_itself(tiny, items):
    """Estimates are the mean of `attribute` run on each pair; normalized the mean change
    over the mean gap; the checked cells' exact values the mean of `patch`'s cells; the
    interval holds the value."""
    sites = ["resid-pre", "z"]
    df, per_pair = attribute_exp.attribute_pairs(tiny, items, sites=sites, check=2, seed=1)
    alone = [attribute_exp.attribute(tiny, t.clean, t.corrupted, target=t.target,
                                     contrast=t.contrast, sites=sites, check=0)
             for t in items]
    patched = [patch_exp.patch(tiny, t.clean, t.corrupted, target=t.target,
                               contrast=t.contrast, sites=sites) for t in items]
    est = np.mean([a["estimate"] for a in alone], axis=0)
    gaps = [a.attrs["clean"] - a.attrs["corrupted"] for a in alone]
    scale = np.abs(est).max()
    np.testing.assert_allclose(df["estimate"], est, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(df["normalized"], est / np.mean(gaps), rtol=0,
                               atol=1e-6 * scale / abs(np.mean(gaps)))
    rows = (df["checked"] != "").to_numpy()
    want = np.mean([p["logit_diff"] for p in patched], axis=0)[rows]
    # another batch of variants than patch's: the same to float32 rounding
    np.testing.assert_allclose(df.loc[rows, "exact_logit_diff"], want, rtol=0, atol=1e-5)
    assert df.loc[~rows, "exact_logit_diff"].isna().all()
    live = df["ci_low"].notna()
    assert live.any()
    assert (df.loc[live, "ci_low"] <= df.loc[live, "normalized"] + 1e-12).all()
    assert (df.loc[live, "normalized"] <= df.loc[live, "ci_high"] + 1e-12).all()
    assert per_pair["clean_logit_diff"].tolist() == pytest.approx(
        [a.attrs["clean"] for a in alone], abs=1e-6)
    assert df.attrs["n_pairs"] == 2 and set(df.attrs["agreement"]) == set(sites)


def test_the_bootstrap_is_a_loop_over_resamples():
    """`ratio`'s interval (resample counts times the pairs, in chunks of cells) equals the
    ratio of means computed for each resample drawn, one by one."""
    rng = np.random.default_rng(5)
    changes, gaps = rng.normal(size=(7, 10)), rng.uniform(1, 2, size=7)
    value, lo, hi = px.ratio(changes, gaps, n_boot=300, seed=2, chunk=3)
    draws = np.random.default_rng(2).integers(0, 7, size=(300, 7))
    boot = np.array([changes[d].sum(0) / gaps[d].sum() for d in draws])
    np.testing.assert_allclose(value, changes.sum(0) / gaps.sum(), rtol=1e-12)
    np.testing.assert_allclose(lo, np.percentile(boot, 2.5, axis=0), rtol=1e-10)
    np.testing.assert_allclose(hi, np.percentile(boot, 97.5, axis=0), rtol=1e-10)
    one = px.ratio(changes[:1], gaps[:1])
    assert np.isnan(one[1]).all()  # one pair: no interval


def test_the_built_in_sets(tiny):
    """capitals: two capital facts of one length, the clean one's capital the target and
    the other's the contrast; ioi: the prompts differ at the subject's second mention
    only, the target the indirect object and the contrast the subject, names one token;
    every pair of a set one length, and the draw the seed's."""
    tok = tiny.tokenizer
    cap = px.capitals(tok, True)
    assert len(cap) > 10
    items = px.tokenized(tok, cap, "capitals", True)
    assert len({t.length for t in items}) == 1
    for p in cap:
        assert p.clean.startswith("The capital of ") and p.corrupted.startswith("The capital")
        assert p.target != p.contrast
    drawn = px.ioi(tok, True, 12, seed=4)
    assert drawn == px.ioi(tok, True, 12, seed=4) != px.ioi(tok, True, 12, seed=5)
    items = px.tokenized(tok, drawn, "ioi", True)
    assert len({t.length for t in items}) == 1
    for p, t in zip(drawn, items, strict=True):
        differ = (t.clean != t.corrupted)[0].nonzero().flatten().tolist()
        assert len(differ) == 1  # the subject's second mention
        s = tok.decode([int(t.clean[0, differ[0]])])
        assert s == p.contrast and p.clean.count(p.target.strip()) == 1
        assert p.clean.count(s.strip()) == 2 and p.corrupted.count(s.strip()) == 1


def test_circuit_over_pairs_is_each_pairs_rewired_run(tiny, items):
    """A circuit's curve over pairs: the edges ranked by the mean of each pair's own
    estimate, each size's metric the mean of each pair's rewired run, faithfulness over
    the mean gap; over one pair twice, the one pair's circuit."""
    curve, ranked = circuit_exp.circuit_pairs(tiny, items, method="atp")
    scores = [edges.scores(tiny, t.clean, t.corrupted, circuit_exp.metric_for(t.target,
                                                                              t.contrast))
              for t in items]
    g = scores[0].graph
    pairs = g.edges()
    mean = np.mean([[s.values[p] for p in pairs] for s in scores], axis=0)
    order = np.argsort(-np.abs(mean), kind="stable")
    assert [(r.writer, r.reader) for r in ranked.head(5).itertuples()] == [
        (g.writers[pairs[i][1]].name, g.readers[pairs[i][0]].name) for i in order[:5]]
    for n in (2, 10):
        keep = np.zeros_like(g.valid)
        for i in order[:n]:
            keep[pairs[i]] = True
        runs = [edges.rewired(tiny, t.clean, g, g.valid & ~keep, s.replacement,
                              circuit_exp.metric_for(t.target, t.contrast))
                for t, s in zip(items, scores, strict=True)]
        row = curve[curve["n_edges"] == n].iloc[0]
        base = np.mean([s.base for s in scores])
        gap = np.mean([s.source - s.base for s in scores])
        assert row["logit_diff"] == pytest.approx(np.mean(runs), abs=1e-5)
        assert row["faithfulness"] == pytest.approx((np.mean(runs) - base) / gap,
                                                    abs=1e-5 / abs(gap))
    one, _ = circuit_exp.circuit(tiny, items[0].clean, items[0].corrupted,
                                 target=items[0].target, contrast=items[0].contrast,
                                 method="atp")
    twice, _ = circuit_exp.circuit_pairs(tiny, [items[0], items[0]], method="atp")
    np.testing.assert_allclose(twice["faithfulness"], one["faithfulness"], rtol=0,
                               atol=1e-12)
    np.testing.assert_allclose(twice["ci_low"], twice["ci_high"], rtol=0, atol=1e-9)


class Rank(Comm):
    """One of two processes, the other's results handed in: what torchrun's gather gives."""

    def __init__(self, rank: int, other: list | None = None):
        super().__init__(rank=rank, size=2)
        object.__setattr__(self, "other", other)

    def gather(self, obj) -> list:
        self.__dict__["mine"] = obj
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def test_pairs_are_shared_across_processes_as_one_process_runs_them():
    """Pair k runs on rank k mod 2 only, and both ranks gather every result in order."""
    ran = {0: [], 1: []}

    def run_on(rank):
        return lambda x: ran[rank].append(x) or x * 10

    one = Rank(1, other=[])
    px.over(list(range(5)), run_on(1), one)
    zero = Rank(0, other=one.mine)
    got = px.over(list(range(5)), run_on(0), zero)
    assert got == [0, 10, 20, 30, 40] == px.over(list(range(5)), lambda x: x * 10)
    assert ran == {0: [0, 2, 4], 1: [1, 3]}


def test_the_commands_over_a_file(tiny_dir, tmp_path):
    """attribute --pairs FILE writes the averaged cells and one row per pair; circuit
    --pairs its curve with intervals; a malformed line is refused, naming it, before the
    model loads (the model named does not exist); pairs of two lengths are refused for
    position sites, not for heads."""
    path = tmp_path / "two.jsonl"
    rows = [dict(zip(("clean", "corrupted", "target", "contrast"), t, strict=True))
            for t in TEXTS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["attribute", "--pairs", str(path), "--site", "z",
                                   "--check", "1", "--no-plot", "--model", str(tiny_dir),
                                   "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    assert "2 pairs (two)" in res.stdout and "95% CI" in res.stdout
    per_pair = result(out, "attribute-tiny-gpt2-two-pairs.csv").read_text().splitlines()
    assert len(per_pair) == 3 and per_pair[1].startswith("0,1,The capital of France is")
    meta = json.loads(result(out, "attribute-tiny-gpt2-two.json").read_text())
    assert meta["n_pairs"] == 2 and meta["used"][1]["target"] == " Madrid"
    res = CliRunner().invoke(app, ["circuit", "--pairs", str(path), "--method", "atp",
                                   "--no-plot", "--model", str(tiny_dir),
                                   "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    head = result(out, "circuit-tiny-gpt2-two.csv").read_text().splitlines()[0]
    assert head.split(",")[4:6] == ["ci_low", "ci_high"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{\"clean\": \n", encoding="utf-8")
    res = CliRunner().invoke(app, ["attribute", "--pairs", str(bad), "--model",
                                   str(tmp_path / "no-such-model")])
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: --pairs {bad}, line 2: not JSON (Expecting value)"
    mixed = tmp_path / "mixed.jsonl"
    longer = {**rows[1], "clean": "Its capital, Spain, is", "corrupted": "Its capital, Japan, is"}
    mixed.write_text(json.dumps(rows[0]) + "\n" + json.dumps(longer) + "\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["attribute", "--pairs", str(mixed), "--model",
                                   str(tiny_dir), "--out-dir", str(out)])
    assert res.exit_code == 2
    assert "do not line up across them" in res.stderr and "Traceback" not in res.stderr


def test_tokens_of_a_pair_are_checked_naming_its_line(tiny):
    pair = px.PromptPair("The capital of France is", "The capital of Italy is not", " Paris",
                         " Rome", line=3)
    with pytest.raises(BadValue, match="^pairs f.jsonl, line 3: the clean prompt is 6 "
                       "tokens, the corrupted 7"):
        px.tokenized(tiny.tokenizer, [pair], "f.jsonl", True)
    pair = px.PromptPair("The capital of France is", "The capital of Italy is", " Paris Paris",
                         line=4)
    with pytest.raises(BadValue, match="^pairs f.jsonl, line 4: target ' Paris Paris' is "
                       "2 tokens"):
        px.tokenized(tiny.tokenizer, [pair], "f.jsonl", True)
