"""blockscope: a command-line lab for looking inside a Transformer block."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("blockscope")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
