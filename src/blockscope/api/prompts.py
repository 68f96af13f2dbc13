"""A prompt from the command line: the argument or --text, and its refusals before the
model loads (tokenizer and config.json alone) and after."""

from __future__ import annotations

from dataclasses import dataclass

from blockscope.errors import BlockscopeError


def early_tokens(tokenizer, sizes, text: str, prepend_bos: bool, check_text=None):
    """The prompt's tokens `(1, pos)` from the tokenizer and the config's sizes alone (what
    `loading.open_model` hands its `before` check), checked against the context and by
    `check_text(tokenizer, tokens)` before the model loads: a bad prompt is refused in a
    second, not after a load."""
    from blockscope.inputs.text import tokenize

    tokens = tokenize(tokenizer, text, prepend_bos=prepend_bos)
    if check_text is not None:
        check_text(tokenizer, tokens)
    n_ctx = (sizes or {}).get("n_ctx")
    if n_ctx is not None and tokens.shape[-1] > n_ctx:
        raise BlockscopeError(f"{tokens.shape[-1]:,} tokens, the model's context is {n_ctx:,}")
    return tokens


def one_token_each(**given):
    """A `check_text` holding each option given (`target=" Paris"`, `contrast=None`: not
    given) to one token of the model's tokenizer."""
    from blockscope.experiments.logit_lens import target_id

    def check(tokenizer, tokens) -> None:
        for option, text in given.items():
            if text is not None:
                target_id(tokenizer, text, option)

    return check


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


@dataclass
class PromptRun:
    """What the prompt commands share: the prompt, the loaded model and its tokens."""

    text: str  # the prompt
    source: dict  # where it came from, for the sidecar
    spec: object  # loading.ModelSpec
    model: object  # TransformerBridge
    tokens: object  # (1, pos) token ids, BOS as asked

    def shown(self, width: int = 40) -> str:
        """The prompt cut to `width` characters, for a picture's title."""
        return self.text if len(self.text) <= width else self.text[: width - 3] + "..."

    def meta(self, command: str, prepend_bos: bool, started: float, **more) -> dict:
        """The sidecar fields every prompt command records, plus `more`."""
        import time

        from blockscope.api.common import model_record
        from blockscope.results.files import sidecar

        return sidecar(command=command, **more, model=model_record(self.spec, self.model),
                       text=self.source, n_tokens=int(self.tokens.shape[-1]),
                       tokens=self.tokens[0].tolist(), prepend_bos=prepend_bos,
                       dtype=self.spec.dtype, device=self.spec.device,
                       wall_time_s=round(time.perf_counter() - started, 3))


def prompt_run(prompt, load, *, prepend_bos: bool, quiet: bool, bos_token: str | None = None,
               processed: bool = False, check=None, check_length=None,
               check_text=None) -> PromptRun:
    """Read the prompt (`options.Prompt`), refuse what its tokens or the config rule out
    before the model loads (`check(sizes)`, `check_length(n_tokens)`, `check_text(tokenizer,
    tokens)`: a subject, a target), load it as `load` (`options.Load`) says and tokenize the
    prompt."""
    from blockscope.api.common import checked_load, model_spec
    from blockscope.inputs.text import tokenize


    text, source = prompt.read()
    spec = model_spec(load.model, load.held, device=load.device, dtype=load.dtype.value,
                      processed=processed, bos_token=bos_token)
    def before(tokenizer, sizes):  # the prompt, refused from the tokenizer and config alone
        early = early_tokens(tokenizer, sizes, text, prepend_bos, check_text)
        if check_length is not None:
            check_length(early.shape[-1])

    lm = checked_load(spec, load.allow_pickle, quiet, check, load.held, before)
    tokens = tokenize(lm.tokenizer, text, prepend_bos=prepend_bos)
    check_context(tokens, lm)
    if check_length is not None:
        check_length(tokens.shape[-1])
    if check_text is not None:
        check_text(lm.tokenizer, tokens)
    return PromptRun(text, source, spec, lm, tokens)


@dataclass
class TwoPrompts(PromptRun):
    """A clean prompt and a corrupted one of the same length."""

    other: object = None  # (1, pos) the corrupted prompt's token ids


def two_prompts(clean: str, corrupted: str, load, prepend_bos: bool, bos_token, quiet: bool,
                check_lengths, check_text=None) -> TwoPrompts:
    """Both prompts tokenized, their lengths held equal by `check_lengths(n, m)` and the
    clean one checked by `check_text(tokenizer, tokens)` before the model loads where the
    tokenizer is at hand without it, and after."""
    from blockscope.api.common import checked_load, model_spec
    from blockscope.inputs.text import tokenize


    if not clean.strip() or not corrupted.strip():
        raise BlockscopeError("the clean and the corrupted prompt must not be empty")
    spec = model_spec(load.model, load.held, device=load.device, dtype=load.dtype.value,
                      bos_token=bos_token)
    def before(tokenizer, sizes):  # both prompts, from the tokenizer and config alone
        early = [early_tokens(tokenizer, sizes, t, prepend_bos, c)
                 for t, c in ((clean, check_text), (corrupted, None))]
        check_lengths(early[0].shape[-1], early[1].shape[-1])

    lm = checked_load(spec, load.allow_pickle, quiet, held=load.held, before=before)
    a, b = (tokenize(lm.tokenizer, t, prepend_bos=prepend_bos) for t in (clean, corrupted))
    check_lengths(a.shape[-1], b.shape[-1])
    if check_text is not None:
        check_text(lm.tokenizer, a)
    check_context(a, lm)
    return TwoPrompts(clean, {"prompt": clean}, spec, lm, a, b)
