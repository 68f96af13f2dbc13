"""Every numeric option has a range, and a value past either end is refused in one line,
exit 2, before the model loads; and every refusal of every command exits 2, through the
real entry point (`blockscope.cli._run`, as `blockscope` runs it), Click's usage errors and
blockscope's own alike."""

import sys

import pytest

from blockscope.api import common
from blockscope.api.common import COMMANDS
from blockscope.cli import _run

from ..conftest import ALICE

PROMPT = ["The capital of France is"]
FACT = [*PROMPT, "--subject", "France"]
CORPUS = "{corpus}"

# (command and the arguments it needs, the option, a value past one end, what is said).
# The tiny model has 3 blocks, 4 heads, a 128-token context, d_mlp 256 and 50,257 tokens.
PAST = [
    (["ablate"], "--seed", -1, "--seed must be between 0 and 4,294,967,295"),
    (["ablate"], "--seed", 2**32, "--seed must be between 0 and 4,294,967,295"),
    (["ablate"], "--bootstrap", -1, "--bootstrap"),
    (["ablate"], "--bootstrap", 100_001, "--bootstrap must be between 0 and 100,000"),
    (["ablate"], "--max-tokens", 1, "--max-tokens must be at least 2"),
    (["ablate"], "--stride", 0, "--stride must be at least 1"),
    (["ablate"], "--stride", 129, "--stride 129 is longer than the model's context"),
    (["ablate"], "--batch-size", 0, "--batch-size"),
    (["ablate"], "--batch-size", 100_001, "--batch-size must be between 1 and 100,000"),
    (["ablate", "--dataset", CORPUS], "--n-tokens", 0, "--n-tokens must be at least 1"),
    (["ablate", "--dataset", CORPUS], "--n-docs", 0, "--n-docs must be at least 1"),
    (["rearrange"], "--seed", -1, "--seed must be between 0"),
    (["prune-blocks"], "--tolerance", -0.5, "--tolerance must be a fraction of 0 or more"),
    (["prune-blocks"], "--max-removed", 4, "--max-removed 4 is more than the model's 3"),
    (["prune-blocks"], "--max-removed", 0, "--max-removed"),
    (["prune-heads"], "--step", 0, "--step must be a fraction in (0, 1)"),
    (["prune-heads"], "--step", 13, "--step 13 heads is more than the model's 12 heads"),
    (["prune-heads"], "--tolerance", -1, "--tolerance must be a fraction of 0 or more"),
    (["head-roles", "--max-tokens", 30], "--n-random", 1, "--n-random must be at least 2"),
    (["head-roles", "--max-tokens", 30], "--n-random", 64, "--n-random must be between 2"),
    (["head-roles"], "--max-tokens", 1, "--max-tokens must be at least 2"),
    (["head-roles", "--max-tokens", 30], "--seed", -1, "--seed must be between 0"),
    (["trace", *FACT], "--samples", 0, "--samples must be at least 1"),
    (["trace", *FACT], "--samples", 1001, "--samples must be between 1 and 1,000"),
    (["trace", *FACT], "--window", 0, "--window must be at least 1"),
    (["trace", *FACT], "--window", 4, "--window 4 is more than the model's 3 blocks"),
    (["trace", *FACT], "--noise", 0, "--noise must be above 0"),
    (["trace", *FACT], "--noise-std", -0.5, "--noise-std must be above 0"),
    (["trace", *FACT], "--seed", -1, "--seed must be between 0"),
    (["knockout", *FACT], "--window", 0, "--window must be at least 1"),
    (["knockout", *FACT], "--window", 4, "--window 4 is more than the model's 3 blocks"),
    (["logit-lens", *PROMPT], "--top-k", 0, "--top-k must be at least 1"),
    (["logit-lens", *PROMPT], "--top-k", 50_258, "--top-k 50258 is more than the model's "
                                                 "50,257 tokens"),
    (["logit-lens", *PROMPT], "--position", 6, "--position 6 is outside the 6 tokens"),
    (["logit-lens", *PROMPT], "--position", -7, "--position -7 is outside the 6 tokens"),
    (["mlp-memory", *PROMPT], "--n-layers", 0, "--n-layers must be at least 1"),
    (["mlp-memory", *PROMPT], "--n-layers", 4, "--n-layers 4 is more than the model's 3"),
    (["mlp-memory", *PROMPT], "--per-layer", 0, "--per-layer must be at least 1"),
    (["mlp-memory", *PROMPT], "--per-layer", 257, "--per-layer 257 is more than the "
                                                  "model's 256 neurons a layer"),
    (["mlp-memory", *PROMPT], "--top-k", 50_258, "--top-k 50258 is more than the model's"),
    (["mlp-memory", *PROMPT], "--n-examples", 0, "--n-examples must be at least 1"),
    (["resid-norm", *PROMPT], "--position", 5, "--position 5 is outside the 5 tokens"),
    (["shapes", *PROMPT], "--block", -1, "--block must be between 0 and 2"),
    (["shapes", *PROMPT], "--block", 3, "--block must be between 0 and 2"),
    (["attention", *PROMPT], "--layer", 3, "--layer 3 is out of range: 0 to 2"),
    (["layernorm", 1, 2], "--eps", 0, "--eps must be a positive number"),
    (["params"], "--n-heads", 0, "--n-heads"),
    (["norm-placement"], "--seeds", 0, "--seeds must be between 1 and 1,000"),
    (["norm-placement"], "--seeds", 1001, "--seeds must be between 1 and 1,000"),
    (["norm-placement"], "--seed", -1, "--seed must be between 0"),
    (["norm-placement"], "--train-steps", -1, "--train-steps must be between 0"),
    (["norm-placement"], "--train-steps", 1_000_001, "--train-steps must be between 0"),
    (["norm-placement"], "--warmup-steps", 1_000_001, "--warmup-steps must be between 0"),
    (["norm-placement"], "--seq-len", 0, "--seq-len must be between 1 and 8,192"),
    (["norm-placement"], "--seq-len", 8193, "--seq-len must be between 1 and 8,192"),
    (["norm-placement"], "--batch-size", 8193, "--batch-size must be between 1 and 8,192"),
    (["norm-placement"], "--max-tokens", 1, "--max-tokens must be between 2 and 1,000,000"),
    (["norm-placement"], "--n-layers", 0, "--n-layers must be at least 1"),
    (["norm-placement"], "--n-layers", 100_000, "more than the 2,000,000,000 a CPU run"),
    (["norm-placement"], "--train-d-model", 0, "--train-d-model must be at least 1"),
    (["norm-placement"], "--train-d-model", 100_000, "more than the 2,000,000,000"),
    (["toy-model", "{tmp}/toy"], "--seed", -1, "--seed must be between 0"),
]

