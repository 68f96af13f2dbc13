"""The model: what --model names (spec), what its local files say before it loads (peek),
its loading (the only module that reaches the hub), the offline model blockscope fetches
itself (fetch), each family's record (arch) and the HF side of each family that the
engine's replays read (adapters)."""

from blockscope.model.arch import REGISTRY, Family, Layout, config_get, family, layout
from blockscope.model.loading import load_model, spec_for

__all__ = ["REGISTRY", "Family", "Layout", "config_get", "family", "layout", "load_model",
           "spec_for"]
