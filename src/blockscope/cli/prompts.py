"""A prompt from the command line: the argument or --text, and its refusals before the
model loads (tokenizer and config.json alone) and after."""

from __future__ import annotations

from pathlib import Path

from blockscope.errors import BlockscopeError


def prompt_text(prompt: str | None, text_file: Path | None) -> tuple[str, dict]:
    """The prompt from the argument or --text, and how to record where it came from."""
    from blockscope.inputs.text import as_prompt, read_passage

    if prompt is None and text_file is None:
        raise BlockscopeError("give the prompt as an argument or with --text FILE")
    if prompt is not None and text_file is not None:
        raise BlockscopeError("give the prompt as an argument or with --text FILE, not both")
    if text_file is not None:
        passage = read_passage(text_file)
        text, stripped = as_prompt(passage.text)
        if not text.strip():
            raise BlockscopeError(f"--text {passage.path}: the prompt is empty")
        return text, {"path": str(passage.path), "sha256": passage.sha256, "stripped": stripped}
    if not prompt.strip():
        raise BlockscopeError("the prompt is empty")
    return prompt, {"prompt": prompt}


def early_tokens(spec, text: str, prepend_bos: bool):
    """The prompt's tokens `(1, pos)` from the tokenizer and config.json alone, checked
    against the context, before the model loads (a bad prompt is refused in a second, not
    after a load); None when neither is at hand without loading: the load then checks."""
    from blockscope.inputs.text import tokenize
    from blockscope.model.loading import peek_sizes, peek_tokenizer

    tokenizer = peek_tokenizer(spec)
    if tokenizer is None:
        return None
    tokens = tokenize(tokenizer, text, prepend_bos=prepend_bos)
    n_ctx = (peek_sizes(spec) or {}).get("n_ctx")
    if n_ctx is not None and tokens.shape[-1] > n_ctx:
        raise BlockscopeError(f"{tokens.shape[-1]:,} tokens, the model's context is {n_ctx:,}")
    return tokens


def check_context(tokens, model) -> None:
    """Refuse a prompt longer than the model's context before anything runs."""
    n, n_ctx = int(tokens.shape[-1]), int(model.cfg.n_ctx)
    if n > n_ctx:
        raise BlockscopeError(f"{n:,} tokens, the model's context is {n_ctx:,}")


def pick_positions(n: int, position: int, every: bool) -> list[int]:
    """The token positions of an n-token prompt that `--position` / `--all-positions`
    name (negative counts from the end), or a refusal."""
    from blockscope.experiments.resid_norm import check_positions

    if every:
        return list(range(n))
    check_positions([position], n)
    return [position % n]
