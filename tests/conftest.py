"""Shared fixtures: tiny GPT-2 checkpoints with the real vocabulary, built offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["PIP_NO_INDEX"] = "1"  # a fetch that slipped through fails at once, offline
_home = __import__("tempfile").mkdtemp(prefix="blockscope-home-")
os.environ["BLOCKSCOPE_HOME"] = _home  # never the user's cache; no model fetched there

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core (pyproject's `-n auto`):
    torch.set_num_threads(1)  # a second thread each would only contend for the same cores

from blockscope.inputs.text import tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.model.toy import save_gpt2_checkpoint  # noqa: E402

from .references import PATHS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ALICE = REPO / "data" / "alice.txt"
# Small but not trivial: 3 blocks, sharp random weights so every block changes the loss,
# and a 128-token context so the Alice passage needs several sliding windows.
TINY = dict(n_layer=3, n_embd=64, n_head=4, n_positions=128, initializer_range=0.2)


def _files(spec) -> tuple | None:
    """A local checkpoint folder's files and their times (None: not a local folder)."""
    if not spec.is_local or not Path(spec.source).is_dir():
        return None
    return tuple(sorted((p.name, p.stat().st_mtime_ns)
                        for p in Path(spec.source).iterdir() if p.is_file()))


@pytest.fixture(scope="session", autouse=True)
def _models_load_once():
    """Commands run in-process by the tests load each local checkpoint once a session (the
    real loader, the first time): loading is most of a tiny model's command. Keyed by the
    whole spec and the checkpoint files' times, so a changed or rewritten folder loads anew;
    failed loads are never kept. The tokenizer read for the checks before the load
    (`peek.peek_tokenizer`, 0.15-0.25 s a read, about 110 reads a suite) is kept the same
    way; a tokenizer not read is never kept."""
    from blockscope.model import loading, peek

    real, kept = loading.load_model, {}
    real_peek, peeked = peek.peek_tokenizer, {}

    def load_model(spec, *, allow_pickle=False, tokenizer=None):
        files = _files(spec)
        if files is None:
            return real(spec, allow_pickle=allow_pickle, tokenizer=tokenizer)
        key = (spec, allow_pickle, files)
        if key not in kept:
            kept[key] = real(spec, allow_pickle=allow_pickle, tokenizer=tokenizer)
        return kept[key]

    def peek_tokenizer(spec):
        files = _files(spec)
        if files is None:
            return real_peek(spec)
        key = (spec, files)
        if peeked.get(key) is None:
            peeked[key] = real_peek(spec)
        return peeked[key]

    loading.load_model, peek.peek_tokenizer = load_model, peek_tokenizer
    yield
    loading.load_model, peek.peek_tokenizer = real, real_peek


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_gpt2_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-gpt2", **TINY)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """The tiny checkpoint through blockscope's own loader (a TransformerBridge)."""
    return load_model(spec_for(str(tiny_dir), device="cpu"))


@pytest.fixture(scope="session")
def hf(tiny_dir):
    """The same checkpoint as a plain HF model: the independent reference."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def alice_text() -> str:
    return ALICE.read_text(encoding="utf-8")


def result(directory, name: str) -> Path:
    """The file blockscope wrote as `name`, with its settings digest before the extension
    (a-b.csv -> a-b-1f2e3d4c.csv): exactly one must exist."""
    import re

    stem, ext = name.rsplit(".", 1)
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{8}\." + re.escape(ext))
    found = [p for p in Path(directory).iterdir() if pattern.fullmatch(p.name)]
    assert len(found) == 1, (name, sorted(p.name for p in Path(directory).iterdir()))
    return found[0]


@pytest.fixture(scope="module", params=sorted(PATHS))
def four_blocks(request, tmp_path_factory, alice_text):
    """A 4-block tiny checkpoint of GPT-2, Llama and GPT-NeoX (parallel blocks)."""
    from transformers import AutoModelForCausalLM

    from .builders import save_checkpoint

    family = request.param
    n = {"gpt2": dict(n_layer=4)}.get(family, dict(num_hidden_layers=4))
    path = save_checkpoint(family, tmp_path_factory.mktemp(family) / family, **n)
    model = load_model(spec_for(str(path), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = tokenize(model.tokenizer, alice_text, prepend_bos=True, max_tokens=40)
    return family, model, hf, ids


# The longest modules first: under `--dist loadscope` a module runs whole on one worker, so
# one that starts last sets the suite's wall time while the other worker idles.
LONGEST_FIRST = ("tests/model/test_families.py", "tests/sweeps/test_engine.py",
                 "tests/cli/test_corpus_cli.py", "tests/experiments/test_interchange.py",
                 "tests/cli/test_resume.py", "tests/api/test_face.py",
                 "tests/cli/test_usability.py", "tests/inputs/test_corpus.py",
                 "tests/experiments/test_attribute.py", "tests/results/test_pages.py",
                 "tests/experiments/test_pairs.py")


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
