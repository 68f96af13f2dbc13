"""The command line end to end, with Typer's CliRunner, on the tiny checkpoint."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from blockscope.cli import app

from ..conftest import ALICE, result

ABLATE_COLUMNS = ["variant", "layer", "part", "method", "n_scored", "nll", "perplexity", "delta",
                  "ratio", "kl", "block_influence", "angular_distance", "ci_low", "ci_high",
                  "delta_ci_low", "delta_ci_high"]
SIDECAR_KEYS = {"command", "model", "text", "n_tokens", "n_scored", "prepend_bos", "dtype",
                "device", "part", "method", "window", "versions", "date", "wall_time_s"}


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(app, [str(a) for a in args])

    return invoke


def test_ablate_prints_table_and_writes_csv_and_json(run, tiny_dir, tmp_path):
    res = run("ablate", "--text", ALICE, "--model", tiny_dir, "--max-tokens", 100,
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "baseline" in res.stdout and "perplexity" in res.stdout
    csv = result(tmp_path, "ablate-tiny-gpt2-alice.csv")
    df = pd.read_csv(csv)
    assert list(df.columns) == ABLATE_COLUMNS
    assert list(df["variant"]) == ["baseline", "ablated", "ablated", "ablated"]
    assert (df["n_scored"] == 100).all()  # BOS + 100 tokens: every text token predicted
    meta = json.loads(csv.with_suffix(".json").read_text())
    assert SIDECAR_KEYS <= meta.keys()
    assert meta["n_tokens"] == 100 and meta["prepend_bos"] is True
    assert meta["text"]["sha256"] and meta["model"]["local"] is True
    assert {"torch", "transformer-lens", "transformers", "blockscope"} <= meta["versions"].keys()
    assert meta["engine"] == "cached" and set(meta["spearman_with_delta"]) == {
        "block_influence", "angular_distance"}
    assert meta["replay"] == "plain" and meta["batch_size"] == 6  # GPT-2 blocks on the CPU
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [csv.name, csv.with_suffix(".json").name, csv.with_suffix(".png").name,
             csv.with_suffix(".html").name, "plotly.min.js"])  # the page and its script


def test_quiet_prints_only_the_csv_path(run, tiny_dir, tmp_path):
    res = run("ablate", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 20, "--part", "mlp",
              "--method", "mean", "--no-prepend-bos", "--out-dir", tmp_path, "--quiet")
    assert res.exit_code == 0, res.output
    path = result(tmp_path, "ablate-tiny-gpt2-alice-mlp-mean.csv")
    assert res.stdout.strip() == str(path)
    df = pd.read_csv(path)
    assert (df["n_scored"] == 19).all() and set(df["part"][1:]) == {"mlp"}


def test_version_and_help(run):
    assert run("--version").stdout.startswith("blockscope ")
    res = run("ablate", "--help")
    assert res.exit_code == 0 and "--prepend-bos" in res.stdout


def bad_inputs(tmp_path, tiny_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02abc")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    notckpt = tmp_path / "notckpt"
    notckpt.mkdir()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in tiny_dir.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 3] if f.suffix == ".safetensors"
                                         else data)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    ok = ["--model", tiny_dir]
    return {
        "missing text": ["--text", tmp_path / "nope.txt", *ok],
        "empty text": ["--text", empty, *ok],
        "binary text": ["--text", binary, *ok],
        "non-UTF-8 text": ["--text", latin, *ok],
        "max-tokens 1": ["--text", ALICE, "--max-tokens", 1, *ok],
        "not a checkpoint": ["--text", ALICE, "--model", notckpt],
        "truncated weights": ["--text", ALICE, "--model", truncated],
        "unknown model offline": ["--text", ALICE, "--model", "no-such-org/no-such-model"],
        "missing device": ["--text", ALICE, "--device", "cuda:7", *ok],
        "unwritable out-dir": ["--text", ALICE, *ok, "--out-dir", blocker / "sub"],
        "stride too long": ["--text", ALICE, *ok, "--stride", 500],
    }


CASES = ["missing text", "empty text", "binary text", "non-UTF-8 text", "max-tokens 1",
         "not a checkpoint", "truncated weights", "unknown model offline", "missing device",
         "unwritable out-dir", "stride too long"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_line_no_traceback_nothing_written(run, tiny_dir, tmp_path, case):
    args = bad_inputs(tmp_path, tiny_dir)[case]
    out_dir = tmp_path / "results"
    if "--out-dir" not in args:
        args += ["--out-dir", out_dir]
    res = run("ablate", *args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    assert not out_dir.exists()


def test_ctrl_c_during_sweep_writes_nothing(run, tiny_dir, tmp_path, monkeypatch):
    import blockscope.experiments.ablate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(blockscope.experiments.ablate, "block_ablation", interrupted)
    res = run("ablate", "-t", ALICE, "-m", tiny_dir, "--out-dir", tmp_path / "r")
    assert res.exit_code == 130
    assert "nothing was written" in res.stderr
    assert not (tmp_path / "r").exists()


def test_interrupted_write_leaves_no_partial_files(tmp_path, monkeypatch):
    import os

    from blockscope.results import files as results

    calls = []
    real = os.replace

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(results.os, "replace", flaky)
    with pytest.raises(KeyboardInterrupt):
        results.write_outputs(tmp_path, {"a.csv": pd.DataFrame({"x": [1]}), "a.json": {"k": 1}})
    # the sidecar landed whole, the CSV (renamed last) not at all, and no temp file remains
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def one_error_line(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_resid_norm_variants_are_labelled(run, tiny_dir, tmp_path):
    res = run("resid-norm", "The capital of France is", "-m", tiny_dir, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "block 2" in res.stdout and "embeddings" in res.stdout
    raw = pd.read_csv(result(tmp_path, "resid-norm-tiny-gpt2.csv"))
    assert list(raw.columns) == ["after", "layer", "hook", "position", "token", "norm",
                                 "ratio_to_embed"]
    meta = json.loads((result(tmp_path, "resid-norm-tiny-gpt2.json")).read_text())
    assert meta["prepend_bos"] is False and meta["model"]["weights"] == "raw"
    assert meta["tokens"] == [464, 3139, 286, 4881, 318]
    res = run("resid-norm", "The capital of France is", "-m", tiny_dir, "--processed",
              "--prepend-bos", "--out-dir", tmp_path, "-q")
    assert res.exit_code == 0, res.output
    path = result(tmp_path, "resid-norm-tiny-gpt2-processed-bos.csv")
    assert res.stdout.strip() == str(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["prepend_bos"] is True and meta["model"]["weights"] == "processed"
    assert not pd.read_csv(path)["norm"].equals(raw["norm"])


def test_resid_norm_reads_text_file_and_all_positions(run, tiny_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    res = run("resid-norm", "--text", prompt, "-m", tiny_dir, "--all-positions",
              "--out-dir", tmp_path / "r", "-q")
    assert res.exit_code == 0, res.output
    assert sorted(set(pd.read_csv(res.stdout.strip())["position"])) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("args, message", [
    ([], "argument or with --text"),
    (["hi", "--text", ALICE], "not both"),
    (["The capital", "--position", "9"], "outside"),
])
def test_resid_norm_bad_input(run, tiny_dir, tmp_path, args, message):
    res = run("resid-norm", *args, "-m", tiny_dir, "--out-dir", tmp_path / "r")
    assert message in one_error_line(res)
    assert not (tmp_path / "r").exists()


def test_shapes_command(run, tiny_dir, tmp_path):
    res = run("shapes", "The capital of France is", "-m", tiny_dir, "--block", 2,
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(result(tmp_path, "shapes-tiny-gpt2-block2.csv"))
    assert df["matches"].all() and df.loc[0, "shape"] == "5 x 64"
    assert "config" in res.stdout and "5×4×16" in res.stdout  # each shape whole, checked
    assert "block 3" not in one_error_line(run("shapes", "Hi there", "-m", tiny_dir,
                                               "--block", 3, "--out-dir", tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_params_command(run, tmp_path):
    res = run("params", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "124,439,808" in res.stdout and "7,087,872" in res.stdout
    df = pd.read_csv(result(tmp_path, "params-gpt2.csv"))
    assert df.set_index("component").loc["total", "parameters"] == 124_439_808
    res = run("params", "-m", "gpt2", "-m", "llama-3.1-8b", "--n-heads", 32, "-q",
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(res.stdout.strip())
    assert set(df["model"]) == {"gpt2", "llama-3.1-8b"}
    assert "must divide" in one_error_line(run("params", "--n-heads", 5, "--out-dir", tmp_path))


def test_layernorm_command(run, tmp_path):
    res = run("layernorm", 2, 4, 6, 8, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "[-1.342, -0.447, 0.447, 1.342]" in res.stdout and "2.236" in res.stdout
    df = pd.read_csv(result(tmp_path, "layernorm-2_4_6_8.csv"))
    assert list(df.columns) == ["step", "index", "value"]
    res = run("layernorm", 1, 2, "--gain", "1,x", "--out-dir", tmp_path / "r")
    assert "--gain" in one_error_line(res)


def test_prune_heads_writes_heads_curve_and_sidecar(run, tiny_dir, tmp_path):
    res = run("prune-heads", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 40, "--step", 0.5,
              "--order", "gradient", "--order", "random", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "heads (" in res.stdout and "pruning curve, random order" in res.stdout
    per_head = pd.read_csv(result(tmp_path, "prune-heads-tiny-gpt2-alice.csv"))
    assert list(per_head.columns) == ["layer", "head", "method", "ablation_perplexity", "delta",
                                      "ratio", "kl", "gradient_importance",
                                      "normalized_importance",
                                      "rank", "ci_low", "ci_high", "delta_ci_low",
                                      "delta_ci_high"]
    assert len(per_head) == 12 and sorted(per_head["rank"]) == list(range(1, 13))
    curve = pd.read_csv(result(tmp_path, "prune-heads-tiny-gpt2-alice-curve.csv"))
    assert set(curve["order"]) == {"gradient", "random"}
    assert {"step", "heads_removed", "share_removed", "perplexity", "delta", "kl"} <= set(
        curve.columns)
    assert curve["kl"].notna().all() and (curve.loc[curve["step"] > 0, "kl"] > 0).all()
    one = pd.read_csv(result(tmp_path, "prune-heads-tiny-gpt2-alice-one-head.csv"))
    assert len(one) == 4
    meta = json.loads((result(tmp_path, "prune-heads-tiny-gpt2-alice.json")).read_text())
    assert meta["tolerance"] == 0.05 and set(meta["headline"]) == {"gradient", "random"}
    assert meta["replay"] == "plain" and meta["batch_size"] == 6


@pytest.mark.parametrize("args, message", [
    (["--layers", "3"], "--layers"),
    (["--heads", "0,4"], "--heads"),
    (["--layers", "a"], "--layers"),
    (["--order", "ablation", "--heads", "1"], "drop --layers/--heads"),
    (["--step", "2.5"], "--step"),
])
def test_prune_heads_bad_filters(run, tiny_dir, tmp_path, args, message):
    res = run("prune-heads", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 10, *args,
              "--out-dir", tmp_path / "r")
    assert message in one_error_line(res)
    assert not (tmp_path / "r").exists()


def test_prune_blocks_writes_curves_plot_and_sidecar(run, tiny_dir, tmp_path):
    res = run("prune-blocks", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 260, "--order",
              "greedy", "--order", "angular", "--max-removed", 2, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "greedy order" in res.stdout and "not a cumulative" in res.stdout
    curve = pd.read_csv(result(tmp_path, "prune-blocks-tiny-gpt2-alice.csv"),
                        keep_default_na=False)
    assert list(curve.columns) == ["order", "step", "removed", "n_removed", "share_params",
                                   "n_scored", "nll", "perplexity", "delta", "ratio", "kl",
                                   "ci_low", "ci_high", "delta_ci_low", "delta_ci_high"]
    assert list(curve["n_removed"]) == [0, 1, 2, 0, 1, 2]
    assert curve.loc[0, "removed"] == "" and curve.loc[1:, "ci_low"].ne("").all()
    assert result(tmp_path, "prune-blocks-tiny-gpt2-alice.png").exists()
    meta = json.loads(result(tmp_path, "prune-blocks-tiny-gpt2-alice.json").read_text())
    assert set(meta["headline"]) == {"greedy", "angular"} and meta["max_removed"] == 2
    assert meta["replay"] == "plain" and len(meta["block_metrics"]["angular"]) == 3


def test_rearrange_writes_table_plot_and_sidecar(run, tiny_dir, tmp_path):
    res = run("rearrange", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 40, "--swap", "0,2",
              "--parallel", "1:2", "--sweep", "adjacent-swaps", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "swap 0,2" in res.stdout and "(1+2)" in res.stdout
    df = pd.read_csv(result(tmp_path, "rearrange-tiny-gpt2-alice.csv"))
    assert list(df["arrangement"]) == ["none", "swap 0,2", "parallel 1:2", "swap 0,1",
                                       "swap 1,2"]
    assert list(df["order"]) == ["0 1 2", "2 1 0", "0 (1+2)", "1 0 2", "0 2 1"]
    assert df.loc[0, "kl"] == 0 and (df.loc[1:, "kl"] > 0).all()
    assert result(tmp_path, "rearrange-tiny-gpt2-alice.png").exists()
    meta = json.loads(result(tmp_path, "rearrange-tiny-gpt2-alice.json").read_text())
    assert meta["replay"] == "plain" and "clean model" in meta["kl"]


@pytest.mark.parametrize("args, message", [
    ([], "give at least one of --swap"),
    (["--swap", "1,5"], "--swap 1,5: blocks run from 0 to 2"),
    (["--reverse", "2:1"], "--reverse 2:1: the first block must come before"),
    (["--repeat", "0x1"], "--repeat runs a block 2 or more times"),
])
def test_rearrange_bad_input(run, tiny_dir, tmp_path, args, message):
    res = run("rearrange", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 10, *args,
              "--out-dir", tmp_path / "r")
    assert message in one_error_line(res)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, message", [
    (["--max-removed", "4"], "--max-removed"),
    (["--max-removed", "0"], "--max-removed"),
    (["--tolerance", "-1"], "--tolerance"),
])
def test_prune_blocks_bad_input(run, tiny_dir, tmp_path, args, message):
    res = run("prune-blocks", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 10, *args,
              "--out-dir", tmp_path / "r")
    assert message in one_error_line(res)
    assert not (tmp_path / "r").exists()


def test_help_does_not_import_torch():
    """`blockscope --help` stays instant: the heavy imports live inside the commands."""
    import subprocess
    import sys

    code = "import sys, blockscope.cli; from blockscope.allocator import tune_allocator; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ablate_naive_engine_is_recorded(run, tiny_dir, tmp_path):
    res = run("ablate", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 30, "--engine", "naive",
              "--no-plot", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    meta = json.loads((result(tmp_path, "ablate-tiny-gpt2-alice.json")).read_text())
    assert meta["engine"] == "naive" and meta["batch_size"] == 1 and meta["replay"] == "naive"
    assert "fallback" not in meta


@pytest.mark.parametrize("name", ["[draft]a.txt", "a[/]b.txt", "[bold]x[/bold].txt"])
def test_messages_print_paths_literally(run, tmp_path, name):
    res = run("ablate", "--text", tmp_path / name, "--out-dir", tmp_path)
    assert res.exit_code == 2
    assert f"{tmp_path / name}: no such file" in " ".join(res.stderr.split())
    assert "Traceback" not in res.output


def test_a_fallback_is_said_and_recorded(run, tiny_dir, tmp_path, monkeypatch):
    from blockscope.sweeps import steps

    monkeypatch.setattr(steps, "block_step", lambda m, c, j, x, p: 1.001 * x)
    monkeypatch.setattr(steps, "plain_parts", lambda model: None)
    res = run("ablate", "-t", ALICE, "-m", tiny_dir, "--max-tokens", 30, "--no-plot",
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "warning: the cached engine's self-check failed" in " ".join(res.stderr.split())
    meta = json.loads((result(tmp_path, "ablate-tiny-gpt2-alice.json")).read_text())
    assert "naive loop" in meta["fallback"] and meta["replay"] == "naive"


def test_reproduce_stops_on_a_broken_checkpoint(run, tiny_dir, tmp_path):
    """Only a model that is unreachable (offline, not cached) lets reproduce go on."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors at all")
    res = run("reproduce", "--model", broken, "--out-dir", tmp_path / "out", "--no-prune")
    assert res.exit_code == 2, res.output
    assert "cannot" in res.stderr and not (tmp_path / "out").exists()


