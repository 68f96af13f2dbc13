"""One settings bundle: how a sweep runs is one checked value, and no experiment takes its
parts as loose parameters."""

import importlib
import inspect
import pkgutil

import pytest

from blockscope.errors import BadValue
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.stats import Bootstrap

LOOSE = {"stride", "engine", "engine_name", "batch_size", "ci", "seed", "progress"}


def test_settings_are_checked_when_made_and_compared_as_values():
    with pytest.raises(BadValue, match="^engine must be one of cached, naive"):
        RunSettings(engine="fast")
    for name in ("stride", "batch_size"):
        with pytest.raises(BadValue, match=f"^{name} must be at least 1"):
            RunSettings(**{name: 0})
    a = RunSettings(stride=64, ci=Bootstrap(100), seed=3)
    assert a.engine == "cached" and RunSettings(engine="naive").engine == "naive"
    assert a == RunSettings(stride=64, ci=Bootstrap(100), seed=3).reporting(print)
    assert a.reporting(print).progress is print and a.reporting(print).quiet().progress is None
    with pytest.raises(AttributeError):
        a.stride = 32  # frozen: one value passed down unchanged


def test_no_experiment_takes_the_settings_as_loose_parameters():
    """Every function in experiments/ and the sweeps' public face takes `settings`, never
    the stride, engine, batch size, intervals, seed or progress one by one."""
    import blockscope.experiments as pkg
    from blockscope.sweeps import interchange, scoring

    modules = [importlib.import_module(m.name)
               for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}.") if not m.ispkg]
    assert "blockscope.experiments.reproduce.figures" in {m.__name__ for m in modules}
    loose = []
    for module in [*modules, scoring, interchange]:
        for name, fn in vars(module).items():
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            params = set(inspect.signature(fn).parameters)
            if "settings" in params or name.startswith("_"):
                continue
            hit = params & LOOSE
            if len(hit) >= 2 or hit & {"engine", "engine_name", "batch_size", "ci"}:
                loose.append(f"{module.__name__}.{name}({', '.join(sorted(hit))})")
    assert not loose, loose
