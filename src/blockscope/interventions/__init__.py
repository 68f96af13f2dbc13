"""Interventions: what a variant writes instead, stated once, in `apply`.

An intervention is a small record (pyvene's intervention classes) at one layer, with one
`apply(base, source) -> activation'`, the only statement of what it writes instead: `base`
is the run's own activation there, `source` what is written in its place (for a skipped
block, its input; for the others, by default the record's fill: a clean mean or another
document's activation; none means zeros). The interchange interventions of patching,
tracing and knockout (interchange.py) share the protocol. Here:

- `SkipBlock`: the block's output := its input (+ a clean-mean fill);
- `RemoveWrite`: one half's write to the stream (`hook_attn_out`/`hook_mlp_out`) := zeros,
  or a clean mean;
- `ScaleHeads`: each head's z := keep * z + (1 - keep) * fill (keep 0 removes a head);
- `ScaleNeurons`: chosen MLP neurons' activations := 0, or their clean means;
- `Rearrange` (rearrange.py): a block order rather than an edit: blocks first..last
  replaced by the same blocks in another arrangement (swapped, reversed, repeated, or run
  side by side, their writes summed); its `apply` runs the window's steps.

Every engine uses `apply`: the naive loop runs it as TransformerLens hooks (`hooks`), the
cached engine (`entries.start`) applies it to the cached clean activation and carries the
change into the stream (as is for a write, through W_O for z), and the gradient replay
scales z with it. `applied(model, hooks)` (points.py) adds hooks for a `with` block
(TransformerLens's `model.hooks`, which removes them in `finally`). A new intervention is
one class here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockscope.interventions.points import BlockPreHook, Hook, applied, hooks
from blockscope.interventions.rearrange import Rearrange
from blockscope.interventions.value import Value

__all__ = ["BlockPreHook", "Hook", "Intervention", "Rearrange", "RemoveWrite", "Resampled",
           "ScaleHeads", "ScaleNeurons", "SkipBlock", "applied", "head_edits", "hooks",
           "intervention", "mask_heads", "resample"]
PART_HOOKS = {"attn": "hook_attn_out", "mlp": "hook_mlp_out"}  # a half's write to the stream
COMPONENTS = ("block", "attn", "mlp", "heads")


@dataclass(frozen=True, eq=False)
class SkipBlock(Value):
    """Block `layer` skipped: its output is its input, plus `fill` (d_model,) if given (its
    mean clean contribution, post - pre)."""

    layer: int
    fill: torch.Tensor | None = None
    component = "block"

    def apply(self, resid_post: torch.Tensor, resid_pre: torch.Tensor) -> torch.Tensor:
        """The block's output `(..., d_model)`, given what it received."""
        return resid_pre if self.fill is None else resid_pre + self.fill.to(resid_pre.dtype)

    def mean_points(self) -> list[str]:
        """The hook points whose clean means give the mean fill (`with_mean`)."""
        return [f"blocks.{self.layer}.hook_resid_pre", f"blocks.{self.layer}.hook_resid_post"]

    def with_mean(self, means: dict[str, torch.Tensor]) -> SkipBlock:
        """This skip with its mean clean contribution as the fill: mean post - mean pre."""
        pre, post = (means[n] for n in self.mean_points())
        return replace(self, fill=post - pre)

    def hooks(self) -> list[Hook]:
        stash: list[torch.Tensor] = []

        def save(resid_pre: torch.Tensor, hook=None) -> None:  # (batch, pos, d_model)
            stash.append(resid_pre)

        def restore(resid_post: torch.Tensor, hook=None) -> torch.Tensor:
            return self.apply(resid_post, stash.pop())

        return [(f"blocks.{self.layer}.hook_resid_pre", save),
                (f"blocks.{self.layer}.hook_resid_post", restore)]


@dataclass(frozen=True, eq=False)
class RemoveWrite(Value):
    """One half's write to the stream (`part` "attn" or "mlp") replaced by zeros, or by
    `fill` (d_model,), its clean mean."""

    part: str
    layer: int
    fill: torch.Tensor | None = None

    @property
    def component(self) -> str:
        return self.part

    @property
    def point(self) -> str:
        return f"blocks.{self.layer}.{PART_HOOKS[self.part]}"

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """What is written instead of the write `base` `(..., T, d_model)`: `source` (by
        default the fill: the clean mean (d_model,), or another document's write per
        position (T', d_model), read from position 0), or zeros without one."""
        source = self.fill if source is None else source
        if source is None:
            return torch.zeros_like(base)
        return _at_positions(source, base.shape[-2], 1).to(base.dtype).expand_as(base)

    def mean_points(self) -> list[str]:
        return [self.point]

    def with_mean(self, means: dict[str, torch.Tensor]) -> RemoveWrite:
        """This removal writing the half's clean mean instead."""
        return replace(self, fill=means[self.point])

    def hooks(self) -> list[Hook]:
        return [(self.point, lambda act, hook=None: self.apply(act))]


