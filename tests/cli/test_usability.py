"""Using the command line: prompt files, early and right errors, files, progress, help,
and tables and help that fit the terminal."""

import io
import json
import os
import stat
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from blockscope.api import common as cli_common
from blockscope.cli import app
from blockscope.errors import BlockscopeError

from ..conftest import ALICE, result


@pytest.fixture
def run():
    def invoke(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    return invoke


def one_line(res, message):
    assert res.exit_code == 2, res.output
    assert message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_prompt_file_loses_bom_and_trailing_newline(run, tiny_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("\ufeffThe capital of France is\n".encode())
    res = run("resid-norm", "--text", prompt, "--model", tiny_dir, "--out-dir", tmp_path / "o",
              "--no-plot")
    assert res.exit_code == 0, res.output
    meta = json.loads(result(tmp_path / "o", "resid-norm-tiny-gpt2.json").read_text())
    assert meta["tokens"] == [464, 3139, 286, 4881, 318]
    assert meta["text"]["stripped"] == ["byte-order mark", "trailing newline"]


def test_whitespace_tokens_are_visible(tiny):
    from blockscope.inputs.text import token_text, visible

    def token_label(tokenizer, i):
        return visible(token_text(tokenizer, i))

    newline = tiny.tokenizer.encode("\n", add_special_tokens=False)[0]
    space_word = tiny.tokenizer.encode(" capital", add_special_tokens=False)[0]
    assert token_label(tiny.tokenizer, newline) == "\\n"
    assert token_label(tiny.tokenizer, space_word) == "␣capital"


@pytest.mark.parametrize("args, message", [
    (["--eps", "0", "1", "2"], "--eps must be a positive number"),
    (["--eps", "-1e-5", "1", "2"], "--eps must be a positive number"),
    (["1", "nan"], "nan or inf"),
    (["--gain", "inf", "1", "2"], "nan or inf"),
])
def test_layernorm_refuses_non_finite_input_and_bad_eps(run, tmp_path, args, message):
    one_line(run("layernorm", "--out-dir", tmp_path, *args), message)
    assert not list(tmp_path.iterdir())


def test_sidecars_are_standard_json(tmp_path):
    import pandas as pd

    from blockscope.results.files import write_outputs

    write_outputs(tmp_path, {"a.json": {"x": float("nan"), "y": [float("inf"), 1.0]},
                             "a.csv": pd.DataFrame({"v": [1]})})
    text = (tmp_path / "a.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"x": None, "y": [None, 1.0]}


def test_prompt_longer_than_the_context_is_refused_up_front(run, tiny_dir, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 300)
    for command in ("resid-norm", "shapes"):
        one_line(run(command, "--text", long, "--model", tiny_dir, "--out-dir", tmp_path / "o"),
                 "tokens, the model's context is 128")


def test_checkpoint_without_tokenizer_files(run, tmp_path):
    from blockscope.model.toy import save_gpt2_checkpoint

    path = save_gpt2_checkpoint(tmp_path / "notok", n_layer=1, n_embd=32, n_head=2,
                                n_positions=32)
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt",
                                                         "special_tokens_map.json"):
            f.unlink()
    one_line(run("ablate", "--model", path, "--text", ALICE, "--out-dir", tmp_path / "o"),
             "no tokenizer files")


@pytest.mark.parametrize("args, message", [
    (["prune-heads", "--tolerance", "-1"], "--tolerance must be"),
    (["prune-heads", "--layers", "7"], "--layers 7 is out of range: 0 to 2"),
    (["prune-heads", "--heads", "4"], "--heads 4 is out of range: 0 to 3"),
    (["prune-heads", "--step", "200"], "is more than the model's 12 heads"),
    (["ablate", "--stride", "0"], "--stride must be at least 1"),
    (["ablate", "--stride", "999"], "longer than the model's context"),
    (["shapes", "Hello there", "--block", "9"], "--block must be between 0 and 2"),
    # what needs only the tokenizer: refused before TransformerLens is imported
    (["resid-norm", "The capital", "--position", "99"], "--position 99 is outside the 2"),
    (["resid-norm", "The capital", "--position", "2", "--prepend-bos"], None),
    (["attention", "Hello there", "--layer", "9"], "--layer 9 is out of range: 0 to 2"),
    (["attention", "Hello there", "--layer", "0", "--head", "4"], "--head 4 is out of"),
    (["shapes", "word " * 300], "301 tokens, the model's context is 128"),
])
def test_options_are_checked_against_the_config_before_the_load(run, tiny_dir, tmp_path,
                                                                 no_load, args, message):
    extra = [] if args[0] in ("shapes", "resid-norm", "attention") else ["--text", ALICE]
    if message is None:  # in range with BOS: past the checks, to the load (which fails here)
        assert "the model was loaded" in run(*args, "--model", tiny_dir, "--out-dir",
                                             tmp_path / "o").stderr
        return
    res = run(*args, *extra, "--model", tiny_dir, "--out-dir", tmp_path / "o")
    one_line(res, message)
    assert not (tmp_path / "o").exists()


FACT = {"prompt": "The capital of France is", "subject": "France", "target": " Paris"}


@pytest.mark.parametrize("args, message", [
    # the text alone: an empty token
    (["patch", "--clean", "A b", "--corrupted", "A c", "--target", ""], "--target is empty"),
    (["patch", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--contrast", ""],
     "--contrast is empty"),
    (["logit-lens", "Hello there", "--target", ""], "--target is empty"),
    (["mlp-memory", "Hello there", "--contrast", ""], "--contrast is empty"),
    (["trace", "The capital of France is", "--subject", "France", "--target", ""],
     "--target is empty"),
    # the tokenizer alone: a subject not in its prompt, a target of several tokens
    (["trace", "The capital of France is", "--subject", "Germany"],
     "--subject 'Germany' is not in the prompt 'The capital of France is'"),
    (["knockout", "The capital of France is", "--subject", "Germany"],
     "--subject 'Germany' is not in the prompt 'The capital of France is'"),
    (["trace", "The capital of France is", "--subject", "France", "--target", " Parisian x"],
     "--target ' Parisian x' is 3 tokens"),
    (["patch", "--clean", "A b", "--corrupted", "A c", "--target", " x y"],
     "--target ' x y' is 2 tokens"),
    (["logit-lens", "Hello there", "--contrast", " a b"], "--contrast ' a b' is 2 tokens"),
    # attribute: its options, then the prompts' token counts from the tokenizer
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--check", "-1"],
     "--check must be a count of 0 or more, or all (got -1)"),
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--check", "some"],
     "--check must be a count or all (got some)"),
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--method", "ig",
      "--ig-steps", "0"], "--ig-steps must be between 1 and 1,000 (got 0)"),
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--site", "o"],
     "--site must be among"),
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--granularity",
      "edge", "--site", "z"], "--site goes with node granularity"),
    (["attribute", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--granularity",
      "edge", "--method", "atp-star"], "--method atp-star scores nodes"),
    (["circuit", "--clean", "A b", "--corrupted", "A c", "--target", " x", "--method",
      "atp-star"], "--method atp-star scores nodes; edges are ranked by atp or ig"),
    (["circuit", "--clean", "The capital of France is", "--corrupted",
      "The capital of the United Kingdom is", "--target", " Paris"],
     "the same number of tokens (--clean is 6, --corrupted 8)"),
    # many pairs: the file or set, and not with a pair
    (["attribute", "--pairs", "no-such.jsonl"],
     "--pairs no-such.jsonl: no such file, nor a built-in set (capitals, ioi)"),
    (["circuit", "--pairs", "ioi", "--target", " x"],
     "give one pair (--clean, --corrupted, --target) or --pairs, not both"),
    (["attribute", "--clean", "A b", "--target", " x"], "give --corrupted (or many pairs"),
    # a facts file's lines, named (line 2 is blank)
    (["trace", "--facts", "{facts:subject=Germany}"],
     "--facts {path}, line 3: subject 'Germany' is not in the prompt 'The capital of France "
     "is'"),
    (["knockout", "--facts", "{facts:target=}"], "--facts {path}, line 3: the target is empty"),
    (["trace", "--facts", "{facts:prompt= }"], "--facts {path}, line 3: the prompt is empty"),
])
def test_text_is_checked_before_the_load(run, tiny_dir, tmp_path, no_load, args, message):
    """Every refusal that needs only the text, or the tokenizer, comes before the model
    loads (`no_load` fails any load), in one line, and nothing is written."""
    facts = tmp_path / "facts.jsonl"
    for i, a in enumerate(args):
        if a.startswith("{facts:"):
            key, value = a[len("{facts:"):-1].split("=")
            facts.write_text(json.dumps(FACT) + "\n\n" + json.dumps({**FACT, key: value})
                             + "\n", encoding="utf-8")
            args = [*args[:i], str(facts), *args[i + 1:]]
    res = run(*args, "--model", tiny_dir, "--out-dir", tmp_path / "o")
    one_line(res, message.format(path=facts))
    assert not (tmp_path / "o").exists()


