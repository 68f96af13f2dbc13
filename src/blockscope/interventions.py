"""Hook factories for ablations, applied through a context manager that always removes them.

A hook list is TransformerLens's `[(hook_name, fn), ...]`; `applied(model, hooks)` adds it for
the duration of a `with` block (TransformerLens's `model.hooks`, which removes in `finally`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Hook = tuple[str, Callable]
PART_HOOKS = {"attn": "hook_attn_out", "mlp": "hook_mlp_out"}  # a half's write to the stream


@contextmanager
def applied(model, hooks: list[Hook]) -> Iterator[None]:
    """Run the body with `hooks` on `model`; they are removed however the body ends."""
    if not hooks:
        yield
        return
    with model.hooks(fwd_hooks=hooks):
        yield


def replace_with(value: torch.Tensor | None) -> Callable:
    """A hook that replaces an activation by zeros (`value=None`) or by a broadcast `value`."""

    def hook(act: torch.Tensor, hook=None) -> torch.Tensor:  # act: (batch, pos, ...)
        return torch.zeros_like(act) if value is None else value.to(act.dtype).expand_as(act)

    return hook


def skip_block(layer: int, delta: torch.Tensor | None = None) -> list[Hook]:
    """Block `layer`'s output := its input (+ `delta`, e.g. its mean clean contribution)."""
    stash: list[torch.Tensor] = []

    def save(resid_pre: torch.Tensor, hook=None) -> None:  # (batch, pos, d_model)
        stash.append(resid_pre)

    def restore(resid_post: torch.Tensor, hook=None) -> torch.Tensor:
        resid_pre = stash.pop()
        return resid_pre if delta is None else resid_pre + delta.to(resid_pre.dtype)

    return [(f"blocks.{layer}.hook_resid_pre", save), (f"blocks.{layer}.hook_resid_post", restore)]


def remove_part(layer: int, part: str, value: torch.Tensor | None = None) -> list[Hook]:
    """Remove block `layer`'s `part` ("block", "attn" or "mlp"): zero it, or write `value`."""
    if part == "block":
        return skip_block(layer, value)
    return [(f"blocks.{layer}.{PART_HOOKS[part]}", replace_with(value))]
