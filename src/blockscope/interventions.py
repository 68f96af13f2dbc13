"""Interventions as data, their one definition as hooks, and a context manager for hooks.

An `Edit` says what changes (a block, one half's write, or heads), at which layer, and what
is written instead (nothing, or a clean mean). `hooks(edits)` is its only definition as
TransformerLens hooks `[(hook_name, fn), ...]`: the naive loop runs exactly these, and the
engine (engine.py) derives from the same records where a variant first departs from the
clean pass, running these hooks wherever it cannot enter later. `applied(model, hooks)` adds
hooks for the duration of a `with` block (TransformerLens's `model.hooks`, which removes them
in `finally`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

Hook = tuple[str, Callable]
PART_HOOKS = {"attn": "hook_attn_out", "mlp": "hook_mlp_out"}  # a half's write to the stream
COMPONENTS = ("block", "attn", "mlp", "heads")


@dataclass(frozen=True, eq=False)
class Edit:
    """One change to the forward pass: a pyvene-style intervention record."""

    component: str  # "block" (output := input), "attn"/"mlp" (that half's write), "heads"
    layer: int  # 0-based block index
    fill: torch.Tensor | None = None  # written instead: None (nothing) or a clean mean:
    #   block/attn/mlp (d_model,) (for a block: its mean contribution post - pre);
    #   heads (n_heads, d_head), the mean z of each head
    keep: torch.Tensor | None = None  # heads only: (n_heads,) scale per head, 0 removes it

    def __post_init__(self):
        if self.component not in COMPONENTS:
            raise ValueError(f"unknown component {self.component!r}")
        if (self.component == "heads") != (self.keep is not None):
            raise ValueError("`keep` goes with component 'heads', and only with it")


def hooks(edits) -> list[Hook]:
    """The hooks that carry out `edits`: the one definition every engine runs."""
    out: list[Hook] = []
    for e in edits:
        if e.component == "heads":
            out.append((f"blocks.{e.layer}.attn.hook_z", scale_heads(e.keep, e.fill)))
        else:
            out += remove_part(e.layer, e.component, e.fill)
    return out


def head_edits(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Edit]:
    """One heads Edit per layer whose row of `keep` (n_layers, n_heads) is not all ones
    (every layer when `keep` requires grad: Michel et al.'s head mask)."""
    return [Edit("heads", layer, (fill or {}).get(layer), keep[layer])
            for layer in range(keep.shape[0])
            if keep.requires_grad or not bool((keep[layer] == 1).all())]


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


def scale_heads(keep: torch.Tensor, fill: torch.Tensor | None) -> Callable:
    """A hook on `attn.hook_z`: z' = keep * z + (1 - keep) * fill per head, so keep=1 leaves
    a head alone and keep=0 removes it (fill (n_heads, d_head), default zeros)."""

    def hook(z: torch.Tensor, hook=None) -> torch.Tensor:  # z: (batch, pos, n_heads, d_head)
        k = keep.to(z.dtype)[:, None]  # (n_heads, 1), broadcast over d_head
        out = z * k
        return out if fill is None else out + (1 - k) * fill.to(z.dtype)

    return hook


def mask_heads(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Hook]:
    """Hooks that scale each head's z by `keep` (n_layers, n_heads): `hooks(head_edits(...))`."""
    return hooks(head_edits(keep, fill))