def test_resid_norm_says_a_parallel_block_has_no_mid_point(run, tmp_path):
    from ..builders import save_checkpoint

    path = save_checkpoint("gptj", tmp_path / "gptj")
    res = run("resid-norm", "The capital of France is", "-m", path, "--no-plot",
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "no point between them" in " ".join(res.stdout.split())
    meta = json.loads((result(tmp_path, "resid-norm-gptj.json")).read_text())
    assert meta["family"] == "GPT-J" and "parallel" in meta["mid_points"]
    df = pd.read_csv(result(tmp_path, "resid-norm-gptj.csv"))
    assert len(df) == 1 + 2 and not df["hook"].str.contains("mid").any()  # 2 blocks


def test_runs_with_different_settings_never_share_a_file_and_reruns_say_so(run, tiny_dir,
                                                                        tmp_path):
    base = ["layernorm", "--out-dir", tmp_path]
    assert run(*base, "2", "4", "6", "8").exit_code == 0
    assert run(*base, "--eps", "0.1", "2", "4", "6", "8").exit_code == 0
    csvs = sorted(tmp_path.glob("layernorm-2_4_6_8-*.csv"))
    assert len(csvs) == 2  # the eps differs: two digests
    again = run(*base, "2", "4", "6", "8")
    assert again.exit_code == 0 and "replaced the results of an earlier run" in again.stderr
    assert sorted(tmp_path.glob("layernorm-2_4_6_8-*.csv")) == csvs
    meta = json.loads(csvs[0].with_suffix(".json").read_text())
    assert csvs[0].stem.endswith(meta["settings_digest"])


def test_no_overwrite_refuses_before_any_work(run, tiny_dir, tmp_path, monkeypatch):
    args = ["ablate", "--text", ALICE, "--model", tiny_dir, "--max-tokens", 30, "--no-plot",
            "--out-dir", tmp_path]
    assert run(*args).exit_code == 0
    from blockscope.api import common

    monkeypatch.setattr(common, "load", lambda *a: pytest.fail("loaded the model"))
    res = run(*args, "--no-overwrite")
    assert res.exit_code == 2 and "--no-overwrite: results of these settings exist" in res.stderr
    monkeypatch.undo()
    other = run(*args[:-2], "--out-dir", tmp_path, "--max-tokens", 31, "--no-overwrite")
    assert other.exit_code == 0, other.output  # other settings: a file of their own
    assert len(list(tmp_path.glob("ablate-tiny-gpt2-alice-*.csv"))) == 2
