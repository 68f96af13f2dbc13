"""Interventions: what a variant writes instead, each an `Edit(site, intervention, source)`
with one `apply(base, source)` (pyvene's interventions).

- `interchange.py`: sites, edits, and the interchange interventions (patch, noise,
  knockout);
- `removals.py`: the removals (a skipped block, a half's write, heads, neurons);
- `rearrange.py`: a block order (`Variant.order`), not an edit;
- `points.py`: the one hook function every naive loop runs (`hooks`), and `applied`;
- `value.py`: equality by value.
"""

from blockscope.interventions.interchange import Edit, Site
from blockscope.interventions.points import BlockPreHook, Hook, applied, hooks
from blockscope.interventions.rearrange import Rearrange
from blockscope.interventions.removals import (
    Replace,
    Resampled,
    ScaleHeads,
    ScaleNeurons,
    Skip,
    component,
    head_edits,
    intervention,
    mask_heads,
    mean_points,
    remove_write,
    resample,
    resampled,
    scale_heads,
    scale_neurons,
    skip_block,
    with_mean,
)

__all__ = ["BlockPreHook", "Edit", "Hook", "Rearrange", "Replace", "Resampled", "ScaleHeads",
           "ScaleNeurons", "Site", "Skip", "applied", "component", "head_edits", "hooks",
           "intervention", "mask_heads", "mean_points", "remove_write", "resample",
           "resampled", "scale_heads", "scale_neurons", "skip_block", "with_mean"]
