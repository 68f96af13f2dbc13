"""Corpora on the command line: ablate/prune-heads/resid-norm --dataset, bad input, and
torchrun with two processes on the CPU."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app

from ..builders import paragraphs, write_jsonl
from ..conftest import ALICE, result


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = paragraphs()
    texts = [x[i:i + 220] for x in p for i in (0, 220) if x[i:i + 220].strip()][:10]
    return write_jsonl(tmp_path_factory.mktemp("cli-corpus") / "wiki.jsonl", texts + [""])


def one_error_line(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def test_ablate_resample_records_its_pairing(run, tiny_dir, tmp_path, corpus):
    res = run("ablate", "--dataset", corpus, "--model", tiny_dir, "--n-docs", 4, "--part",
              "mlp", "--method", "resample", "--seed", 2, "--no-plot", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    csv = result(tmp_path, "ablate-tiny-gpt2-wiki-mlp-resample.csv")
    assert set(pd.read_csv(csv)["method"]) == {"none", "resample"}
    pairs = json.loads(csv.with_suffix(".json").read_text())["resample"]
    assert pairs["seed"] == 2 and sorted(pairs["partner_of"]) == ["0", "1", "2", "3"]
    assert all(int(k) != v for k, v in pairs["partner_of"].items())


@pytest.mark.parametrize("args, message", [
    (["--text", ALICE, "--part", "mlp"], "give a corpus with --dataset"),
    (["--dataset", "CORPUS", "--part", "block"], "give --part attn or mlp"),
])
def test_resample_is_refused_before_loading(run, tiny_dir, tmp_path, corpus, args, message):
    args = [str(corpus) if a == "CORPUS" else a for a in args]
    res = run("ablate", *args, "--model", tiny_dir, "--method", "resample",
              "--out-dir", tmp_path / "r")
    assert message in one_error_line(res)
    assert not (tmp_path / "r").exists()


def test_ablate_dataset_table_csv_sidecar_png(run, tiny_dir, tmp_path, corpus):
    res = run("ablate", "--dataset", corpus, "--model", tiny_dir, "--n-tokens", 300,
              "--bootstrap", 200, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "[95% CI" in res.stdout and "rank stability: Spearman" in res.stdout
    csv = result(tmp_path, "ablate-tiny-gpt2-wiki.csv")
    df = pd.read_csv(csv)
    assert {"ci_low", "ci_high", "delta_ci_low", "delta_ci_high"} <= set(df.columns)
    assert (df["ci_low"] <= df["perplexity"]).all() and (df["perplexity"] <= df["ci_high"]).all()
    assert (df["n_scored"] == 300).all()
    meta = json.loads(csv.with_suffix(".json").read_text())
    data = meta["dataset"]
    assert data["source"] == str(corpus) and data["split"] == "train" and data["fingerprint"]
    assert data["n_tokens"] == 300 and data["skipped_empty"] == 0  # the budget ran out first
    assert len(data["tokens_sha256"]) == 64 and meta["world_size"] == 1
    assert meta["uncertainty"]["unit"] == "document" and meta["uncertainty"]["bootstrap"] == 200
    assert -1 <= meta["uncertainty"]["rank_stability"] <= 1
    assert csv.with_suffix(".png").is_file()


def test_text_run_says_it_resamples_chunks(run, tiny_dir, tmp_path):
    res = run("ablate", "--model", tiny_dir, "--max-tokens", 300, "--out-dir", tmp_path,
              "--bootstrap", 100)
    assert res.exit_code == 0, res.output
    meta = json.loads(result(tmp_path, "ablate-tiny-gpt2-alice.json").read_text())
    assert meta["uncertainty"]["unit"] == "chunk" and "128-token" in meta["uncertainty"]["note"]
    assert meta["text"]["path"].endswith("alice.txt")


def test_prune_heads_and_resid_norm_take_a_dataset(run, tiny_dir, tmp_path, corpus):
    res = run("prune-heads", "--dataset", corpus, "--model", tiny_dir, "--n-docs", 4,
              "--step", 6, "--bootstrap", 50, "--no-plot", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    heads = pd.read_csv(result(tmp_path, "prune-heads-tiny-gpt2-wiki.csv"))
    assert heads["ci_low"].notna().all() and len(heads) == 12
    curve = pd.read_csv(result(tmp_path, "prune-heads-tiny-gpt2-wiki-curve.csv"))
    assert curve["delta_ci_high"].notna().all()
    res = run("resid-norm", "--dataset", corpus, "--model", tiny_dir, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(result(tmp_path, "resid-norm-tiny-gpt2-wiki.csv"))
    assert list(df.columns[:7]) == ["after", "layer", "hook", "n_tokens", "median", "p10", "p90"]
    assert (df["p10"] <= df["median"]).all() and (df["median"] <= df["p90"]).all()


@pytest.mark.parametrize("args, message", [
    (["--dataset", "no-such-org/no-such-corpus"], "cannot load it"),
    (["--dataset", "{corpus}", "--column", "body"], "no column 'body'"),
    (["--dataset", "{corpus}", "--split", "validation"], "one split, train"),
    (["--dataset", "{empty}"], "no non-empty documents"),
    (["--dataset", "{corpus}", "--text", ALICE], "not both"),
    (["--dataset", "{corpus}", "--max-tokens", 50],
     "--max-tokens cuts a --text; with --dataset give --n-tokens"),
    (["--n-tokens", 50], "--n-tokens goes with --dataset"),
    (["--dataset", "{corpus}", "--n-docs", 0], "--n-docs must be at least 1"),
])
def test_bad_corpus_input_one_line_nothing_written(run, tiny_dir, tmp_path, corpus, args,
                                                    message):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", " "])
    args = [str(a).format(corpus=corpus, empty=empty) for a in args]
    out_dir = tmp_path / "results"
    line = one_error_line(run("ablate", "--model", tiny_dir, "--out-dir", out_dir, *args))
    assert message in line
    assert not out_dir.exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_malformed_json_lines_corpus_is_refused_before_loading(run, tmp_path, suffix):
    """The file is read before the model loads (the model named here does not exist, so a
    load would fail differently), and the refusal names the file and the line."""
    bad = tmp_path / f"broken{suffix}"
    bad.write_text('{"text": "one"}\n\n{"text": "two"\n{"text": "three"}\n', encoding="utf-8")
    line = one_error_line(run("ablate", "--dataset", bad, "--model", tmp_path / "no-model",
                              "--out-dir", tmp_path / "r"))
    assert f"--dataset {bad}: line 3 is not JSON" in line
    assert not (tmp_path / "r").exists()


def torchrun(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "blockscope", *[str(a) for a in args]],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_torchrun_prune_heads_equals_one_process(tiny_dir, tmp_path, corpus):
    """Documents split across two gloo ranks: the sweeps' per-document sums, the gradient
    importance's sum and the curves join to the single-process CSVs, byte for byte: every
    rank computes each document as one process does (the same code path, chosen by the
    corpus, not by the rank's share), and the per-document parts are added in corpus order
    in float64 (`parallel.total`), so no rounding can differ (torchrun is tested here once:
    ablate's ranks join through the same units.gather_units and parallel.total); rank 0
    alone writes."""
    args = ["--dataset", corpus, "--model", tiny_dir, "--n-docs", 3, "--step", 4,
            "--bootstrap", 50, "--no-plot", "-q"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun runs each rank: the same kernels, the same floats
    try:
        one = CliRunner().invoke(app, ["prune-heads", *map(str, args),
                                       "--out-dir", str(tmp_path / "1")])
    finally:
        torch.set_num_threads(threads)
    assert one.exit_code == 0, one.output
    two = torchrun("prune-heads", *args, "--out-dir", tmp_path / "2")
    assert two.returncode == 0, two.stderr[-3000:]
    for name in ("prune-heads-tiny-gpt2-wiki.csv", "prune-heads-tiny-gpt2-wiki-curve.csv",
                 "prune-heads-tiny-gpt2-wiki-one-head.csv"):
        a, b = (result(tmp_path / d, name).read_text() for d in ("1", "2"))
        assert a == b, name
    sidecar = result(tmp_path / "2", "prune-heads-tiny-gpt2-wiki.json")
    assert json.loads(sidecar.read_text())["world_size"] == 2
    # three CSVs, one sidecar, the page and its script: rank 0 only
    assert len(list((tmp_path / "2").iterdir())) == 6


def test_a_failing_rank_says_so_and_writes_nothing(tiny_dir, tmp_path, corpus, monkeypatch):
    """Rank 1 of a two-process run breaks mid-sweep: it says so in one line naming its rank,
    exits 1 (which fails torchrun's whole run) and nothing is written. In one process with
    rank 1's environment: torchrun itself is launched once, for the equality above."""
    from blockscope.inputs import parallel
    from blockscope.sweeps import scoring

    def broken(*a, **k):
        raise RuntimeError("injected failure on rank 1")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(parallel, "from_env", lambda device: parallel.Comm(rank=1, size=2))
    monkeypatch.setattr(parallel, "finish", lambda: None)
    monkeypatch.setattr(scoring, "_score", broken)
    res = CliRunner().invoke(app, ["ablate", "--dataset", str(corpus), "--model", str(tiny_dir),
                                   "--n-tokens", "300", "--out-dir", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert "rank 1 of this torchrun (nothing was written)" in res.stderr
    assert "injected failure on rank 1" in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_refusal_under_torchrun_is_torchruns_root_cause(tmp_path, monkeypatch):
    """`torchrun ... params`: the refusal is written where torchrun's failure summary reads it
    (TORCHELASTIC_ERROR_FILE), so its "Root Cause" is blockscope's one line, not a pointer to
    the elastic docs. In one process with a rank's environment, as above."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    res = CliRunner().invoke(app, ["params", "--out-dir", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert res.stderr == ""  # rank 1 leaves stderr to rank 0
    message = json.loads(error_file.read_text())["message"]
    line = "error: params runs in one process; under torchrun only ablate, attribute, " \
           "circuit, knockout, prune-heads, resid-norm, trace do"
    assert message["message"] == message["extraInfo"]["py_callstack"] == line
    assert not (tmp_path / "out").exists()
