"""Interchange interventions: an edit writes at a named site what its `apply(base, source)`
returns, where `base` is the run's own activation there and `source` another run's.

This is pyvene's one `forward(base, source)`: a patch, a restore, a freeze and a resample
differ only in which run `source` is; noise is `base + source`; a knockout writes -inf into
the attention scores. The site is TransformerLens's hook name, a layer, positions and
optionally a head, and the engine (sweeps/interchange) selects it, so `apply` sees only the
selected values, with a leading axis of the run's samples (`source`'s is 1 where one value
serves every sample):

- `hook_resid_pre`, `hook_resid_post`, `hook_resid_mid`, `hook_attn_out`, `hook_mlp_out`,
  and `hook_embed` (layer None): (batch, pos, d_model) at `positions`;
- `attn.hook_z`: (batch, pos, n_heads, d_head) at `positions`, one `head` or all;
- `attn.hook_q`, `attn.hook_k`, `attn.hook_v`: the same, the query, key and value heads
  before any rotary embedding (keys and values: n_key_value_heads of them, where queries
  share them);
- `attn.hook_attn_scores`: (batch, n_heads, query, key) at queries `positions` and `keys`;
- `mlp.hook_post`: (batch, pos, d_mlp) at `positions`, what the MLP's output projection
  reads (some families flatten batch and position there: an edit must then take every
  row and position).

An edit's source is another run by name, a tensor, nothing, or a `Site` of its own run that
the forward has already passed (a skipped block reads its input: `interventions.skip_block`).

A new intervention is one class with `apply`; no engine change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockscope.interventions.value import Value

POINTS = ("hook_embed", "hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out",
          "hook_resid_post", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
          "attn.hook_attn_scores", "mlp.hook_post")
PER_HEAD = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")  # (pos, heads, d_head)
HEADED = (*PER_HEAD, "attn.hook_attn_scores")  # sites with a head axis


def heads_at(cfg, point: str) -> int:
    """How many heads a per-head site has on a model of config `cfg`: its key and value
    heads for attn.hook_k and attn.hook_v (fewer where queries share them), else n_heads."""
    if point in ("attn.hook_k", "attn.hook_v"):
        return int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    return int(cfg.n_heads)


@dataclass(frozen=True)
class Site:
    """Where an edit writes: a TransformerLens hook point, its layer (None for
    `hook_embed`), the token positions (the queries, for attention scores; None: every
    position, a position or several), a head (None: every head) and, for attention scores,
    the keys.

    `Site("hook_resid_pre", 3)` is block 3's input at every position;
    `Site("attn.hook_z", 2, head=1)` head 1's z in block 2, at every position."""

    point: str
    layer: int | None
    positions: tuple[int, ...] | None = None
    head: int | None = None
    keys: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.positions, int):  # one position, as a tuple
            object.__setattr__(self, "positions", (self.positions,))
        elif self.positions is not None:
            object.__setattr__(self, "positions", tuple(int(p) for p in self.positions))
        object.__setattr__(self, "keys", tuple(int(k) for k in self.keys))
        if self.point not in POINTS:
            raise ValueError(f"unknown site {self.point!r}; one of {', '.join(POINTS)}")
        if (self.layer is None) != (self.point == "hook_embed"):
            raise ValueError("`hook_embed` has no layer; every other site has one")
        if (self.point == "attn.hook_attn_scores") != bool(self.keys):
            raise ValueError("`keys` go with attention scores, and only with them")
        if self.positions is not None and not self.positions:
            raise ValueError("a site needs at least one position (None: every position)")
        if self.positions is None and self.point == "attn.hook_attn_scores":
            raise ValueError("attention scores need their query positions")
        if self.head is not None and self.point not in HEADED:
            raise ValueError(f"`head` goes with {' and '.join(HEADED)}, not {self.point}")

    @property
    def name(self) -> str:
        """The TransformerLens hook name."""
        return self.point if self.layer is None else f"blocks.{self.layer}.{self.point}"

    @property
    def first(self) -> int:
        """The first position written (0 where every position is)."""
        return 0 if self.positions is None else min(self.positions)

    def index(self, offset: int = 0) -> tuple:
        """The index of the selected values in one run's activation without its batch axis,
        its positions counted from `offset` (a run resumed at position `offset`; every
        position there is from `offset` on)."""
        pos = slice(None) if self.positions is None else torch.tensor(self.positions) - offset
        head = slice(None) if self.head is None else self.head
        if self.point in PER_HEAD:  # (pos, heads, d_head)
            return (pos, head)
        if self.point == "attn.hook_attn_scores":  # (n_heads, query, key)
            return (head, pos[:, None], torch.tensor(self.keys)[None, :])
        return (pos,)  # (pos, d_model)