def test_out_dir_is_tested_by_creating_a_file(run, tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    one_line(run("layernorm", "--out-dir", "/proc/blockscope-test", "1", "2"), "not writable")


def test_silently_accepted_values_are_refused_or_said(run, tiny_dir, tmp_path):
    one_line(run("resid-norm", "Hello there", "--position", "0", "--all-positions", "--model",
                 tiny_dir, "--out-dir", tmp_path), "not both")
    res = run("ablate", "--text", ALICE, "--model", tiny_dir, "--max-tokens", 5000,
              "--out-dir", tmp_path, "--no-plot")
    assert res.exit_code == 0, res.output
    assert "--max-tokens 5,000, but alice.txt has" in " ".join(res.stderr.split())


def test_paths_and_messages(run, tiny_dir, tmp_path, monkeypatch):
    from blockscope.model.loading import spec_for

    monkeypatch.chdir(tiny_dir.parent)  # a relative directory name, no ./
    assert spec_for(tiny_dir.name).is_local
    one_line(run("ablate", "--model", "path/to/checkpoint-dir", "--text", ALICE),
             "--model path/to/checkpoint-dir: no such directory")
    one_line(run("params", "-m", "/nonexistent/config.json", "--out-dir", tmp_path),
             "no such file or directory")
    one_line(run("params", "--n-heads", "0", "--out-dir", tmp_path), "at least 1")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\t\n")
    one_line(run("ablate", "--text", blank, "--model", tiny_dir), "holds only whitespace")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    one_line(run("ablate", "--text", latin, "--model", tiny_dir), "iconv -f latin1")
    one_line(run("resid-norm", "--model", tiny_dir), "give the prompt as an argument or with")
    assert "not both" not in run("resid-norm", "--model", tiny_dir).stderr
    one_line(run("resid-norm", "Hi", "--model", tiny_dir, "--out-dir", tmp_path),
             "the text gives 1 token: fewer than 2")


def test_files_respect_the_umask_and_stale_temp_files_go(tmp_path):
    import pandas as pd

    from blockscope.results.files import STALE_S, write_outputs

    stale = tmp_path / ".old.csv.abcd1234.tmp"
    fresh = tmp_path / ".new.csv.efgh5678.tmp"
    other = tmp_path / ".someone-elses.tmp"
    for p in (stale, fresh, other):
        p.write_text("x")
    past = time.time() - STALE_S - 60
    os.utime(stale, (past, past))
    os.utime(other, (past, past))
    old = os.umask(0o022)
    try:
        (path,) = write_outputs(tmp_path, {"r.csv": pd.DataFrame({"v": [1]})})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not stale.exists() and fresh.exists() and other.exists()


def test_progress_shows_size_when_piped_and_no_guess_from_an_instant(run, tiny_dir,
                                                                      tmp_path):
    """A sweep over in well under a second says its size and steps, and no time left: a
    guess from such steps read "about 0 s left" (the guess itself is tested above, on a
    clock of its own)."""
    res = run("ablate", "--text", ALICE, "--model", tiny_dir, "--max-tokens", 60,
              "--out-dir", tmp_path, "--no-plot")
    assert res.exit_code == 0, res.output
    assert "60 tokens + BOS of alice.txt, 1 window of up to 128" in res.stderr
    assert "skipping each block: 4/4" in res.stderr and "s left" not in res.stderr


def test_float16_on_the_cpu_is_warned_and_named(run, tiny_dir, tmp_path):
    res = run("resid-norm", "The capital of France is", "--model", tiny_dir, "--dtype",
              "float16", "--device", "cpu", "--out-dir", tmp_path, "--no-plot")
    assert res.exit_code == 0, res.output
    assert "float16 on the CPU runs about 8x slower" in " ".join(res.stderr.split())
    assert result(tmp_path, "resid-norm-tiny-gpt2-float16.csv")


def test_help_has_no_bool_placeholders_and_negative_numbers_get_a_hint(run):
    for command in ("ablate", "prune-heads", "resid-norm"):
        text = run(command, "--help").stdout
        assert "--quiet" in text
        assert "<bool>" not in text, text  # not on a flag, not even on --help
    assert "<list[" not in run("prune-heads", "--help").stdout
    assert "<list[" not in run("params", "--help").stdout
    from blockscope.cli import _negative_numbers_hint

    with pytest.raises(SystemExit) as exc:
        _negative_numbers_hint(["layernorm", "-1", "0", "1"])
    assert exc.value.code == 2
    _negative_numbers_hint(["layernorm", "--", "-1", "0", "1"])  # already right: no exit


def test_narrow_terminals_never_cut_a_number():
    import pandas as pd

    from blockscope.results.render import table

    buf = io.StringIO()
    Console(file=buf, width=12).print(table(pd.DataFrame({"perplexity": [4_811_356_789.126]}),
                                            {"perplexity": ("ppl", ",.2f")}))
    text = buf.getvalue()
    assert "…" not in text
    assert "".join(ch for ch in text if ch.isdigit()) == "481135678913"  # folded, all there


def test_plots_name_the_part_and_titles_use_the_directory_name(tmp_path):
    import pandas as pd

    from blockscope.model.loading import ModelSpec
    from blockscope.results.plots import ablation_plot

    spec = ModelSpec("x", str(tmp_path / "deep" / "ckpt"), True, "cpu", "bfloat16", False)
    assert spec.label == "ckpt (bfloat16)" and spec.slug == "ckpt-bfloat16"
    df = pd.DataFrame({"layer": [None, 0, 1], "part": ["none", "attn", "attn"],
                       "perplexity": [10.0, 10.5, 8.0]})
    ax = ablation_plot(df, "t").axes[0]
    assert "attn" in ax.get_xlabel() and "baseline" in ax.get_ylabel()
    heights = [round(p.get_height(), 3) for p in ax.patches]
    assert heights == [0.05, -0.2]  # change against the baseline, from 1


def test_reproduce_verdict_does_not_read_as_a_match():
    from blockscope.results.report import best_sentence

    assert "no BOS x weights variant matches" in best_sentence(("BOS, raw weights", 0, 6))
    assert "matches 4 of 6" in best_sentence(("BOS, raw weights", 4, 6))


def test_the_default_text_works_from_any_folder(tmp_path, monkeypatch):
    from blockscope.inputs.text import read_passage

    monkeypatch.chdir(tmp_path)
    passage = read_passage("data/alice.txt")
    assert passage.text == ALICE.read_text(encoding="utf-8")
    with pytest.raises(BlockscopeError, match="no such file"):
        read_passage("data/other.txt")


def test_toy_model_writes_a_loadable_checkpoint_once(run, tmp_path):
    res = run("toy-model", tmp_path / "toy", "--tiny")
    assert res.exit_code == 0, res.output
    assert "numbers mean nothing" in " ".join(res.stdout.split())
    ok = run("resid-norm", "The capital of France is", "--model", tmp_path / "toy",
             "--out-dir", tmp_path / "o", "--no-plot", "-q")
    assert ok.exit_code == 0, ok.output
    one_line(run("toy-model", tmp_path / "toy"), "exists and is not an empty directory")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "toy").stat().st_mode) == 0o777 & ~mask  # not 0700
    assert stat.S_IMODE((tmp_path / "toy" / "model.safetensors").stat().st_mode) == \
        0o666 & ~mask  # not 0600
    meta = json.loads(next((tmp_path / "o").glob("*.json")).read_text())
    assert meta["model"]["provenance"]["random_weights"] is True  # said in every sidecar


