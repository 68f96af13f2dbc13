"""Long runs survive an interruption: each finished unit (a fact, a document) is kept under
--out-dir/.partial as it finishes, and the same command run again computes only the rest,
to the same CSVs byte for byte. A real process is killed (SIGKILL) once some units are on
disk; Ctrl-C is the KeyboardInterrupt that SIGINT raises, here raised as the next unit
starts, in the CLI runner, as are the reruns."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from blockscope.cli import app

from ..builders import paragraphs, write_jsonl
from ..conftest import result

FACTS = [
    ("The capital of France is", "France", " Paris"),
    ("The capital of Italy is", "Italy", " Rome"),
    ("The Eiffel Tower is in the city of", "Eiffel Tower", " Paris"),
    ("The capital of Spain is", "Spain", " Madrid"),
    ("Toyota is a company from", "Toyota", " Japan"),
    ("The official language of Germany is", "Germany", " German"),
]


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "facts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "subject": s, "target": t}) + "\n"
                            for p, s, t in FACTS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = " ".join(paragraphs())
    texts = [text[i * 500:(i + 1) * 500] for i in range(6)]  # about two windows each
    return write_jsonl(tmp_path_factory.mktemp("resume-corpus") / "docs.jsonl", texts)


@pytest.fixture(autouse=True)
def one_thread():
    """The interrupted process runs with one thread (OMP_NUM_THREADS=1, as `interrupted`
    starts it), so the reruns here do too: the same kernels give the same floats."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def units(out_dir):
    """The unit files kept under out_dir/.partial."""
    return sorted((out_dir / ".partial").glob("*/*.pkl")) if (out_dir / ".partial").is_dir() \
        else []


