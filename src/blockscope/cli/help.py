"""Help that keeps what it quotes whole: Click wraps help at a hyphen (`resid-` / `pre`) and
at the space inside a quoted token (`('` / `Paris')`), so a user copying from an 80-column
`--help` gets another option or loses the leading space the text says is required. Here a
quoted literal and a hyphenated word are never broken, and each command's summary in
`blockscope --help` is its help's whole first paragraph, not cut with `...`."""

from __future__ import annotations

import contextlib
import re

from typer.core import TyperCommand, TyperGroup

try:  # Typer 0.2x vendors Click
    from typer import _click as click
    from typer._click import formatting
except ImportError:  # pragma: no cover
    import click
    from click import formatting

# a quoted literal: a quote after a space, "(", "[", "=" or the start, up to its closing
# quote before a space, punctuation or the end ("the model's", "al.'s" are no literals),
# within a paragraph (a docstring may break it across lines)
LITERAL = re.compile(r"""(?<![^\s(\[=])(['"])((?:[^'"\n]|\n(?![ \t]*\n))*?)\1(?!\w)""")
HYPHEN = re.compile(r"(?<=\w)-(?=\w)")
SPACE, DASH = "\ue000", "\ue001"  # stand-ins (private use: no space, no line break)


def _kept_whole(text: str) -> str:
    text = LITERAL.sub(lambda m: re.sub(r"\s+", SPACE, m[0]), text)
    return HYPHEN.sub(DASH, text)


_wrap = formatting.wrap_text


def wrap_text(text: str, *args, **kwargs) -> str:
    """Click's wrap_text, never breaking a quoted literal or a hyphenated word."""
    return _wrap(_kept_whole(text), *args, **kwargs).replace(SPACE, " ").replace(DASH, "-")


@contextlib.contextmanager
def _literals_kept():
    formatting.wrap_text = wrap_text
    try:
        yield
    finally:
        formatting.wrap_text = _wrap


class Formatter(formatting.HelpFormatter):
    """Click's help formatter, wrapping with `wrap_text`."""

    def write_text(self, text: str) -> None:
        with _literals_kept():
            super().write_text(text)

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        with _literals_kept():
            super().write_dl(rows, col_max, col_spacing)

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        with _literals_kept():
            super().write_usage(prog, args, prefix)


class Context(click.Context):
    formatter_class = Formatter


class Command(TyperCommand):
    context_class = Context

    def get_short_help_str(self, limit: int = 45) -> str:
        """The help's first paragraph, whole (Click cuts it to `limit` with `...`)."""
        return " ".join((self.help or "").split("\n\n")[0].split())


class Group(TyperGroup):
    context_class = Context
