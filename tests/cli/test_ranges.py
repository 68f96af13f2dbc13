"""Every numeric option has a range, and a value past either end is refused in one line,
exit 2, before the model loads; and every refusal of every command exits 2, through the
real entry point (`blockscope.cli._run`, as `blockscope` runs it), Click's usage errors and
blockscope's own alike."""

import dataclasses
import sys

import pytest

from blockscope.api.common import COMMANDS
from blockscope.cli import _run

from ..conftest import ALICE

PROMPT = ["The capital of France is"]
PAIR = ["--clean", "A b", "--corrupted", "A c", "--target", " x"]
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
    (["rearrange"], "--seed", -1, "--seed must be between 0"),
    (["prune-blocks"], "--stride", 129, "--stride 129 is longer than the model's context"),
    (["prune-heads"], "--stride", 129, "--stride 129 is longer than the model's context"),
    (["rearrange", "--reverse", "0:2"], "--stride", 129, "--stride 129 is longer than the"),
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
    (["resid-norm", *PROMPT], "--position", -6, "--position -6 is outside the 5 tokens"),
    (["mlp-memory", *PROMPT], "--position", 6, "--position 6 is outside the 6 tokens"),
    (["mlp-memory", *PROMPT], "--position", -7, "--position -7 is outside the 6 tokens"),
    (["mlp-memory", *PROMPT], "--top-k", 0, "--top-k must be at least 1"),
    (["norm-placement"], "--warmup-steps", -1, "--warmup-steps must be between 0"),
    (["norm-placement"], "--d-model", 0, "--d-model must be at least 1"),
    (["norm-placement"], "--n-heads", 0, "--n-heads must be at least 1"),
    (["norm-placement"], "--train-layers", 0, "--train-layers must be at least 1"),
    (["norm-placement"], "--train-heads", 0, "--train-heads must be at least 1"),
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
    (["attribute", *PAIR], "--ig-steps", 0, "--ig-steps must be between 1 and 1,000"),
    (["attribute", *PAIR], "--ig-steps", 1001, "--ig-steps must be between 1 and 1,000"),
    (["circuit", *PAIR], "--ig-steps", 0, "--ig-steps must be between 1 and 1,000"),
    (["circuit", *PAIR], "--ig-steps", 1001, "--ig-steps must be between 1 and 1,000"),
    (["attribute", "--pairs", "ioi"], "--n-pairs", 0, "--n-pairs must be between 1 and 100,000"),
    (["attribute", "--pairs", "ioi"], "--n-pairs", 100_001, "--n-pairs must be between 1"),
    (["circuit", "--pairs", "ioi"], "--n-pairs", 0, "--n-pairs must be between 1 and"),
    (["circuit", "--pairs", "ioi"], "--n-pairs", 100_001, "--n-pairs must be between 1 and"),
    (["circuit", *PAIR], "--faithfulness", 0, "--faithfulness must be a share in (0, 1]"),
    (["circuit", *PAIR], "--faithfulness", 1.5, "--faithfulness must be a share in (0, 1]"),
]

NO_MODEL = {"layernorm", "norm-placement", "params", "toy-model"}

# What each command needs to get as far as its checks.
NEEDS = {"ablate": [], "head-roles": ["--max-tokens", 30], "knockout": FACT, "trace": FACT,
         "logit-lens": PROMPT, "mlp-memory": PROMPT, "norm-placement": [], "params": [],
         "patch": PAIR, "attribute": PAIR, "circuit": PAIR,
         "prune-blocks": [], "prune-heads": [], "rearrange": ["--reverse", "0:2"],
         "resid-norm": PROMPT, "shapes": PROMPT, "toy-model": ["{tmp}/toy"],
         "layernorm": [1, 2], "attention": PROMPT}

PASSAGE_OWN = {"head-roles", "norm-placement"}  # their --max-tokens is their own option

# The ranges every command shares, by option name (options.LIMITS): each command that has
# the option is tried past both ends.
SHARED = {"seed": (-1, 2**32), "bootstrap": (-1, 100_001), "batch_size": (0, 100_001)}