def test_usage_errors_are_one_line_with_the_choices(monkeypatch, capsys):
    """Typos and bad choices: one `error:` line and exit 2, not Click's usage box."""
    import sys

    from blockscope.cli import _run

    for argv, said in ((["ablate", "--part", "atn"], "'atn' is not one of 'block'"),
                       (["ablate", "--max-token", "100"], "--max-tokens"),
                       (["ablate", "--dtype", "float64"], "'float32'"),
                       (["layernorm", "1", "abc"], "valid number")):
        monkeypatch.setattr(sys, "argv", ["blockscope", *argv])
        assert _run() == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines


def test_extreme_numbers_path_datasets_growth_and_a_short_context(run, tiny_dir, tmp_path):
    from blockscope.cli import _negative_numbers_hint

    huge = run("layernorm", "--out-dir", tmp_path, "--", "1e300", "2e300")
    assert huge.exit_code == 2 and "beyond float64" in huge.stderr  # not [0, 0] and exit 0
    big = run("layernorm", "--out-dir", tmp_path, "--", "1e150", "3e150")
    assert big.exit_code == 0 and "-1.000" in big.stdout and "1.000" in big.stdout
    _negative_numbers_hint(["layernorm", "--eps", "-1", "1", "1"])  # the value of --eps: no hint
    typo = run("ablate", "--dataset", "corp/nosuch.jsonl", "--model", tiny_dir)
    assert typo.exit_code == 2 and "no such file or directory" in typo.stderr
    assert "Hub" not in typo.stderr
    norms = run("resid-norm", "The capital of France is", "--model", tiny_dir, "--no-plot",
                "--out-dir", tmp_path)
    assert "growth: after block 2 (the last) the norm is" in norms.stdout
    roles = run("head-roles", "--model", tiny_dir, "--text", ALICE, "--no-plot", "--out-dir",
                tmp_path)  # a 128-token context, the default 200 tokens: cut to fit
    assert roles.exit_code == 0, roles.output


