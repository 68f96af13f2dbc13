"""Fixtures of the command-line tests."""

import pytest


@pytest.fixture
def no_load(monkeypatch):
    """The weights must not load: the refusal has to come before (from the options, the
    text, the tokenizer or the config, inside `loading.open_model` or before it)."""
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr("blockscope.model.loading.load_model", fail)
