"""The Python face: every command as `bs.<name>(model, **options) -> Result`, held to the
command line's own files, and to the public names docs/python.md lists."""

import re
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

import blockscope as bs
from blockscope.api import face
from blockscope.api.options import parameters
from blockscope.cli import app

from ..conftest import ALICE, REPO

PROMPT = "The capital of France is"
# Each command's options for a quick run on the tiny checkpoint ("model": the tiny one);
# reproduce is held to its command line in tests/experiments/test_reproduce.py, on the run
# that test already makes.
CASES = {
    "ablate": dict(text=ALICE, max_tokens=30, bootstrap=20),
    "attention": dict(prompt="The capital", layer="1"),
    "attribute": dict(clean=PROMPT, corrupted="The capital of Italy is", target=" Paris",
                      contrast=" Rome", site=["z"], check_cells="2"),
    "circuit": dict(clean=PROMPT, corrupted="The capital of Italy is", target=" Paris",
                    contrast=" Rome", method="atp"),
    "head-roles": dict(text=ALICE, max_tokens=40, n_random=2),
    "knockout": dict(prompt=PROMPT, subject="France", target=" Paris", window=2),
    "layernorm": dict(values=[1.0, 2.0, 4.0]),
    "logit-lens": dict(prompt=PROMPT, target=" Paris"),
    "mlp-memory": dict(prompt=PROMPT, n_layers=1, per_layer=2, top_k=2),
    "norm-placement": dict(model="gpt2", n_layers=2, d_model=32, n_heads=2, seeds=1,
                           train_steps=2, warmup_steps=1, lr="1e-3", train_layers=1,
                           train_d_model=16, train_heads=2, seq_len=16, max_tokens=64),
    "params": dict(model=["gpt2"]),
    "patch": dict(clean=PROMPT, corrupted="The capital of Italy is", target=" Paris",
                  contrast=" Rome", site=["mlp-out"]),
    "prune-blocks": dict(text=ALICE, max_tokens=20, bootstrap=0),
    "prune-heads": dict(text=ALICE, max_tokens=20, bootstrap=0, step=0.5),
    "rearrange": dict(text=ALICE, max_tokens=10, swap="0,2", bootstrap=0),
    "resid-norm": dict(prompt=PROMPT),
    "shapes": dict(prompt=PROMPT),
    "trace": dict(prompt=PROMPT, subject="France", target=" Paris", samples=2, window=2),
}
NAMED = {"norm-placement", "params", "layernorm"}  # `model` is a config name, or none


def dict_of(fn) -> dict:
    """A command's parameters by name."""
    return {n: kind for n, kind, _ in parameters(fn)}


