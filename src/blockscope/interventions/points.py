"""Where interventions hook in, and how they are put on a model: TransformerLens hook points
by name, or torch forward pre-hooks on a block itself (`BlockPreHook`), both added for a
`with` block by `applied` and removed however it ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

Hook = tuple[str, Callable]  # (hook point name, or a BlockPreHook; the function)


@dataclass(frozen=True)
class BlockPreHook:
    """Where a hook is a torch forward pre-hook (with kwargs) on block `layer` itself, not a
    TransformerLens hook point: it sees the arguments the model passes the block."""

    layer: int


def hooks(edits) -> list[Hook]:
    """The hooks that carry out `edits` (each one's `apply`): what the naive loop runs."""
    return [h for e in edits for h in e.hooks()]


@contextmanager
def applied(model, hooks: list[Hook]) -> Iterator[None]:
    """Run the body with `hooks` on `model` (hook points by name, and `BlockPreHook`s); they
    are removed however the body ends."""
    if not hooks:
        yield
        return
    points = [h for h in hooks if not isinstance(h[0], BlockPreHook)]
    handles = [model.blocks[where.layer].register_forward_pre_hook(fn, with_kwargs=True)
               for where, fn in hooks if isinstance(where, BlockPreHook)]
    try:
        if points:
            with model.hooks(fwd_hooks=points):
                yield
        else:
            yield
    finally:
        for h in handles:
            h.remove()