@pytest.mark.parametrize("width", [60, 80, 120])
def test_tables_never_cut_a_number(width):
    """params -m gpt3-175b | cat showed `1,207,959,55` and a `2` on the next line."""
    from blockscope.experiments.params import parameter_counts
    from blockscope.model.configs import load_config
    from blockscope.results.render import fmt, table

    df = parameter_counts(load_config("gpt3-175b"))
    columns = {"component": ("component", "s"), "scope": ("scope", "s"),
               "parameters": ("parameters", ",d"), "share_of_block": ("of block", ".1%"),
               "share_of_model": ("of model", ".2%"),
               "shortcut_error": ("shortcut error", "+.2%")}
    console = Console(width=width, record=True, markup=False, file=io.StringIO())
    console.print(table(df, columns, width=width))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width
    shown = text if width >= 80 else text.split("Left out")[0]
    for value in df["parameters"]:
        assert fmt(value, ",d") in shown  # whole, on one line
    if width < 80:
        assert "Left out at 60 columns: shortcut error" in " ".join(text.split())


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_head_grid_splits_its_heads_rather_than_fold_a_number(width):
    """prune-heads' terminal grid of 12 x 12 cells wrapped at 80 columns: now every cell is
    whole on its line, and the heads split over grids that fit (each head shown once)."""
    import torch

    from blockscope.results.render import heat_grid

    grid = torch.linspace(-0.5, 1.234, 144).reshape(12, 12)
    console = Console(width=width, record=True, markup=False, file=io.StringIO())
    console.print(heat_grid(grid, title="toy: perplexity change with one head removed"))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width
    for value in grid.flatten().tolist():
        assert format(value, "+.1%") in text
    headers = [line for line in text.splitlines() if line.startswith("┃ layer")]
    heads = [int(h) for line in headers for h in line.replace("┃", " ").split()[1:]]
    assert sorted(heads) == list(range(12))
    assert len(headers) == (1 if width >= 128 else 2 if width >= 69 else 3)


