"""blockscope: a lab for looking inside a Transformer block, from the command line or Python.

    import blockscope as bs
    model = bs.load("smollm2-135m")
    result = bs.ablate(model, part="mlp")
    result.table, result.meta, result.figure(), result.save("results")

Every command is a function here, with the command's options as keywords (docs/python.md).
Your own interventions and metrics run on the same engine through `bs.sweep`, with `bs.Site`,
`bs.Edit`, `bs.Variant`, `bs.Run` and the metric classes (docs/extending.md). They are
imported on first use, so `import blockscope` and `blockscope --help` stay light.
"""

from blockscope.versions import __version__  # noqa: F401

__all__ = [
    "BlockscopeError", "Result", "load",
    "ablate", "attention", "attribute", "circuit", "head_roles", "knockout", "layernorm",
    "logit_lens", "mlp_memory", "norm_placement", "params", "patch", "prune_blocks",
    "prune_heads", "rearrange", "reproduce", "resid_norm", "shapes", "trace",
    # the extension API: your own variants and metrics on the engine (docs/extending.md)
    "AddNoise", "Edit", "EngineFallback", "Knockout", "LogitDiff", "Patch", "Run", "Site",
    "TargetLogProb", "TargetProb", "Variant", "sweep",
    # the removals, as edits (docs/extending.md)
    "remove_write", "scale_heads", "scale_neurons", "skip_block",
]
_EXTENSION = {  # name -> the module that holds it
    "AddNoise": "blockscope.interventions.interchange",
    "Edit": "blockscope.interventions.interchange",
    "Knockout": "blockscope.interventions.interchange",
    "Patch": "blockscope.interventions.interchange",
    "Site": "blockscope.interventions.interchange",
    "Run": "blockscope.sweeps.interchange",
    "Variant": "blockscope.sweeps.variant",
    "LogitDiff": "blockscope.sweeps.metrics",
    "TargetLogProb": "blockscope.sweeps.metrics",
    "TargetProb": "blockscope.sweeps.metrics",
    "remove_write": "blockscope.interventions.removals",
    "scale_heads": "blockscope.interventions.removals",
    "scale_neurons": "blockscope.interventions.removals",
    "skip_block": "blockscope.interventions.removals",
    "EngineFallback": "blockscope.api.sweep",
    "sweep": "blockscope.api.sweep",
}


def __getattr__(name: str):
    """The public face, imported on first use (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module 'blockscope' has no attribute {name!r}")
    if name == "BlockscopeError":
        from blockscope.errors import BlockscopeError

        return BlockscopeError
    if name == "Result":
        from blockscope.api.result import Result

        return Result
    if name in _EXTENSION:
        import importlib

        found = getattr(importlib.import_module(_EXTENSION[name]), name)
        globals()[name] = found
        return found
    from blockscope.api import face

    found = face.load if name == "load" else face.face(name.replace("_", "-"))
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
