"""What a --model, --device and --dtype resolve to, before anything loads.

`resolve` (called through `loading.spec_for`) turns the command line's names into a
`ModelSpec` (recorded in every sidecar), failing fast on a device or dtype this machine
does not have; `loading` then loads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from blockscope.choices import Dtype
from blockscope.errors import BadValue

DTYPES = {Dtype.float32: torch.float32, Dtype.float16: torch.float16,
          Dtype.bfloat16: torch.bfloat16}  # each choice, as a torch dtype


@dataclass(frozen=True)
class ModelSpec:
    """What the user asked for, resolved; recorded in every JSON sidecar."""

    name: str  # as given on the command line: hub id or directory
    source: str  # hub id after alias resolution, or the directory's absolute path
    is_local: bool  # a local checkpoint directory rather than a hub id
    device: str  # torch device string actually used
    dtype: str  # key of DTYPES
    processed: bool  # TransformerLens compatibility mode (folded norms, centred weights)
    fetched: str | None = None  # a model blockscope fetches itself (fetch.MODELS), by name
    fallback_from: str | None = None  # the default model that could not be had, if any
    bos_token: str | None = None  # --bos-token: the BOS text to prepend instead of the
    #   model's document-start token (text.choose_bos)

    @property
    def label(self) -> str:
        """For titles: the directory's name (not its whole path) or the hub id, and the
        dtype when it is not float32."""
        base = Path(self.source).name if self.is_local else self.name
        return base if self.dtype == "float32" else f"{base} ({self.dtype})"

    @property
    def slug(self) -> str:
        """A filename-safe short name: the directory's name, or the hub id with / as --."""
        base = Path(self.source).name if self.is_local else self.source.replace("/", "--")
        base += "" if self.dtype == "float32" else f"-{self.dtype}"  # the dtype shows
        return re.sub(r"[^A-Za-z0-9._-]+", "_", base) or "model"


def resolve_device(device: str) -> str:
    """`auto` -> cuda if present else cpu; refuse a device this machine does not have."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise BadValue(f"unknown `device` {device!r} (try auto, cpu, cuda, cuda:1, mps)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadValue(f"`device` {device}: no CUDA device is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadValue(
                f"`device` {device}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise BadValue(f"`device` {device}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise BadValue(f"`device` {device}: unsupported device type {dev.type!r}")
    return str(dev)


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise BadValue(f"unknown `dtype` {dtype!r} (choose {', '.join(DTYPES)})")


def looks_like_path(name: str) -> bool:
    """A --model that can only mean a path: ./x, /x, ~/x, x/, a/b/c, or a .json file
    (hub ids are `name` or `org/name`)."""
    return (name.startswith((".", "/", "~")) or name.endswith(("/", ".json"))
            or name.count("/") >= 2)


DEFAULT_MODEL = "gpt2"  # what runs when no --model is named, where it can be had
OFFLINE_MODEL = "smollm2-135m"  # what runs instead where it cannot (fetch.MODELS)


def resolve(
    name: str | None, *, device: str = "auto", dtype: str = "float32",
    processed: bool = False, bos_token: str | None = None,
    can_load: Callable[[str], bool] = lambda name: True,
) -> ModelSpec:
    """Resolve names without loading anything: fails fast on a bad device or dtype.

    `name` None: GPT-2 small where `can_load` says it can be had (`loading.spec_for` asks
    the HF cache and the hub), else the offline model, recorded as `fallback_from`. A name
    in `fetch.MODELS` (and no folder of that name here) is the folder it is fetched into."""
    from blockscope.model import fetch

    resolve_dtype(dtype)
    dev = resolve_device(device)
    extra = dict(bos_token=bos_token)
    if name is None:
        if can_load(DEFAULT_MODEL):
            name = DEFAULT_MODEL
        else:
            name, extra["fallback_from"] = OFFLINE_MODEL, DEFAULT_MODEL
    path = Path(name).expanduser()
    if name in fetch.MODELS and not path.exists():
        return ModelSpec(name, str(fetch.model_dir(name)), True, dev, dtype, processed,
                         fetched=name, **extra)
    if path.exists() or looks_like_path(name):
        if not path.exists():
            raise BadValue(f"`model` {name}: no such directory")
        return ModelSpec(name, str(path.resolve()), True, dev, dtype, processed, **extra)
    from transformer_lens.tools.model_registry.registry_io import resolve_model_alias

    return ModelSpec(name, resolve_model_alias(name) or name, False, dev, dtype, processed,
                     **extra)
