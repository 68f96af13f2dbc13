"""Removals: edits that take a part of the model out, each one `Edit(site, intervention,
source)` with one `apply(base, source) -> activation'` (pyvene's interventions), the
protocol every edit follows (interchange.py). `base` is the run's own activation at the
site; `source` what is written in its place. Here:

- `skip_block(k)`: `Skip` at `blocks.k.hook_resid_post`, its source the block's input
  (`blocks.k.hook_resid_pre` of the same run): the block's output := its input (+ a
  clean-mean fill);
- `remove_write(part, k)`: `Replace` at `hook_attn_out` / `hook_mlp_out`: one half's write
  to the stream := zeros, a clean mean (`with_mean`) or another document's write
  (`Resampled`, drawn per document);
- `scale_heads(k, keep)`: `ScaleHeads` at `attn.hook_z`: each head's z := keep * z +
  (1 - keep) * fill (keep 0 removes a head);
- `scale_neurons(k, neurons)`: `ScaleNeurons` at `mlp.hook_post`: chosen MLP neurons'
  activations := 0, or their clean means.

A rearrangement of blocks (rearrange.py) is a variant's block order, not an edit.

Every engine uses `apply`: the naive loops run every edit through one hook function
(`points.hooks`), the cached engine (`sweeps/entries.start`) applies it to the cached clean
activation and carries the change into the stream (as is for a write, through W_O for z),
and the gradient replay scales z with it. It chooses its entry by the site and the
intervention's class (`component`), never by anything else. `applied(model, hooks)`
(points.py) adds hooks for a `with` block (TransformerLens's `model.hooks`, which removes
them in `finally`). A new intervention is one class with `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockscope.interventions.interchange import Edit, Site
from blockscope.interventions.points import Hook, hooks
from blockscope.interventions.value import Value

PART_HOOKS = {"attn": "hook_attn_out", "mlp": "hook_mlp_out"}  # a half's write to the stream
COMPONENTS = ("block", "attn", "mlp", "heads")


@dataclass(frozen=True)
class Resampled:
    """A fill still to be drawn: what hook point `point` gave on another document, position
    by position (`--method resample`). `resample(edit, acts)` makes it concrete."""

    point: str


@dataclass(frozen=True, eq=False)
class Skip(Value):
    """A block skipped: its output is its input `source`, plus `fill` (d_model,) if given
    (its mean clean contribution, post - pre)."""

    fill: torch.Tensor | None = None

    def apply(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The block's output `(..., d_model)` given what it received, `source`; its own
        output `base` is not read."""
        return source if self.fill is None else source + self.fill.to(source.dtype)


@dataclass(frozen=True, eq=False)
class Replace(Value):
    """A write to the stream replaced: by `source`, else by `fill` (the clean mean
    (d_model,), or another document's write per position (T', d_model), read from position
    0), else by zeros."""

    fill: torch.Tensor | Resampled | None = None

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """What is written instead of the write `base` `(..., T, d_model)`."""
        source = self.fill if source is None else source
        if source is None:
            return torch.zeros_like(base)
        return _at_positions(source, base.shape[-2], 1).to(base.dtype).expand_as(base)


@dataclass(frozen=True, eq=False)
class ScaleHeads(Value):
    """A layer's heads scaled by `keep` (n_heads,): keep 1 leaves a head alone, 0 removes
    it, its z replaced by `fill` (n_heads, d_head) if given (its clean mean)."""

    keep: torch.Tensor
    fill: torch.Tensor | Resampled | None = None

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """z' for z = `base` `(..., n_heads, d_head)`: keep * z + (1 - keep) * source per
        head (`source` by default the fill; none: the removed heads write nothing)."""
        source = self.fill if source is None else source
        k = self.keep.to(base.dtype)[:, None]  # (n_heads, 1), broadcast over d_head
        out = base * k
        if source is None:
            return out
        return out + (1 - k) * _at_positions(source, base.shape[-3], 2).to(base.dtype)

    def check(self, cfg) -> str | None:
        """What is wrong with these heads for a model of config `cfg`, or None."""
        if tuple(self.keep.shape) != (cfg.n_heads,):
            return (f"scale_heads' keep is {tuple(self.keep.shape)}; the model has "
                    f"{cfg.n_heads} heads")
        return None


@dataclass(frozen=True, eq=False)
class ScaleNeurons(Value):
    """MLP neurons `neurons` removed: their activation (what the MLP's output projection
    reads: after the nonlinearity, or act(gate) x up where gated) := 0, or `fill` (k,),
    their clean means."""

    neurons: torch.Tensor  # (k,) indices into d_mlp
    fill: torch.Tensor | None = None

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """act' for the MLP's hidden activation `base` `(..., d_mlp)`: the chosen neurons
        := `source` (k,) (by default the fill), or 0."""
        source = self.fill if source is None else source
        out = base.clone()
        idx = self.neurons.to(base.device)
        out[..., idx] = 0 if source is None else source.to(base.dtype).to(base.device)
        return out

    def check(self, cfg) -> str | None:
        """What is wrong with these neurons for a model of config `cfg`, or None."""
        n = self.neurons
        if n.numel() and not (0 <= int(n.min()) and int(n.max()) < cfg.d_mlp):
            return f"scale_neurons' neurons must be within 0..{cfg.d_mlp - 1}"
        return None


