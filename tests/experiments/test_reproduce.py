"""`reproduce`: the article's figures beside measurements, offline and with a model."""

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import blockscope as bs
from blockscope.cli import app
from blockscope.experiments.reproduce.figures import (
    Figure,
    compare,
    gpt2_shape_model,
    load_reference,
    offline_measures,
)

from ..builders import tiny_reference
from ..conftest import REPO, result

ARTICLE = REPO / "src" / "blockscope" / "data" / "article.toml"
PNG = b"\x89PNG\r\n\x1a\n"


def test_rounding_tolerances():
    assert Figure("x", "x", "22.2", "k").tolerance == pytest.approx(0.05)
    assert Figure("x", "x", "1,684", "k").value == 1684
    assert Figure("x", "x", "1.81", "k", unit="billion").tolerance == pytest.approx(5e6)
    cut = Figure("x", "x", "173.9", "k", unit="billion", cut=True)
    assert cut.within(173.96e9) and not cut.within(174.0e9) and not cut.within(173.89e9)
    assert Figure("x", "x", "2.236", "k").within(2.2361) is True
    assert Figure("x", "x", "2.236", "k").within(2.2366) is False


def test_the_offline_figures_reproduce_exactly():
    settings, figures = load_reference(ARTICLE)
    measured = offline_measures(settings, figures, gpt2_shape_model())
    table = compare(figures, measured, {})
    offline = table[table["experiment"].isin(["params", "layernorm", "shapes"])]
    assert len(offline) >= 25
    assert (offline["status"] == "matches").all(), offline[offline["status"] != "matches"]
    gpt2_total = offline[offline["figure"] == "GPT-2 small: total"].iloc[0]
    assert gpt2_total["measured"] == 124_439_808 and gpt2_total["difference"] == 0
    n_tokens = table[table["figure"] == "tokens in the Alice passage"].iloc[0]
    assert n_tokens["measured"] == 469 and n_tokens["status"] == "matches"


def test_needs_the_model_rows_name_the_command():
    settings, figures = load_reference(ARTICLE)
    table = compare(figures, offline_measures(settings, figures), {"ablate": "blockscope ablate"})
    ablate = table[table["experiment"] == "ablate"]
    waiting = ablate[ablate["measured"].isna()]
    assert len(waiting) == 5 and set(waiting["status"]) == {"needs the model"}  # + tokens
    assert set(waiting["command"]) == {"blockscope ablate"}