def test_no_estimate_until_a_step_after_the_first(monkeypatch):
    """A sweep's first step is its clean pass: an estimate from it alone said "about 361 s
    left". The time left now comes from the steps after it, and none is given before."""
    import time as clock

    from blockscope.results import progress

    now = iter([0.0, 100.0, 101.0, 102.0])  # start, the clean pass, then two variants
    monkeypatch.setattr(clock, "perf_counter", lambda: next(now))
    buf = io.StringIO()
    with progress.progress_bar(Console(file=buf, width=100), 10, "sweep") as step:
        for _ in range(3):
            step()
    lines = buf.getvalue().splitlines()
    assert lines == ["sweep: 1/10, 100 s", "sweep: 2/10, 101 s",  # one later step: no guess
                     "sweep: 3/10, 102 s, about 7 s left"]
    # a batch of variants finishing at one instant gave "about 0 s left": no guess from it
    now = iter([0.0, 50.0] + [50.001] * 5 + [60.0] * 5)
    buf = io.StringIO()
    with progress.progress_bar(Console(file=buf, width=100), 10, "sweep") as step:
        for _ in range(10):
            step()
    lines = buf.getvalue().splitlines()
    assert not any("about 0 s left" in line for line in lines), lines
    assert lines[5] == "sweep: 6/10, 50 s"  # the batch's steps: under 2 s of later steps

    class Task:  # what Rich's column reads of a task
        total, fields = 10, {}

        def __init__(self, completed, at):
            self.completed, self.at = completed, at

        def get_time(self):
            return self.at

    column = progress._Remaining()
    assert column.render(Task(1, 100.0)).plain == "-:--:--"
    Task.fields = {"first_step_at": 100.0}
    assert column.render(Task(3, 104.0)).plain == "0:00:14"  # 2 s a step, 7 steps left
    assert column.render(Task(3, 100.5)).plain == "-:--:--"  # steps at one instant


