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


def mask_heads(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Hook]:
    """Scale each head's z by `keep` (n_layers, n_heads); a removed head gets `fill` instead.

    z' = keep * z + (1 - keep) * fill[layer] (fill (n_heads, d_head), default zeros), so
    keep=1 leaves a head alone, keep=0 removes it, and a `keep` that requires grad is
    Michel et al.'s head mask. Layers whose heads are all kept get no hook (unless `keep`
    requires grad).
    """
    hooks = []
    for layer in range(keep.shape[0]):
        if not keep.requires_grad and bool((keep[layer] == 1).all()):
            continue

        def hook(z: torch.Tensor, hook=None, layer=layer) -> torch.Tensor:
            k = keep[layer].to(z.dtype)[:, None]  # (n_heads, 1), broadcast over d_head
            out = z * k  # z: (batch, pos, n_heads, d_head)
            if fill is not None and layer in fill:
                out = out + (1 - k) * fill[layer].to(z.dtype)
            return out

        hooks.append((f"blocks.{layer}.attn.hook_z", hook))
    return hooks
