"""Fixtures of the command-line tests."""

import pytest

from blockscope.api import common


@pytest.fixture
def no_load(monkeypatch):
    """The model must not load: the refusal has to come before."""
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr(common, "load", fail)
    monkeypatch.setattr("blockscope.model.loading.load_model", fail)
