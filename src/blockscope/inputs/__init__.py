"""What is measured on: a passage or prompt (text), a corpus as documents (corpus), and which
of them this process scores under torchrun (parallel)."""

from blockscope.inputs.corpus import Docs, Source, as_docs, load_docs
from blockscope.inputs.text import Window, read_passage, tokenize, windows

__all__ = ["Docs", "Source", "Window", "as_docs", "load_docs", "read_passage", "tokenize",
           "windows"]
