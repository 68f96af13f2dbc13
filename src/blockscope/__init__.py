"""blockscope: a command-line lab for looking inside a Transformer block."""

from blockscope.versions import __version__  # noqa: F401