@dataclass(frozen=True, eq=False)
class ScaleHeads(Value):
    """Layer `layer`'s heads scaled by `keep` (n_heads,): keep 1 leaves a head alone, 0
    removes it, its z replaced by `fill` (n_heads, d_head) if given (its clean mean)."""

    layer: int
    keep: torch.Tensor
    fill: torch.Tensor | None = None
    component = "heads"

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """z' for z = `base` `(..., n_heads, d_head)`: keep * z + (1 - keep) * source per
        head (`source` by default the fill; none: the removed heads write nothing)."""
        source = self.fill if source is None else source
        k = self.keep.to(base.dtype)[:, None]  # (n_heads, 1), broadcast over d_head
        out = base * k
        if source is None:
            return out
        return out + (1 - k) * _at_positions(source, base.shape[-3], 2).to(base.dtype)

    def mean_points(self) -> list[str]:
        return [f"blocks.{self.layer}.attn.hook_z"]

    def with_mean(self, means: dict[str, torch.Tensor]) -> ScaleHeads:
        """These heads replaced by their clean mean z (n_heads, d_head) where removed."""
        return replace(self, fill=means[self.mean_points()[0]])

    def hooks(self) -> list[Hook]:
        return [(f"blocks.{self.layer}.attn.hook_z", lambda z, hook=None: self.apply(z))]


@dataclass(frozen=True, eq=False)
class ScaleNeurons(Value):
    """MLP neurons `neurons` of layer `layer` removed: their activation (what the MLP's
    output projection reads: after the nonlinearity, or act(gate) x up where gated) := 0,
    or `fill` (k,), their clean means."""

    layer: int
    neurons: torch.Tensor  # (k,) indices into d_mlp
    fill: torch.Tensor | None = None
    component = "neurons"

    @property
    def point(self) -> str:
        return f"blocks.{self.layer}.mlp.out.hook_in"

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """act' for the MLP's hidden activation `base` `(..., d_mlp)`: the chosen neurons
        := `source` (k,) (by default the fill), or 0."""
        source = self.fill if source is None else source
        out = base.clone()
        idx = self.neurons.to(base.device)
        out[..., idx] = 0 if source is None else source.to(base.dtype).to(base.device)
        return out

    def hooks(self) -> list[Hook]:
        return [(self.point, lambda act, hook=None: self.apply(act))]


Intervention = SkipBlock | RemoveWrite | ScaleHeads | ScaleNeurons | Rearrange


@dataclass(frozen=True)
class Resampled:
    """A fill still to be drawn: what hook point `point` gave on another document, position
    by position (`--method resample`). `resample(edit, acts)` makes it concrete."""

    point: str


def _at_positions(fill: torch.Tensor, positions: int, unit: int) -> torch.Tensor:
    """A fill (*unit) as is; one per position (T', *unit) cut to the first `positions`."""
    return fill[:positions] if fill.dim() > unit else fill


def resample(edit, acts: dict[str, torch.Tensor]):
    """`edit` with a `Resampled` fill replaced by the other document's activation at its
    point, per position (T', ...), from `acts` (point -> activation); any other edit as is."""
    if isinstance(getattr(edit, "fill", None), Resampled):
        return replace(edit, fill=acts[edit.fill.point])
    return edit


def intervention(component: str, layer: int, fill: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> Intervention:
    """The intervention on `component` ("block", "attn", "mlp" or "heads") at `layer`."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    if (component == "heads") != (keep is not None):
        raise ValueError("`keep` goes with component 'heads', and only with it")
    if component == "block":
        return SkipBlock(layer, fill)
    if component == "heads":
        return ScaleHeads(layer, keep, fill)
    return RemoveWrite(component, layer, fill)


def head_edits(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None
               ) -> list[ScaleHeads]:
    """One ScaleHeads per layer whose row of `keep` (n_layers, n_heads) is not all ones
    (every layer when `keep` requires grad: Michel et al.'s head mask)."""
    return [ScaleHeads(layer, keep[layer], (fill or {}).get(layer))
            for layer in range(keep.shape[0])
            if keep.requires_grad or not bool((keep[layer] == 1).all())]


def mask_heads(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Hook]:
    """Hooks that scale each head's z by `keep` (n_layers, n_heads): `hooks(head_edits(...))`."""
    return hooks(head_edits(keep, fill))