def cli_args(name: str, options: dict) -> list[str]:
    """The command line that says what `options` say, from the options' own declarations."""
    info = {n: typing.get_args(kind)[1] for n, kind, _ in parameters(face.COMMANDS[name][1])}
    args = [name]
    for key, value in options.items():
        decl = info[key]
        if type(decl).__name__ == "ArgumentInfo":
            args += [str(v) for v in (value if isinstance(value, list) else [value])]
            continue
        dashed = "--" + key.replace("_", "-")
        decls = [decl.default, *(decl.param_decls or ())]  # typer.Option(name) is a default
        flag = next((d for d in decls if isinstance(d, str) and d.startswith("--")), dashed)
        if isinstance(value, bool):
            on, _, off = flag.partition("/")
            args.append(on if value else off or "--no-" + on[2:])
            continue
        for v in value if isinstance(value, list) else [value]:
            args += [flag, str(v)]
    return args


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_command_gives_the_cli_csv_byte_for_byte(name, tiny_dir, tmp_path, capsys):
    options = dict(CASES[name]) | ({} if name in NAMED else {"model": str(tiny_dir)})
    # the tables and the printed lines: the pictures and pages are drawn by their own tests
    quiet = {n: False for n in ("plot", "html") if n in dict_of(face.COMMANDS[name][1])}
    res = CliRunner().invoke(app, [*cli_args(name, options | quiet), "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    capsys.readouterr()
    result = getattr(bs, name.replace("-", "_"))(**options)
    assert capsys.readouterr() == ("", "")  # nothing printed
    assert "" not in result.tables
    for table, df in result.tables.items():
        written = tmp_path / result.csv_name(table)
        assert df.to_csv(index=False).encode() == written.read_bytes()
    assert result.meta["command"] == name
    # what the command line printed, the Result holds: its tables and lines, then "wrote"
    from blockscope.api.console import out

    result.show(out)
    shown = capsys.readouterr().out
    assert shown and res.stdout == shown + res.stdout.splitlines(keepends=True)[-1]
    assert res.stdout.splitlines()[-1].startswith("wrote ")


def test_save_writes_the_files_the_cli_writes(tiny_dir, tmp_path):
    options = {"model": str(tiny_dir), **CASES["ablate"]}
    CliRunner().invoke(app, [*cli_args("ablate", options), "--out-dir", str(tmp_path / "cli")])
    result = bs.ablate(str(tiny_dir), **CASES["ablate"])
    saved = result.save(tmp_path / "api")
    assert sorted(p.name for p in saved) == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert result.figure() is not None and result.figure().axes
    assert result.stem in result._repr_html_() and "<table" in result._repr_html_()


def test_a_held_bridge_and_an_hf_model_give_the_numbers_of_a_load(tiny_dir, hf):
    from transformers import AutoTokenizer

    loaded = bs.ablate(bs.load(str(tiny_dir), device="cpu"), **CASES["ablate"])
    by_name = bs.ablate(str(tiny_dir), **CASES["ablate"])
    assert (loaded.stem, loaded.digest) == (by_name.stem, by_name.digest)  # the same files
    loaded, by_name = loaded.table, by_name.table
    blocks = [type(b) for b in hf.transformer.h]
    held = bs.ablate(hf, tokenizer=AutoTokenizer.from_pretrained(tiny_dir),
                     **CASES["ablate"]).table
    assert [type(b) for b in hf.transformer.h] == blocks  # the caller's model left as it was
    for df in (by_name, held):
        assert (df["perplexity"] - loaded["perplexity"]).abs().max() < 1e-6 * loaded[
            "perplexity"].max()


def test_errors_name_parameters_and_options_are_checked_before_loading(tiny_dir):
    with pytest.raises(bs.BlockscopeError, match=r"^`?part`? must be one of"):
        bs.ablate(str(tiny_dir), part="heads")
    with pytest.raises(bs.BlockscopeError, match=r"^stride must be at least 1"):
        bs.ablate("/nonexistent/model", stride=0)  # refused before any load
    with pytest.raises(bs.BlockscopeError, match="a name, not a model object"):
        bs.reproduce(object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'strides'"):
        bs.ablate(str(tiny_dir), strides=2)


def test_progress_goes_to_the_callback(tiny_dir):
    seen = []
    bs.ablate(str(tiny_dir), **CASES["ablate"], progress=lambda *a: seen.append(a))
    assert seen and seen[-1][0] == seen[-1][1] and "block" in seen[-1][2]


def test_the_public_face_is_what_docs_python_md_documents():
    documented = re.findall(r"^### `bs\.(\w+)", (REPO / "docs" / "python.md").read_text(),
                            re.M)
    assert sorted(bs.__all__) == sorted(documented)
    extension = {"AddNoise", "Edit", "EngineFallback", "Knockout", "LogitDiff", "Patch", "Run",
                 "Site", "TargetLogProb", "TargetProb", "Variant", "remove_write",
                 "scale_heads", "scale_neurons", "skip_block"}
    assert set(bs.__all__) == {"BlockscopeError", "Result", "load", "sweep", *extension,
                               *face.faces()}
    assert set(face.faces()) == {n.replace("-", "_") for n in [*CASES, "reproduce"]}
    for name in bs.__all__:
        doc = getattr(bs, name).__doc__ or ""
        assert doc.strip(), name
        if name not in ("BlockscopeError", "Result", *extension):  # functions
            assert "Args:" in doc and "Returns:" in doc, name
    assert "--" not in bs.ablate.__doc__.split("Args:")[1]  # parameters, not flags


def test_the_digest_and_the_sidecar_do_not_depend_on_the_folder(tiny_dir, tmp_path,
                                                                monkeypatch):
    """The same settings name the same files from the repository, from another folder
    (where `data/alice.txt` is the installed copy and the model's path is spelled
    otherwise) and from Python: the digest hashes what was measured, and the sidecar
    records the text's resolved path."""
    import json
    import os

    def cli(cwd, model):
        monkeypatch.chdir(cwd)
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        res = CliRunner().invoke(app, ["ablate", "--max-tokens", "5", "--bootstrap", "0",
                                       "--no-plot", "--model", model, "--out-dir", str(out)])
        assert res.exit_code == 0, res.output
        (sidecar,) = out.glob("*.json")
        return sidecar.name, json.loads(sidecar.read_text())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    a = cli(REPO, str(tiny_dir))
    b = cli(elsewhere, os.path.relpath(tiny_dir, elsewhere))
    assert a[0] == b[0]  # the same digest in the same file name
    assert a[1]["text"]["sha256"] == b[1]["text"]["sha256"]
    for meta in (a[1], b[1]):  # a resolved path, whichever folder it ran from
        assert Path(meta["text"]["path"]).is_absolute()
        assert meta["text"]["path"] == str(Path(meta["text"]["path"]).resolve())
    assert a[1]["settings_digest"] == b[1]["settings_digest"]
    monkeypatch.chdir(elsewhere)
    assert bs.ablate(bs.load(str(tiny_dir)), max_tokens=5, bootstrap=0).digest == \
        a[1]["settings_digest"]


def test_the_prompt_may_be_given_by_position_as_on_the_command_line(tiny_dir):
    """`bs.trace(model, "The capital ...", subject=...)` raised TypeError: what the command
    line takes by position (a prompt, layernorm's values) is taken by position after the
    model, and the tables are named ("main", not "")."""
    options = dict(subject="France", target=" Paris", samples=2, window=2)
    by_position = bs.trace(str(tiny_dir), PROMPT, **options)
    by_name = bs.trace(str(tiny_dir), prompt=PROMPT, **options)
    assert by_position.digest == by_name.digest
    assert by_position.table.equals(by_name.table) and list(by_position.tables) == ["main"]
    with pytest.raises(TypeError, match="takes model, prompt by position"):
        bs.trace(str(tiny_dir), PROMPT, "a third", **options)
    with pytest.raises(TypeError, match="two values for 'prompt'"):
        bs.trace(str(tiny_dir), PROMPT, prompt=PROMPT, **options)
    assert bs.layernorm([1.0, 2.0, 4.0]).table.equals(bs.layernorm(values=[1.0, 2.0, 4.0]).table)
