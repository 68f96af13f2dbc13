"""The package's layering, read from its imports (module level and inside functions):

    cli -> api (the commands) -> results (files, plots, tables) -> experiments
        -> sweeps (naive loop, engine) -> interventions -> model (spec, loading, fetch, arch)
        -> inputs -> errors

A module imports only from its own layer or the layers below, and no two modules import
each other, however indirectly."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "blockscope"
LAYERS = [  # lowest first: errors and the versions, then each subpackage, the root last
    {"errors", "allocator", "choices", "versions"},  # and the process-wide malloc setting
    {"inputs"},
    {"model"},
    {"interventions"},
    {"sweeps"},
    {"experiments"},
    {"results"},
    {"api"},
    {"cli", "__main__", "blockscope"},  # the package root re-exports the public face
]


def modules() -> dict[str, Path]:
    found = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "blockscope"
        found[name] = p
    return found


def imports() -> dict[str, set[str]]:
    mods = modules()
    edges = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blockscope"):
                base = node.module.removeprefix("blockscope").lstrip(".") or "blockscope"
                for alias in node.names:
                    sub = alias.name if base == "blockscope" else f"{base}.{alias.name}"
                    edges[name].add(sub if sub in mods else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("blockscope."):
                        edges[name].add(alias.name.removeprefix("blockscope."))
        edges[name].discard(name)
    return edges


def layer(name: str) -> int:
    top = name.split(".")[0]
    (index,) = [i for i, group in enumerate(LAYERS) if top in group]
    return index


def test_every_module_has_exactly_one_layer():
    placed = {name: [i for i, group in enumerate(LAYERS) if name.split(".")[0] in group]
              for name in modules()}
    assert {name: found for name, found in placed.items() if len(found) != 1} == {}
    assert {"cli", "sweeps", "inputs.corpus"} <= set(placed)  # modules() sees the tree


def test_no_module_imports_from_a_layer_above_it():
    upward = [f"{a} -> {b}" for a, targets in imports().items() for b in targets
              if layer(b) > layer(a)]
    assert not upward, upward


def test_no_import_cycles():
    edges, cycles = imports(), []

    def visit(name, path):
        for nxt in edges[name]:
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(name)

    done: set[str] = set()
    for name in sorted(edges):
        if name not in done:
            visit(name, [name])
    assert not cycles, sorted(set(cycles))


def _message(node: ast.expr) -> str:
    """A raised message's literal text: an f-string's constant parts, `{}` for the rest."""
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return "".join(_message(v) for v in ast.iter_child_nodes(node)) if not isinstance(
        node, ast.Constant) else (node.value if isinstance(node.value, str) else "")


def test_library_errors_name_parameters_not_flags():
    """Outside cli/, a message names a parameter in backticks (`stride`; errors.BadValue
    shows it as --stride on the command line), never a flag: a library user has no flags.
    Text inside backticks (a shell command to run) is left alone."""
    flagged = []
    for name, path in modules().items():
        if layer(name) == layer("cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = re.sub(r"`[^`]*`", "", _message(node.exc))
                if re.search(r"(?<![\w-])--[a-z]", text):
                    flagged.append(f"{name}:{node.lineno}")
    assert flagged == []


def test_one_module_per_command_and_none_imports_another():
    """`ls api/` reads as the command list: each command's module is named as the command,
    and shares helpers through api's own shared modules, never through another command."""
    import typer

    from blockscope.cli import app

    commands = {name.replace("-", "_") for name in typer.main.get_command(app).commands}
    registering = {name.split(".")[1] for name, path in modules().items()
                   if name.startswith("api.") and "\n@command\n" in path.read_text("utf-8")}
    assert registering == commands
    crossing = [f"{a} -> {b}" for a, targets in imports().items() for b in targets
                if a.startswith("api.") and b.startswith("api.") and a != b
                and a.split(".")[1] in commands and b.split(".")[1] in commands]
    assert crossing == []


def test_each_vocabulary_is_defined_once():
    """A fixed list of choices is a StrEnum in blockscope.choices, which the library checks
    against and the CLI offers; no other module defines an enum with the same members."""
    import enum

    from blockscope import choices

    library = {frozenset(e) for e in vars(choices).values()
               if isinstance(e, type) and issubclass(e, enum.Enum) and e.__module__ ==
               choices.__name__}
    assert len(library) >= 6
    others = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b)
                                                      for b in node.bases):
                values = frozenset(ast.literal_eval(s.value) for s in node.body
                                   if isinstance(s, ast.Assign))
                others[f"{name}.{node.name}"] = values
    assert {k: v for k, v in others.items() if not k.startswith("choices.")
            and (v in library or not v)} == {}


def test_no_test_module_imports_another():
    """Shared references live in tests/references.py and builders in tests/builders.py."""
    tests = Path(__file__).parent
    crossing = [f"{p.name} -> {m}" for p in tests.rglob("test_*.py")
                for m in re.findall(r"^\s*from \.+(?:\w+\.)*(test_\w+) import",
                                    p.read_text("utf-8"), re.M)]
    assert crossing == []


def test_the_tests_mirror_the_package():
    """A test module sits under the subpackage it tests (tests/sweeps/ for sweeps/, ...)."""
    tests = Path(__file__).parent
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.parent.name for p in tests.rglob("test_*.py") if p.parent != tests}
    assert folders and folders <= packages


def test_no_class_name_means_two_things():
    """One name, one class: the CLI's option groups are `...Options`, never the library's
    `Window`, `Passage`, `Rearrange` or `Attention`."""
    seen: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
