"""blockscope: a lab for looking inside a Transformer block, from the command line or Python.

    import blockscope as bs
    model = bs.load("smollm2-135m")
    result = bs.ablate(model, part="mlp")
    result.table, result.meta, result.figure(), result.save("results")

Every command is a function here, with the command's options as keywords (docs/python.md).
They are imported on first use, so `import blockscope` and `blockscope --help` stay light.
"""

from blockscope.versions import __version__  # noqa: F401

__all__ = [
    "BlockscopeError", "Result", "load",
    "ablate", "attention", "head_roles", "knockout", "layernorm", "logit_lens", "mlp_memory",
    "norm_placement", "params", "patch", "prune_blocks", "prune_heads", "rearrange",
    "reproduce", "resid_norm", "shapes", "trace",
]


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
    from blockscope.api import face

    found = face.load if name == "load" else face.face(name.replace("_", "-"))
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