@dataclass(frozen=True)
class Patch:
    """The source run's value: activation patching, ROME's restore, a freeze."""

    elementwise = True  # each value written from its own base and source value alone

    def apply(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return source


@dataclass(frozen=True)
class AddNoise:
    """base + source: the source is the noise (ROME's corrupted subject embeddings)."""

    elementwise = True

    def apply(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return base + source.to(base)


@dataclass(frozen=True)
class Knockout:
    """-inf in the attention scores: the query cannot attend to the key (Geva et al. 2023's
    attention knockout; the softmax renormalises over the rest). No source."""

    def apply(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full_like(base, float("-inf"))


@dataclass(frozen=True, eq=False)
class Edit(Value):
    """An intervention at a site, reading `source`: the name of a run whose activation at
    the same site it takes, a tensor (batch or 1, *selected shape), a `Site` of the same run
    (its activation there, selected at that site), or None."""

    site: Site
    intervention: object  # anything with apply(base, source) -> activation'
    source: str | torch.Tensor | Site | None = None

    def write(self, act: torch.Tensor, first: int, samples: int | None, offset: int,
              sources: dict, own: dict | None = None) -> None:
        """Write `apply(base, source)` into `act` (batch, ...) in place, at the site, in the
        batch rows first..first+samples-1 (the run's samples 0..samples-1, in order; None:
        every row), its positions counted from `offset`: one indexed write for all the rows.
        `own`: the run's activations at the sites its edits read from it (name -> act)."""
        if act.dim() == 2 and self.site.point == "mlp.hook_post" and (
                samples is not None or self.site.positions is not None):
            raise ValueError(f"{self.site.name} flattens batch and position in this family: "
                             "an edit there takes every row and position")
        rows = act[first : None if samples is None else first + samples]  # a view: (S, ...)
        idx = (slice(None), *self.site.index(offset))
        rows[idx] = self.intervention.apply(rows[idx], self.source_of(sources, samples, own,
                                                                       first, offset))

    def written(self, act: torch.Tensor, samples: int | None, sources: dict,
                own: dict | None = None) -> torch.Tensor:
        """`act` (batch, ...) with this edit written: `apply(act, source)` itself where the
        site selects every row, position and head (out of place: a gradient flows through
        it, as through a head mask), else a copy with the selected values written."""
        if samples is None and self.site.positions is None and self.site.head is None:
            return self.intervention.apply(act, self.source_of(sources, samples, own))
        act = act.clone()
        self.write(act, 0, samples, 0, sources, own)
        return act

    def source_of(self, sources: dict, samples: int | None, own: dict | None = None,
                  first: int = 0, offset: int = 0):
        """This edit's source for samples 0..samples-1 (None: every row), selected at the
        site: (S or 1, *selected), or None. A `Site` source is read from `own` (this run's
        batch, name -> act) at the same rows first.. and at its own site, its positions
        counted from `offset`, as the edit's are."""
        if self.source is None:
            return None
        if isinstance(self.source, torch.Tensor):
            return self.source[:samples]  # (batch or 1, *selected)
        if isinstance(self.source, Site):
            act = (own or {})[self.source.name]  # (batch, ...) this run's, as it passed
            return act[first : None if samples is None else first + samples][
                (slice(None), *self.source.index(offset))]
        act = sources[self.source][self.site.name]  # (batch or 1, ...) the whole run's
        return act[:samples][(slice(None), *self.site.index(0))]
