"""The exception types the CLI turns into a single line on stderr."""

import re

_NAME = re.compile(r"`([a-z][a-z0-9_]*)`")
FLAGS = {"check_cells": "check"}  # parameters whose flag is not their name with dashes


class BlockscopeError(Exception):
    """Bad input or an unusable environment, explained in one sentence for the user."""


class _Named(BlockscopeError):
    """A message that names parameters in backticks, as the library calls them: str() reads
    `stride must be at least 1 (got 0)`, and the CLI says the flag (`--stride must be ...`)
    with `as_flag`."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(_NAME.sub(r"\1", template))

    def as_flag(self) -> str:
        return _NAME.sub(lambda m: "--" + FLAGS.get(m[1], m[1]).replace("_", "-"),
                         self.template)


class BadValue(_Named):
    """A value given is unusable."""


class ModelUnavailable(_Named):
    """The model is neither local nor cached, and the hub cannot be reached: not a broken
    checkpoint. `reproduce` goes on without it; everything else stops."""
