"""`Rearrange`: blocks run in another arrangement (Layers as Painters), one intervention whose
`apply` runs the window's new steps with whatever runs a block: the bridge's blocks in the
naive loop's hooks, the plain replay in the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockscope.interventions.points import BlockPreHook, Hook


@dataclass(frozen=True)
class Rearrange:
    """Blocks first..last (the window) replaced by `steps`: each step a tuple of block
    indices, one block run on the stream, or several run side by side on the same input
    with their writes summed (Layers as Painters' parallel layers). A block keeps its own
    weights and its own attention kind wherever it runs."""

    first: int
    last: int
    steps: tuple[tuple[int, ...], ...]
    name: str = ""  # how the user wrote it ("swap 3,4")
    component = "arrangement"

    @property
    def layer(self) -> int:
        return self.first

    def apply(self, x: torch.Tensor, run: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        """The window's output `(..., T, d_model)` from what block `first` received, with
        `run(j, x)` = block j on x."""
        for step in self.steps:
            if len(step) == 1:
                x = run(step[0], x)
            else:  # x + sum_j (block_j(x) - x)
                x = x + sum(run(j, x) - x for j in step)
        return x

    def order(self, n_layers: int) -> str:
        """The blocks as they now run, e.g. "0 1 3 2 4" ("(2+3)" for side by side)."""
        steps = [(j,) for j in range(self.first)] + list(self.steps) + [
            (j,) for j in range(self.last + 1, n_layers)]
        return " ".join(str(s[0]) if len(s) == 1 else "(" + "+".join(map(str, s)) + ")"
                        for s in steps)

    def hooks(self) -> list[Hook]:
        """What block `first` receives is kept; at block `last`'s output the window's
        output is computed again by `apply` from it, with the bridge's own blocks and the
        arguments the model passed each (recorded by torch pre-hooks on the blocks as it
        runs, any K/V cache dropped); the hooks stand aside while `apply` runs blocks."""
        from blockscope.model.adapters import replayable_call

        stash: list[torch.Tensor] = []
        busy = [False]
        recorded: dict[int, tuple] = {}

        def save(resid_pre, hook=None):
            if not busy[0]:
                stash.append(resid_pre)

        def run(j, x):
            block, args, kwargs = recorded[j]
            out = block(x, *args, **kwargs)
            return out[0] if isinstance(out, tuple) else out

        def restore(resid_post, hook=None):
            if busy[0]:
                return resid_post
            busy[0] = True
            try:
                return self.apply(stash.pop(), run)
            finally:
                busy[0] = False

        def record(j):
            def pre_hook(block, args, kwargs):
                if not busy[0]:
                    recorded[j] = (block, *replayable_call(args, kwargs))
            return pre_hook

        blocks = sorted({j for s in self.steps for j in s})
        return [(f"blocks.{self.first}.hook_resid_pre", save),
                (f"blocks.{self.last}.hook_resid_post", restore),
                *[(BlockPreHook(j), record(j)) for j in blocks]]
