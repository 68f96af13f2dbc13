"""Where interventions hook in, and how they are put on a model: TransformerLens hook points
by name, or torch forward pre-hooks on a block itself (`BlockPreHook`), both added for a
`with` block by `applied` and removed however it ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from blockscope.interventions.interchange import Site

Hook = tuple[str, Callable]  # (hook point name, or a BlockPreHook; the function)


@dataclass(frozen=True)
class BlockPreHook:
    """Where a hook is a torch forward pre-hook (with kwargs) on block `layer` itself, not a
    TransformerLens hook point: it sees the arguments the model passes the block."""

    layer: int


def hooks(edits, samples: int | None = None, sources: dict | None = None) -> list[Hook]:
    """The hooks that carry out `edits` (`interchange.Edit`s), the one function every naive
    loop runs: at each site, the activation with each edit's `apply(base, source)` written
    in turn (`Edit.written`), in the batch's first `samples` rows (None: every row). `sources`: the
    other runs' activations (run -> name -> act). A site an edit reads in its own run (a
    skipped block's input) is kept as the forward passes it, after any edit there."""
    sources = sources or {}
    own: dict = {}  # name -> this forward's activation, at the sites edits read from it
    by_name: dict[str, list] = {}
    for e in edits:
        by_name.setdefault(e.site.name, []).append(e)

    def write(group):
        def hook(act, hook=None):
            for e in group:
                act = e.written(act, samples, sources, own)
            return act

        return hook

    def keep(name):
        def hook(act, hook=None):
            own[name] = act

        return hook

    read = sorted({e.source.name for e in edits if isinstance(e.source, Site)})
    return [*[(name, write(group)) for name, group in by_name.items()],
            *[(name, keep(name)) for name in read]]


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
