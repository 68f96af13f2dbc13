"""What every command writes, and under which name: CSV, JSON sidecar and pictures, each
file named by the command, a readable stem and a digest of the run's settings. A command
returns its results (`write` makes the Result); the command line shows and saves them
(`saved`).

Each reads the command's options (`cli.options`): the digest names their values.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from blockscope.api.result import Result, table_name
from blockscope.errors import BadValue

# Options that change only how results are shown or where they go, never what is measured.
OUTPUT_ONLY = {"quiet", "plot", "out_dir", "no_overwrite", "fresh", "html"}


FILE_OPTIONS = {"dataset", "facts", "pairs"}  # text options that may name a local file or folder


def settings_digest(o) -> str:
    """8 hex digits naming the running command's settings: every option and argument as
    parsed (defaults included) but the output-only ones, with what was measured in place
    of how it was spelled: a file's or local dataset's content (sha256), not its path; the
    model as resolved (a local folder's absolute path, a hub id, the default's choice),
    not as typed. Runs whose settings differ never share a file name; identical ones do,
    from any folder and from Python."""
    import hashlib

    record: dict = {"command": o.name}
    params = o.flat()
    for key, value in sorted(params.items()):
        if key in OUTPUT_ONLY:
            continue
        if key == "model":
            value = model_identity(value, params)
        elif isinstance(value, (list, tuple)):
            value = [v.value if isinstance(v, Enum) else str(v) for v in value]
        elif isinstance(value, Enum):
            value = value.value
        elif isinstance(value, Path) or (key in FILE_OPTIONS and value is not None):
            found = _file(key, value)
            # a file's content, or a local dataset's (a hub dataset: its id and --revision)
            value = {"sha256": content_sha256(found)} if found is not None else str(value)
        record[key] = value
    text = repr(sorted(record.items()))  # deterministic; nan and inf hash like any value
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _file(key: str, value) -> Path | None:
    """The local file or folder an option names (the default passage: the installed copy
    where the folder has none), or None."""
    from blockscope.inputs.text import DEFAULT_TEXT, packaged_alice

    path = Path(value).expanduser()
    if key == "text" and path == DEFAULT_TEXT and not path.exists():
        path = packaged_alice()
    if path.is_file() or (key == "dataset" and path.is_dir()):
        return path
    return None


def model_identity(name, params: dict) -> str | None:
    """The model the run will measure, as `spec_for` resolves it: a local folder's absolute
    path, a hub id, the default's choice here (GPT-2, or the offline model); the name as
    given where it does not resolve (the load then says why)."""
    from blockscope.errors import BlockscopeError
    from blockscope.model.loading import spec_for

    if not isinstance(name, str | None) or "allow_pickle" not in params:
        return name  # norm-placement's --model names sizes only, read as given
    try:
        return spec_for(name).source
    except BlockscopeError:
        return name


def content_sha256(path: Path) -> str | None:
    """sha256 of a file's bytes, or of a directory's files (relative names and contents,
    in name order: a local dataset); None for anything else."""
    import hashlib

    if path.is_file():
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    if path.is_dir():
        h = hashlib.sha256()
        for p in sorted(q for q in path.rglob("*") if q.is_file()):
            h.update(str(p.relative_to(path)).encode() + b"\0")
            h.update((content_sha256(p) or "").encode())
        return h.hexdigest()
    return None


def refuse_overwrite(o) -> None:
    """With --no-overwrite, refuse before any work when this command already wrote results
    of these exact settings into --out-dir (every file it writes starts with its name and
    ends with the digest)."""
    params = o.flat()
    if not params.get("no_overwrite"):
        return
    out_dir = Path(params.get("out_dir") or "results").expanduser()
    found = sorted(out_dir.glob(f"{o.name}-*-{settings_digest(o)}.*")) if out_dir.is_dir() \
        else []
    if found:
        raise BadValue(f"`no_overwrite`: results of these settings exist: {found[0]}")


def partial_store(o):
    """The store of finished units (`inputs.partial.Partial`) of this command and its
    settings under --out-dir, started over with --fresh; None for a command that writes
    nothing."""
    from blockscope.inputs.partial import for_run

    params = o.flat()
    if "out_dir" not in params:
        return None
    return for_run(Path(params["out_dir"] or "results"), o.name, settings_digest(o),
                   bool(params.get("fresh")))


def write(o, stem: str, frames: dict, meta: dict, extra: dict | None = None,
          shown: list | None = None) -> Result:
    """The command's Result: `{suffix: DataFrame}` for `<stem><suffix>-<digest>.csv`, the
    sidecar for `<stem>-<digest>.json`, `extra` (`{filename: a Figure, a function drawing
    one, or text}`) and `shown` (what the command line prints: renderables, or (renderable,
    print options) pairs). Whoever runs the command saves it: the command line into
    --out-dir (`saved`), the Python face on request."""
    pictures, texts = {}, {}
    for name, content in (extra or {}).items():
        if isinstance(content, str):
            texts[name] = content
        else:
            pictures[name] = content if callable(content) and not hasattr(
                content, "savefig") else (lambda fig=content: fig)
    return Result(o.name, stem, settings_digest(o),
                  {table_name(suffix): df for suffix, df in frames.items()}, meta, pictures,
                  texts, [thing if isinstance(thing, tuple) else (thing, {})
                          for thing in shown or ()], html=o.out.html)


def line(text: str, **options) -> tuple:
    """A plain line for `shown`: printed literally (no highlighting), as the commands print
    their headlines."""
    return (text, {"highlight": False, **options})


def saved(result: Result, out_dir: Path, quiet: bool) -> list[Path]:
    """Write `result`'s files into `out_dir`; say where, and say so when files of an earlier
    run with the same settings were replaced."""
    from blockscope.api.console import err, out

    files = result.files()
    replaced = [name for name in files if (out_dir / name).exists()]
    paths = result.save(out_dir)
    csvs = [p for p in paths if p.suffix == ".csv"]
    if replaced:
        err.print(f"replaced the results of an earlier run with the same settings "
                  f"({len(replaced)} files, settings {result.digest})", highlight=False,
                  soft_wrap=True)
    if quiet:
        out.print(str(csvs[0]), highlight=False, soft_wrap=True)
    else:
        out.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)
    return paths