def test_a_piped_run_says_a_long_step_and_keeps_a_quick_refusal_one_line(monkeypatch):
    """Piped, a spinner shows nothing: a step still running after LATE_S is said on one
    plain line; one that ends sooner (a bad input refused at once) adds no line."""
    buf = io.StringIO()
    monkeypatch.setattr(cli_common, "err", Console(file=buf, width=100))
    monkeypatch.setattr(cli_common, "LATE_S", 0.05)
    with cli_common.status("loading tiny on cpu (float32)", quiet=False):
        pass
    assert buf.getvalue() == ""
    with cli_common.status("loading tiny on cpu (float32)", quiet=False):
        time.sleep(0.5)
    assert buf.getvalue() == "loading tiny on cpu (float32) ...\n"
    with cli_common.status("loading tiny on cpu (float32)", quiet=True):
        time.sleep(0.2)
    assert buf.getvalue() == "loading tiny on cpu (float32) ...\n"


@pytest.mark.parametrize("columns", [60, 80])
def test_help_never_cuts_an_option_or_a_default(columns):
    """`reproduce --help` cut `--no-norm-place...` and `[default: experiments/arti...]` in
    Typer's boxed panels. Every command's help now names each option and default whole."""
    from blockscope.cli import app as typer_app

    def helped(name):  # at the terminal's width (CliRunner's own default is 80)
        return CliRunner().invoke(app, [name, "--help"], terminal_width=columns).stdout

    text = helped("reproduce")
    assert "--norm-placement / --no-norm-placement" in text
    assert "(default: the copy shipped inside the package)" in " ".join(text.split())
    for info in typer_app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        text = helped(name)
        assert "\u2026" not in text and "<bool>" not in text, (name, text)
        assert max(map(len, text.splitlines())) <= columns, (name, text)


@pytest.mark.parametrize("columns", [80])
def test_help_keeps_every_literal_whole_and_every_summary_whole(columns):
    """At 80 columns Click broke `resid-pre` at its hyphen and `' Paris'` at its space, and
    cut every command's summary in `blockscope --help` with `...`. Every quoted literal
    and hyphenated word of a command's help now stands whole on one line, and the
    top-level help shows each command's first paragraph whole. (Narrower, an option's
    column can be shorter than a literal, which is then broken rather than overflow.)"""
    import typing

    from blockscope.api.common import COMMANDS
    from blockscope.api.options import parameters
    from blockscope.cli import help as help_text

    def shown(*args):
        return CliRunner().invoke(app, [*args], terminal_width=columns).stdout

    top = shown("--help")
    assert not any(line.rstrip().endswith("...") for line in top.splitlines()[1:]), top
    flat = " ".join(top.split())
    for name, (fn, cls) in COMMANDS.items():
        doc = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        assert doc in flat, (name, top)
        helps = [getattr(typing.get_args(kind)[1], "help", None) or ""
                 for _, kind, _ in parameters(cls)]
        source = " ".join(" ".join(t.split()) for t in [fn.__doc__ or "", *helps])
        pieces = {m[0] for m in help_text.LITERAL.finditer(source)} | {
            w.strip("().,;:'\"") for w in source.split() if help_text.HYPHEN.search(w)}
        lines = shown(name, "--help").splitlines()
        for piece in pieces:
            assert any(piece in line for line in lines), (name, piece, lines)
    assert any("(' Paris')" in line for line in shown("trace", "--help").splitlines())


@pytest.mark.parametrize("args", [
    ["ablate", "--max-tokens", 60, "--bootstrap", 20],
    ["ablate", "--max-tokens", 40, "--decompose"],
    ["prune-heads", "--max-tokens", 30, "--bootstrap", 20, "--step", 0.5],
    ["resid-norm", "The capital of France is and was and will be"],
])
def test_what_a_run_prints_fits_80_columns(run, tiny_dir, tmp_path, monkeypatch, args):
    """The rank-stability line, resid-norm's growth line and decompose's headline ran past
    80 columns (printed unwrapped): every line a run prints fits, but the paths written."""
    monkeypatch.setenv("COLUMNS", "80")
    res = run(*args, "--model", tiny_dir, "--no-plot", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    long = [line for line in res.stdout.splitlines()
            if len(line) > 80 and not line.startswith("wrote ")]
    assert not long, long