def skip_block(layer: int, fill: torch.Tensor | None = None) -> Edit:
    """Block `layer` skipped: its output (`hook_resid_post`) := its input (+ `fill`)."""
    return Edit(Site("hook_resid_post", layer), Skip(fill), Site("hook_resid_pre", layer))


def remove_write(part: str, layer: int, fill: torch.Tensor | Resampled | None = None) -> Edit:
    """Half `part` ("attn" or "mlp") of block `layer` writes zeros, or `fill`, instead."""
    return Edit(Site(PART_HOOKS[part], layer), Replace(fill))


def scale_heads(layer: int, keep: torch.Tensor, fill=None) -> Edit:
    """Block `layer`'s heads' z scaled by `keep` (n_heads,), towards `fill` if given."""
    return Edit(Site("attn.hook_z", layer), ScaleHeads(keep, fill))


def scale_neurons(layer: int, neurons: torch.Tensor, fill: torch.Tensor | None = None) -> Edit:
    """Block `layer`'s MLP neurons `neurons` (k,) set to 0, or to `fill` (k,)."""
    return Edit(Site("mlp.hook_post", layer), ScaleNeurons(neurons, fill))


# The removal each (site, intervention class) is, for the cached engine's entries.
_COMPONENTS = {("hook_resid_post", Skip): "block", ("hook_attn_out", Replace): "attn",
               ("hook_mlp_out", Replace): "mlp", ("attn.hook_z", ScaleHeads): "heads",
               ("mlp.hook_post", ScaleNeurons): "neurons"}


def component(e: Edit) -> str | None:
    """Which removal edit `e` is ("block", "attn", "mlp", "heads" or "neurons"), by its site
    and its intervention's class; None for any other edit (every position, every head, and
    a skip reading its own block's input, only)."""
    if e.site.positions is not None or e.site.head is not None:
        return None
    if type(e.intervention) is Skip and e.source != Site("hook_resid_pre", e.site.layer):
        return None
    if type(e.intervention) is not Skip and e.source is not None:
        return None
    return _COMPONENTS.get((e.site.point, type(e.intervention)))


def mean_points(e: Edit) -> list[str]:
    """The hook points whose clean means give `e`'s mean fill (`with_mean`): its site, and
    the site it reads in its own run (a skipped block's input)."""
    return [*([e.source.name] if isinstance(e.source, Site) else []), e.site.name]


def with_mean(e: Edit, means: dict[str, torch.Tensor]) -> Edit:
    """`e` filling with the clean mean at its site (less the mean at the site it reads in
    its own run: a skipped block's mean contribution, post - pre)."""
    fill = means[e.site.name]
    if isinstance(e.source, Site):
        fill = fill - means[e.source.name]
    return replace(e, intervention=replace(e.intervention, fill=fill))


def resampled(e: Edit) -> Edit:
    """`e` filling with another document's activation at its site, drawn per document."""
    return replace(e, intervention=replace(e.intervention, fill=Resampled(e.site.name)))


def _at_positions(fill: torch.Tensor, positions: int, unit: int) -> torch.Tensor:
    """A fill (*unit) as is; one per position (T', *unit) cut to the first `positions`."""
    return fill[:positions] if fill.dim() > unit else fill


def resample(edit: Edit, acts: dict[str, torch.Tensor]) -> Edit:
    """`edit` with a `Resampled` fill replaced by the other document's activation at its
    point, per position (T', ...), from `acts` (point -> activation); any other edit as is."""
    fill = getattr(edit.intervention, "fill", None)
    if isinstance(fill, Resampled):
        return replace(edit, intervention=replace(edit.intervention, fill=acts[fill.point]))
    return edit


def intervention(component: str, layer: int, fill: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> Edit:
    """The removal edit of `component` ("block", "attn", "mlp" or "heads") at `layer`."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    if (component == "heads") != (keep is not None):
        raise ValueError("`keep` goes with component 'heads', and only with it")
    if component == "block":
        return skip_block(layer, fill)
    if component == "heads":
        return scale_heads(layer, keep, fill)
    return remove_write(component, layer, fill)


def head_edits(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Edit]:
    """One `scale_heads` edit per layer whose row of `keep` (n_layers, n_heads) is not all
    ones (every layer when `keep` requires grad: Michel et al.'s head mask)."""
    return [scale_heads(layer, keep[layer], (fill or {}).get(layer))
            for layer in range(keep.shape[0])
            if keep.requires_grad or not bool((keep[layer] == 1).all())]


def mask_heads(keep: torch.Tensor, fill: dict[int, torch.Tensor] | None = None) -> list[Hook]:
    """Hooks that scale each head's z by `keep` (n_layers, n_heads): `hooks(head_edits(...))`."""
    return hooks(head_edits(keep, fill))