# Numeric options with no upper end, and why: a value past the data or the model is simply
# all of it, or the quantity has no largest meaningful value.
UNBOUNDED = {
    "n_tokens": "a budget: larger than the corpus means all of it",
    "n_docs": "a cap: larger than the corpus means all of it",
    "max_tokens": "a cap: larger than the text means all of it (said in a note)",
    "n_examples": "a cap: as many examples as the corpus has",
    "tolerance": "a band around the baseline: any width is a question one may ask",
    "eps": "layer norm's epsilon: any positive value is well defined",
    "noise": "a noise scale: any positive multiple is well defined",
    "noise_std": "a standard deviation: any positive value is well defined",
    "n_layers": "norm-placement's stack size: bounded by its parameter count instead",
    "d_model": "norm-placement's width: bounded by its parameter count instead",
    "n_heads": "bounded by dividing d_model (params, norm-placement)",
    "train_layers": "bounded by the trained stack's parameter count",
    "train_heads": "bounded by dividing train_d_model",
}


def numeric_options():
    """(command, option) for every int or float option of every command."""

    from blockscope.api.face import _base
    from blockscope.api.options import parameters

    found = []
    for name, (_, cls) in sorted(COMMANDS.items()):
        for option, kind, _ in parameters(cls):
            if _base(kind) in (int, float):
                found.append((name, option))
    return found


# The passage and corpus options every passage command shares (one group of options):
# values past their ends.
PASSAGE = {"max_tokens": (1,), "stride": (0,)}
CORPUS_OPTIONS = ("n_tokens", "n_docs")  # checked as the corpus is opened, before the load

# Every command tried past the ends of each option it shares with others (the same group,
# or the same name in options.LIMITS), by its options' own checks, which the command line
# runs first: a value the ranges refuse, whatever the command.
SHARED_CASES = [(name, option, value) for name, option in numeric_options()
                if option in SHARED or (option in PASSAGE and name not in PASSAGE_OWN)
                for value in (SHARED.get(option) or PASSAGE[option])]
# ... and the corpus's budgets, through the command line (every command that reads one)
PAST += [([name, *([] if name == "resid-norm" else NEEDS[name]), "--dataset", CORPUS],
          "--" + option.replace("_", "-"), 0, f"--{option.replace('_', '-')} must be at least 1")
         for name, option in numeric_options() if option in CORPUS_OPTIONS]


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


def test_every_command_refuses_a_shared_option_past_its_ends():
    """The options many commands share (seed, bootstrap, batch size; the passage's tokens,
    documents and stride) are refused by every command that has them, by the options'
    own checks (what the command line runs before anything loads, in one line, exit 2, as
    the cases above show on one command each)."""
    from blockscope.api.options import build, parameters
    from blockscope.errors import BadValue

    for name, option, value in SHARED_CASES:
        cls = COMMANDS[name][1]
        values = {n: (None if d is dataclasses.MISSING else d) for n, _, d in parameters(cls)}
        values |= {"reverse": "0:2"} if name == "rearrange" else {}  # an arrangement to run
        values |= {"clean": "A b", "corrupted": "A c", "target": " x"} \
            if "clean" in values else {}  # a pair to run
        o = build(cls, {**values, option: value})
        with pytest.raises(BadValue, match=f"^{option} must be"):
            o.check_all()


def test_every_numeric_option_is_tried_past_each_end():
    """Every int or float option of every command is tried below its lower end here
    (its own case or the shared ranges), and above its upper end unless it has none, for the
    reason UNBOUNDED gives."""
    tried = {}
    for given, option, value, _ in PAST:
        tried.setdefault((given[0], option[2:].replace("-", "_")), []).append(value)
    for name, option, value in SHARED_CASES:
        tried.setdefault((name, option), []).append(value)
    missing = []
    for name, option in numeric_options():
        values = tried.get((name, option), [])
        if not values:
            missing.append(f"{name} --{option}: nothing past its lower end")
        elif len(values) < 2 and option not in UNBOUNDED:
            missing.append(f"{name} --{option}: nothing past its upper end, and UNBOUNDED "
                           "does not say why it has none")
    assert not missing, missing
