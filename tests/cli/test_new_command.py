"""docs/engine.md's recipe for a new command, followed in this file alone: an options
dataclass, a function that returns its Result, `command` to register it; then the command
line runs it (table, CSV, sidecar, refusals before the load) and the Python face has it,
each holding the same numbers as the plain HF model."""

import json
import time
from dataclasses import dataclass
from typing import Annotated, ClassVar

import pandas as pd
import pytest
import torch
import typer
from typer.testing import CliRunner

from blockscope.api.common import COMMANDS, command
from blockscope.api.options import BosTokenOpt, Load, Options, PromptBosOpt, Written, group
from blockscope.api.output import line, write
from blockscope.api.prompts import prompt_run
from blockscope.api.text_options import Prompt
from blockscope.errors import BadValue

from ..conftest import result


# 1. The options: a dataclass of the shared groups and the command's own, checked once.
@dataclass
class TopTokens(Options):
    name: ClassVar[str] = "top-tokens"
    prompt: Prompt = group(Prompt)
    load: Load = group(Load)
    k: Annotated[int, typer.Option(help="How many tokens.")] = 3
    prepend_bos: PromptBosOpt = True
    bos_token: BosTokenOpt = None
    out: Written = group(Written)

    def check(self) -> None:
        if self.k < 1:
            raise BadValue(f"`k` must be at least 1 (got {self.k})")


# 2. The command: load (or take the held model), compute, return the Result.
def top_tokens(o: TopTokens):
    """The model's k most likely next tokens after a prompt.

    Example: blockscope top-tokens "The capital of France is" --k 5
    """
    from blockscope.inputs.text import visible
    from blockscope.results.render import table

    started = time.perf_counter()
    run = prompt_run(o.prompt, o.load, prepend_bos=o.prepend_bos, quiet=o.out.quiet,
                     bos_token=o.bos_token)
    with torch.inference_mode():
        p = run.model(run.tokens, return_type="logits")[0, -1].double().softmax(-1)
    top = p.topk(o.k)
    df = pd.DataFrame({"rank": range(1, o.k + 1), "token_id": top.indices.tolist(),
                       "token": [run.model.tokenizer.decode([i]) for i in top.indices],
                       "p": top.values.tolist()})
    meta = run.meta("top-tokens", o.prepend_bos, started, k=o.k)
    shown = [table(df.assign(token=df["token"].map(visible)),
                   {"rank": ("rank", "d"), "token": ("token", "s"), "p": ("p", ".4f")},
                   title=f"{run.spec.label}: the next token"),
             line(f"top token: {visible(df['token'][0])}")]
    return write(o, f"top-tokens-{run.spec.slug}", {"": df}, meta, shown=shown)


@pytest.fixture
def registered():
    """3. Register it (a module under blockscope/api/ does this at import with @command),
    and put it on the app; taken off again after the test."""
    from blockscope.cli import app
    from blockscope.cli.app import register

    command(top_tokens)
    before = list(app.registered_commands)
    register(top_tokens, TopTokens)
    yield app
    app.registered_commands[:] = before
    del COMMANDS["top-tokens"]


def test_a_new_command_runs_from_the_command_line_and_from_python(registered, tiny_dir,
                                                                  hf, tmp_path):
    from transformers import AutoTokenizer

    from blockscope.api.face import face
    from blockscope.inputs.text import tokenize

    app, prompt = registered, "The capital of France is"
    res = CliRunner().invoke(app, ["top-tokens", prompt, "--k", "4", "--model",
                                   str(tiny_dir), "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "the next token" in res.stdout and "top token:" in res.stdout
    df = pd.read_csv(result(tmp_path, "top-tokens-tiny-gpt2.csv"), keep_default_na=False)
    meta = json.loads(result(tmp_path, "top-tokens-tiny-gpt2.json").read_text())
    assert meta["command"] == "top-tokens" and meta["k"] == 4
    # the independent reference: the plain HF model's next-token distribution
    ids = tokenize(AutoTokenizer.from_pretrained(tiny_dir), prompt, prepend_bos=True)
    with torch.no_grad():
        want = hf(ids).logits[0, -1].double().softmax(-1).topk(4)
    assert df["token_id"].tolist() == want.indices.tolist()
    assert df["p"].to_numpy() == pytest.approx(want.values.numpy(), rel=1e-5)
    # the Python face: the same function, the same Result, nothing printed or written
    got = face("top-tokens")(str(tiny_dir), prompt, k=4)
    assert got.table["token_id"].tolist() == want.indices.tolist()
    assert got.csv_name("main") == result(tmp_path, "top-tokens-tiny-gpt2.csv").name
    # a refusal: one line, exit 2, before any load, nothing written
    res = CliRunner().invoke(app, ["top-tokens", prompt, "--k", "0", "--model",
                                   str(tiny_dir), "--out-dir", str(tmp_path / "none")])
    assert res.exit_code == 2 and "k must be at least 1" in res.output.replace("`", "")
    assert "loading" not in res.output and not (tmp_path / "none").exists()
