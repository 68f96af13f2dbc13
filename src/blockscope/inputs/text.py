"""Text in, tokens out: read and validate a passage, tokenize it, cut it into windows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from blockscope.errors import BadValue, BlockscopeError


@dataclass(frozen=True)
class Passage:
    """A validated text file."""

    path: Path  # as given
    text: str  # decoded UTF-8 content
    sha256: str  # of the file's bytes, recorded in the sidecar

    @property
    def where(self) -> str:
        """The file's absolute path, links resolved: what a sidecar records, the same
        whichever folder the command ran from."""
        return str(self.path.resolve())


@dataclass(frozen=True)
class Window:
    """One forward pass of a strided sliding window (HF's perplexity guide)."""

    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    first_target: int  # tokens first_target..end-1 are scored here, each exactly once overall

    @property
    def offset(self) -> int:
        """The first scored position within the window (its logits come from offset - 1)."""
        return self.first_target - self.begin


DEFAULT_TEXT = Path("data/alice.txt")  # the commands' default --text


def packaged_alice() -> Path:
    """The Alice passage installed with blockscope."""
    from importlib.resources import files

    return Path(str(files("blockscope") / "data" / "alice.txt"))


def read_passage(path: str | Path) -> Passage:
    """Read a UTF-8 text file, refusing missing, empty, binary or non-UTF-8 files. The
    default `data/alice.txt`, run from a folder without it, is the installed copy."""
    p = Path(path)
    if not p.exists() and p == DEFAULT_TEXT and packaged_alice().is_file():
        p = packaged_alice()
    if not p.exists():
        raise BadValue(f"`text` {p}: no such file")
    if not p.is_file():
        raise BadValue(f"`text` {p}: not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise BadValue(f"`text` {p}: cannot read it ({exc.strerror})")
    if b"\x00" in raw:
        raise BadValue(f"`text` {p}: looks binary (it contains NUL bytes), not text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadValue(f"`text` {p}: not valid UTF-8 (byte {exc.start}); if it is "
                              f"Latin-1, convert it: iconv -f latin1 -t utf-8 {p} > out.txt")
    if not text:
        raise BadValue(f"`text` {p}: the file is empty")
    if not text.strip():
        raise BadValue(f"`text` {p}: the file holds only whitespace")
    return Passage(p, text, hashlib.sha256(raw).hexdigest())


def as_prompt(text: str) -> tuple[str, list[str]]:
    """A prompt file's text as the prompt it holds: without a UTF-8 byte-order mark and
    without the one trailing newline editors add; and what was stripped, to record."""
    stripped = []
    if text.startswith("\ufeff"):
        text, stripped = text[1:], ["byte-order mark"]
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            text = text[: -len(end)]
            stripped.append("trailing newline")
            break
    return text, stripped


DOCUMENT_SEPARATORS = ("<|endoftext|>",)  # what pretraining corpora put between documents


def choose_bos(tokenizer, override: str | None = None) -> dict:
    """Make the tokenizer's BOS the token the model saw at document starts, and say which.

    `override` (--bos-token): that token, which must be one token of the vocabulary.
    Otherwise the tokenizer's own BOS, unless its chat template writes it (a chat-turn
    marker, such as SmolLM2's `<|im_start|>`) and the vocabulary has a document separator
    (`<|endoftext|>`): then that. Returns {id, text, reason} for the sidecars; the tokenizer's
    `bos_token` is set to it, so every command and TransformerLens prepend the same token.
    The choice is made from the tokenizer's own BOS, kept aside the first time, so a model
    held across commands (the Python face) gets the same choice and reason each time."""
    if not hasattr(tokenizer, "blockscope_own_bos"):
        tokenizer.blockscope_own_bos = tokenizer.bos_token
    if override is not None:
        ids = tokenizer.encode(override, add_special_tokens=False)
        if len(ids) != 1:
            raise BadValue(f"`bos_token` {override!r} is {len(ids)} tokens of this "
                                  "model's tokenizer, not one")
        text, reason = tokenizer.convert_ids_to_tokens(ids[0]), "given with --bos-token"
    else:
        text = tokenizer.blockscope_own_bos
        if text is None:
            return {"id": None, "text": None, "reason": "the tokenizer has no BOS token"}
        template = getattr(tokenizer, "chat_template", None) or ""
        vocab = tokenizer.get_vocab()
        separator = next((s for s in DOCUMENT_SEPARATORS if s in vocab and s != text), None)
        if text in template and separator is not None:
            text, reason = separator, (
                f"the tokenizer's BOS {tokenizer.blockscope_own_bos!r} marks a chat turn (its chat "
                f"template writes it); {separator!r}, the document separator, is what the "
                "model saw at document starts in pretraining")
        else:
            reason = "the tokenizer's BOS token"
    tokenizer.bos_token = text
    return {"id": int(tokenizer.bos_token_id), "text": text, "reason": reason}


def tokenize(
    tokenizer, text: str, *, prepend_bos: bool, max_tokens: int | None = None
) -> torch.Tensor:
    """Token ids `(1, pos)`: the text's first `max_tokens` tokens, after BOS if asked.

    `max_tokens` counts the text's own tokens, never BOS.
    """
    if max_tokens is not None and max_tokens < 2:
        raise BadValue(f"`max_tokens` must be at least 2 (got {max_tokens})")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if prepend_bos:
        if tokenizer.bos_token_id is None:
            raise BadValue("the tokenizer has no BOS token; use `no_prepend_bos`")
        ids = [tokenizer.bos_token_id, *ids]
    if len(ids) < 2:
        raise BlockscopeError(f"the text gives {len(ids)} token{'s' * (len(ids) != 1)}"
                              f"{' with BOS' if prepend_bos else ''}: fewer than 2, "
                              "nothing to predict")
    return torch.tensor([ids], dtype=torch.long)  # (1, pos)


def windows(n_tokens: int, n_ctx: int, stride: int) -> list[Window]:
    """Strided sliding windows of at most `n_ctx` tokens that score tokens 1..n-1 once each.

    Every window after the first starts `stride` tokens later and scores only the tokens
    the previous window did not, so each scored token sees up to `n_ctx - stride` tokens of
    context that were scored before (the method of HF's perplexity guide).
    """
    if not 1 <= stride < n_ctx:
        # stride == n_ctx would leave each window's first token unscored (no context)
        raise BadValue(f"`stride` must be between 1 and {n_ctx - 1} (context {n_ctx})")
    out: list[Window] = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + n_ctx, n_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text, as data files keep it (` is`, not the tables' `␣is`)."""
    return tokenizer.decode([token_id])


def visible(text: str) -> str:
    """A token's text for a table or picture: spaces as '␣', newlines as '\\n', tabs as
    '\\t' (an empty label would read as nothing)."""
    return str(text).replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") or "∅"