NO_MODEL = {"layernorm", "norm-placement", "params", "toy-model"}


@pytest.fixture
def no_load(monkeypatch):
    """The model must not load: every refusal here comes before it."""
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(common, "load", fail)
    monkeypatch.setattr("blockscope.model.loading.load_model", fail)


def blockscope(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    """`blockscope *args` as the console script runs it: its exit code and stderr's lines."""
    monkeypatch.setattr(sys, "argv", ["blockscope", *map(str, args)])
    code = _run()
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("given, option, value, message", PAST,
                         ids=[f"{g[0]}{o}={v}" for g, o, v, _ in PAST])
def test_a_value_past_either_end_is_refused_before_the_load(
        monkeypatch, capsys, tiny_dir, tmp_path, no_load, given, option, value, message):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "Alice was beginning to get very tired"}\n', encoding="utf-8")
    args = [str(a).format(corpus=corpus, tmp=tmp_path) for a in given]
    extra = [] if given[0] in NO_MODEL else ["--model", tiny_dir]
    if given[0] == "head-roles":
        extra += ["--text", ALICE]
    out = tmp_path / "out"
    code, lines = blockscope(monkeypatch, capsys, *args, option, value, *extra,
                             *([] if given[0] == "toy-model" else ["--out-dir", out]))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_refusal_of_every_command_exits_2(monkeypatch, capsys, tmp_path, name):
    """A mistyped option (Click's usage error) and a value blockscope refuses (an --out-dir
    that cannot be written, or get-model's unknown model) both exit 2 in one line."""
    code, lines = blockscope(monkeypatch, capsys, name, "--no-such-option")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    bad = ["no-such-model"] if name == "get-model" else (
        [tmp_path / "t"] if name == "toy-model" else ["--out-dir", "/proc/x/y"])
    if name == "toy-model":
        (tmp_path / "t").mkdir()
        (tmp_path / "t" / "f").write_text("x")
    if name == "layernorm":
        bad += ["1", "2"]
    code, lines = blockscope(monkeypatch, capsys, name, *bad)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