def interrupted(args, out_dir, at_least: int, sig):
    """Run `blockscope *args` as a process, send `sig` once `at_least` units are kept, and
    return (its exit code, its stderr, the number of units on disk after it ended)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def as_a_terminal_would():  # a shell starts a background job with SIGINT ignored, and
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python keeps ignoring it: not here

    proc = subprocess.Popen([sys.executable, "-m", "blockscope", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=as_a_terminal_would)
    deadline = time.monotonic() + 240
    while len(units(out_dir)) < at_least:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no unit was kept in time"
        time.sleep(0.005)
    # stopped first, so that a loaded machine cannot let it finish every unit before the
    # signal lands; SIGINT then waits, pending, until it runs again
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr, len(units(out_dir))


TRACE = ["trace", "--facts", "{facts}", "--all-facts", "--samples", 1, "--kind", "resid",
         "--no-plot", "-q"]


def trace_args(tiny_dir, facts, out_dir):
    return [str(a).format(facts=facts) for a in TRACE] + ["--model", tiny_dir,
                                                          "--out-dir", out_dir]


def test_a_killed_trace_resumes_to_the_same_files(tiny_dir, tmp_path, facts):
    n = len(FACTS)
    whole, part = tmp_path / "whole", tmp_path / "part"
    cli(*trace_args(tiny_dir, facts, whole))
    code, _, k = interrupted(trace_args(tiny_dir, facts, part), part, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL and 1 <= k < n
    assert not list(part.glob("*.csv"))  # nothing final was written
    cli(*trace_args(tiny_dir, facts, part))
    for name in ("trace-tiny-gpt2-facts.csv", "trace-tiny-gpt2-facts-per-fact.csv"):
        assert result(part, name).read_bytes() == result(whole, name).read_bytes(), name
    meta = json.loads(result(part, "trace-tiny-gpt2-facts.json").read_text())
    assert (meta["partial"]["computed"], meta["partial"]["reused"]) == (n - k, k)
    uninterrupted = json.loads(result(whole, "trace-tiny-gpt2-facts.json").read_text())
    assert (uninterrupted["partial"]["computed"], uninterrupted["partial"]["reused"]) == (n, 0)
    assert not (part / ".partial").exists()  # removed once the final files are written


def ctrl_c_after(monkeypatch, k: int) -> None:
    """Ctrl-C as the run is about to compute its (k+1)-th unit: the KeyboardInterrupt
    Python raises on SIGINT, raised there."""
    from blockscope.inputs import partial

    real, computed = partial.Scope.unit, []

    def unit(self, index, compute, reused=None):
        def counted():
            if len(computed) == k:
                raise KeyboardInterrupt
            computed.append(index)
            return compute()

        return real(self, index, counted, reused)

    monkeypatch.setattr(partial.Scope, "unit", unit)


def test_ctrl_c_keeps_its_units_for_the_same_settings_only(tiny_dir, tmp_path, facts,
                                                           monkeypatch):
    """Ctrl-C says what was kept and exits 130; the kept units are not read by a run with
    another seed (another digest, so another folder), nor by one with --fresh."""
    out = tmp_path / "out"
    args = trace_args(tiny_dir, facts, out)
    with monkeypatch.context() as m:
        ctrl_c_after(m, 2)
        res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 130 and len(units(out)) == 2
    assert not list(out.glob("*.csv"))
    assert res.stderr.strip().splitlines() == [
        f"interrupted: 2 of {len(FACTS)} facts kept; run the same command again to "
        "continue"], res.stderr
    cli(*args, "--seed", 1)
    meta = json.loads(result(out, "trace-tiny-gpt2-facts.json").read_text())
    assert (meta["partial"]["computed"], meta["partial"]["reused"]) == (len(FACTS), 0)
    assert len(units(out)) == 2  # the seed-0 run's units are still kept
    for name in ("facts.json", "facts.csv", "facts-per-fact.csv"):  # the seed-1 run's
        result(out, f"trace-tiny-gpt2-{name}").unlink()
    cli(*args, "--fresh")
    meta = json.loads(result(out, "trace-tiny-gpt2-facts.json").read_text())
    assert meta["seed"] == 0
    assert (meta["partial"]["computed"], meta["partial"]["reused"]) == (len(FACTS), 0)
    assert not (out / ".partial").exists()


def test_a_corpus_ablate_interrupted_by_sigint_resumes_to_the_same_files(tiny_dir, tmp_path,
                                                                        corpus):
    """A real process gets SIGINT once a document is kept: one line, exit 130, no
    final file; the rerun computes only the rest (the documents of a corpus sweep are its
    units) and block influence and angular distance, which the clean passes feed, come out
    the same too."""
    args = ["ablate", "--dataset", corpus, "--model", tiny_dir, "--bootstrap", 50,
            "--no-plot", "-q"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    cli(*args, "--out-dir", whole)
    code, stderr, k = interrupted([*args, "--out-dir", part], part, 1, signal.SIGINT)
    assert code == 130 and 1 <= k < 6 and not list(part.glob("*.csv"))
    assert stderr.strip().splitlines() == [
        f"interrupted: {k} of 6 documents kept; run the same command again to continue"]
    cli(*args, "--out-dir", part)
    name = "ablate-tiny-gpt2-docs.csv"
    assert result(part, name).read_bytes() == result(whole, name).read_bytes()
    meta = json.loads(result(part, "ablate-tiny-gpt2-docs.json").read_text())
    assert (meta["partial"]["computed"], meta["partial"]["reused"]) == (6 - k, k)


def test_attribute_over_pairs_stopped_in_its_second_pass_resumes(tiny_dir, tmp_path,
                                                                 monkeypatch):
    """attribute --pairs keeps each pair's estimates, then each pair's exact patches: a run
    stopped after the first pass and one pair of the second computes only the last pair's
    exact patches, and writes the same files as a run never stopped."""
    pairs = tmp_path / "three.jsonl"
    pairs.write_text("".join(json.dumps({"clean": f"The capital of {a} is",
                                         "corrupted": f"The capital of {b} is",
                                         "target": f" {x}", "contrast": f" {y}"}) + "\n"
                             for a, b, x, y in [("France", "Italy", "Paris", "Rome"),
                                                ("Spain", "Japan", "Madrid", "Tokyo"),
                                                ("Italy", "France", "Rome", "Paris")]),
                     encoding="utf-8")
    args = ["attribute", "--pairs", pairs, "--site", "z", "--check", 1, "--no-plot", "-q",
            "--model", tiny_dir]
    whole, part = tmp_path / "whole", tmp_path / "part"
    cli(*args, "--out-dir", whole)
    with monkeypatch.context() as m:
        ctrl_c_after(m, 4)
        res = CliRunner().invoke(app, [str(a) for a in [*args, "--out-dir", part]])
    assert res.exit_code == 130 and len(units(part)) == 4
    cli(*args, "--out-dir", part)
    for name in ("attribute-tiny-gpt2-three.csv", "attribute-tiny-gpt2-three-pairs.csv"):
        assert result(part, name).read_bytes() == result(whole, name).read_bytes(), name
    meta = json.loads(result(part, "attribute-tiny-gpt2-three.json").read_text())
    assert (meta["partial"]["computed"], meta["partial"]["reused"]) == (2, 4)