def test_reproduce_on_a_tiny_checkpoint_writes_report_tables_and_pictures(tiny_dir, tmp_path):
    ref = tiny_reference(tmp_path)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["reproduce", "--model", str(tiny_dir), "--reference",
                                   str(ref), "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    # one line per experiment (reproduce once ran 16 minutes after one line), a bar inside
    lines = res.stderr.splitlines()
    stages = [line for line in lines if line.startswith("[")]
    assert [s[: len(f"[{i}/7]")] for i, s in enumerate(stages, 1)] == [
        f"[{i}/7]" for i in range(1, 8)]
    said = [s.split("] ", 1)[1] for s in stages]
    five = ["ablation: skipping each block, and each removal's split",
            "residual norms: BOS x raw/processed weights", "pruning heads (gradient order)",
            "head roles: previous-token, duplicate-token, induction",
            "the MLP section: lens, attribution, neurons and their keys, causal trace"]
    assert [s for s in said if s in five] == five
    bar = [line for line in lines if line.startswith("pruning heads (gradient order): ")]
    assert bar and not any("about 0 s left" in line for line in bar), lines
    table = pd.read_csv(result(out, "reproduce-tiny-gpt2.csv"))
    face = bs.reproduce(str(tiny_dir), reference=str(ref))  # the Python face: the same CSV
    written = out / f"{face.stem}-{face.digest}.csv"
    assert face.table.to_csv(index=False).encode() == written.read_bytes()
    status = dict(zip(table["figure"] + "|" + table["variant"].fillna(""), table["status"],
                      strict=True))
    assert status["GPT-2 small: total|"] == "matches" and status["std|"] == "matches"
    assert status["baseline perplexity|"] == "differs"  # a random tiny model is no GPT-2
    blk6 = "norm after the article's block 6 (block 5)|"
    assert status[blk6] == "not in this model"  # it has 3 blocks
    resid = table[(table["experiment"] == "resid-norm") & table["measured"].notna()]
    assert sorted(resid["variant"]) == sorted(["no BOS, raw weights", "BOS, raw weights",
                                               "no BOS, processed weights",
                                               "BOS, processed weights"])
    assert set(resid["status"]) == {"differs"}
    report = (result(out, "reproduce-tiny-gpt2.md")).read_text()
    assert "| baseline perplexity |" in report and "differs" in report
    assert "Head pruning" in report
    assert "## What heads do" in report
    # not GPT-2 small: its own top 3 induction heads, never GPT-2's indices read on it
    assert "The reference heads' indices name GPT-2 small's heads" in report
    induction = [line.split(" | ") for line in report.splitlines()
                 if line.startswith("| induction | ")]
    assert [row[3] for row in induction] == ["1", "2", "3"]
    assert all(int(row[1].split(".")[0]) < 3 and "references: 2.1, 5.1" in row[4]
               for row in induction)
    mlp = report.split("## The MLP")[1].split("\n## ")[0]
    assert "> values push the stream toward Paris" in mlp
    assert sum(line.startswith("| ") for line in mlp.splitlines()) == 2 + 6  # head, rule, 6
    assert "' Paris' enters the top 10 at" in mlp
    causal = [line for line in mlp.splitlines() if line.startswith("| Causally")]
    assert len(causal) == 2 and all(line.endswith("| NOT shown |") for line in causal)
    assert "## Pre-norm and post-norm" in report and "> post-norm needs a warm-up" in report
    assert "| post-norm needs a learning-rate warm-up at large learning rates |" in report
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 9  # params, ablation, 4 residual-norm variants, the lens, norm x 2
    assert all(p.read_bytes().startswith(PNG) for p in pngs)
    assert all(f"]({p.name})" in report for p in pngs)
    meta = json.loads((result(out, "reproduce-tiny-gpt2.json")).read_text())
    assert meta["model_loaded"] is True and meta["prune_headline"]
    assert len(meta["norm_placement"]) == 5 and len(meta["head_roles"]) == 3
    assert len(meta["mlp"]) == 6
    # attribution, not the article's: what `attribute --check all` and `circuit` report
    from blockscope.experiments import attribute
    from blockscope.experiments.logit_lens import target_id
    from blockscope.inputs.text import tokenize
    from blockscope.sweeps import edges

    model = bs.load(str(tiny_dir))
    ids = [tokenize(model.tokenizer, t, prepend_bos=True)
           for t in ("The capital of France is", "The capital of Italy is")]
    answers = [target_id(model.tokenizer, t) for t in (" Paris", " Rome")]
    df = attribute.attribute(model, *ids, target=answers[0], contrast=answers[1],
                             sites=["mlp-out", "z"], check=None)
    trust = {r["site"]: r for r in meta["attribution"]["trust"]}
    assert set(trust) == {"mlp-out", "z"}
    for site, rec in df.attrs["agreement"].items():
        assert rec["spearman"] == rec["spearman"]  # a number: the corruption moves them
        assert trust[site]["spearman"] == pytest.approx(rec["spearman"])
        assert trust[site]["cells"] == rec["checked"]
    found = meta["attribution"]["circuit"]  # circuit's own numbers: tests/experiments/
    assert found["total_edges"] == edges.graph(model.cfg, False).n_edges  # test_circuit.py
    assert found["smallest"] is None or 1 <= found["smallest"] <= found["total_edges"]
    section = report.split("## Where attribution can be trusted")[1]
    assert "| mlp-out |" in section and "| z |" in section and "blockscope circuit" in section


def test_reproduce_offline_without_the_model(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["reproduce", "--model", "gpt2", "--reference", str(ARTICLE),
                                   "--no-norm-placement", "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    assert "without the model" in res.stderr
    table = pd.read_csv(result(out, "reproduce-gpt2.csv"))
    needs = table[table["status"] == "needs the model"]
    assert set(needs["experiment"]) == {"ablate", "resid-norm"}
    assert needs["command"].str.startswith("blockscope ").all()
    assert (table[table["experiment"] == "params"]["status"] == "matches").all()
    report = (result(out, "reproduce-gpt2.md")).read_text()
    assert "needs the model" in report and "blockscope ablate --model gpt2" in report
    assert "Needs the model: `blockscope head-roles" in report


def test_bad_reference(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[figure]]\nexperiment = "x"\nname = "y"\narticle = "abc"\nmeasure = "z"\n')
    res = CliRunner().invoke(app, ["reproduce", "--reference", str(bad), "--out-dir",
                                   str(tmp_path / "o")])
    assert res.exit_code == 2 and "malformed" in res.stderr
    res = CliRunner().invoke(app, ["reproduce", "--reference", str(tmp_path / "none.toml")])
    assert res.exit_code == 2 and "no such file" in res.stderr


def test_the_reference_ships_with_the_package(tmp_path, monkeypatch):
    """There is one copy of the article's figures, in the package: found from any folder
    (no checkout around it), with its passage resolved beside it."""
    from blockscope.experiments.reproduce import figures as rp

    monkeypatch.chdir(tmp_path)
    assert not (REPO / "experiments" / "article.toml").exists()
    settings, figures = rp.load_reference()
    assert figures and Path(settings["ablate"]["text"]).is_file()
    assert rp.packaged_reference().is_file()


def test_one_experiments_figures_share_their_decimals():
    """The ablate rows were 22.184 beside 1,684.30: two digits finer than each figure is
    printed. One experiment's figures in one unit now share the finest of them."""
    from blockscope.experiments.reproduce.figures import Figure, compare

    figures = [Figure("ablate", "baseline perplexity", "22.2", "ablate.baseline"),
               Figure("ablate", "first block removed", "1,684", "ablate.block1"),
               Figure("ablate", "tokens", "469", "ablate.n_tokens"),
               Figure("params", "total", "124.4", "params.total", unit="million")]
    table = compare(figures, {"ablate.baseline": 22.18437, "ablate.block1": 1684.29731,
                              "ablate.n_tokens": 469.0, "params.total": 124_439_808.0}, {})
    assert list(table["measured_text"]) == ["22.184", "1,684.297", "469", "124.440 million"]
    assert list(table["difference_text"][:2]) == ["-0.016", "+0.297"]


def test_norm_placement_numbers_read_alike():
    """24 beside 32.4: three significant figures, trailing zeros kept."""
    from blockscope.results.render import sig3

    assert [sig3(x) for x in (24, 32.4, 0.00123, 5, 999.9, 1234.5)] == [
        "24.0", "32.4", "0.00123", "5.00", "1,000", "1,234"]


def test_the_mlp_claims_read_their_measurements():
    """Each MLP-section claim says what its frames hold, and is shown only when they bear it
    out: synthetic frames whose answers are known."""
    from blockscope.experiments.reproduce import mlp as m

    lens = pd.DataFrame({"point": ["embeddings", "block 0", "block 1", "block 2", "block 3"],
                         "layer": [None, 0, 1, 2, 3], "target_rank": [900, 40, 8, 1, 1],
                         "target_prob": [0.0, 0.01, 0.1, 0.5, 0.7]})
    late = m._written_late(lens, 4, " Paris")
    assert "top 10 at block 1, the top 1 at block 2 of 4" in late["measured"]
    assert late["shown"] is False  # block 1 (the second) of 4 is not past the middle
    assert m._written_late(lens.assign(target_rank=[900, 40, 30, 8, 1]), 4, " P")["shown"]
    attrs = pd.DataFrame({"level": "block", "layer": [None, 0, 0, 1, 1, None],
                          "half": ["embed", "attn", "mlp", "attn", "mlp", "bias"],
                          "contribution": [5.0, 1.0, 2.0, 0.5, 0.25, 9.0]})
    attrs.attrs["logit"] = 17.75
    last = m._last_block(attrs, 2)  # block 0: 3.0, block 1: 0.75 (embed and bias left out)
    assert last["shown"] is False and "largest is block 0's (+3.00)" in last["measured"]
    keys = pd.DataFrame({"layer": [0] * 4 + [5] * 4, "neuron": [7] * 4 + [9] * 4,
                         "trigger": ["the", "the", "the", "a", "x", "y", "z", "x"]})
    found = m._keys(keys, 6, "alice.txt")
    assert "75% of the time in the lowest third" in found["measured"] and found["shown"]
    assert "50% in the upper third" in found["measured"]


def test_the_causal_mlp_claims_read_the_trace():
    """ROME's two findings are shown only where the trace bears them out: synthetic traces
    whose peaks are known (subject tokens 1-2 of 5, 4 blocks)."""
    from blockscope.experiments.reproduce.mlp import causal_claims

    def traced(mlp_at, attn_at, p_clean=0.8, p_corrupted=0.1, effect=0.5):
        rows = [{"kind": k, "layer": j, "position": t, "token": "x", "indirect_effect":
                 effect if (j, t) == at else 0.01}
                for k, at in (("mlp", mlp_at), ("attn", attn_at))
                for j in range(4) for t in range(5)]
        df = pd.DataFrame(rows)
        df.attrs.update(p_clean=p_clean, p_corrupted=p_corrupted)
        return df

    shown = lambda df: [c["shown"] for c in causal_claims(df, (1, 3), 4, 5)]  # noqa: E731
    assert shown(traced((1, 2), (3, 4))) == [True, True]
    assert shown(traced((1, 1), (3, 4))) == [False, True]  # the subject's first token
    assert shown(traced((2, 2), (3, 4))) == [False, True]  # block 2 of 4: not the first half
    assert shown(traced((1, 2), (0, 4))) == [True, False]  # attention before the MLP peak
    assert shown(traced((1, 2), (3, 4), effect=0.3)) == [False, False]  # under half of 0.7
    assert shown(traced((1, 2), (3, 4), p_clean=0.15)) == [False, False]  # noise took 0.05


def test_the_one_correction_reading_reads_the_split():
    """Shown only where the median middle block's total is within x1.5 of its own write."""
    from blockscope.experiments.reproduce.sections import one_correction

    def split(totals, directs):
        df = pd.DataFrame({"total": totals, "direct": directs})
        return df.assign(self_repair=(df["direct"] - df["total"]) / df["direct"])

    claim = one_correction(split([-5, -1.0, -0.9, -1.1, 2], [-1, -1, -1, -1, 1]))
    assert claim[-1] is True and "x1.00" in claim[2] and "self-repair 0%" in claim[2]
    claim = one_correction(split([-5, -0.4, -0.5, -0.3, 2], [-1, -1, -1, -1, 1]))
    assert claim[-1] is False and "self-repair 60%" in claim[2]  # later blocks give back
    assert one_correction(split([-5, -2.0, -1.6, 2], [-1, -1, -1, 1]))[-1] is False  # x1.8
