"""One block's step in a replay, shared by the engine and its self-check: plain torch calls
(`replay`, `replay_rotary`, chosen by the family's record) where a block holds no hook, else
the bridge block with the arguments the clean pass recorded; and the error a replay that
does not reproduce the clean pass raises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from blockscope.model import adapters
from blockscope.model.arch import family
from blockscope.sweeps import replay, replay_rotary
from blockscope.sweeps.clean import Clean


class ReplayMismatch(Exception):
    """The engine's replay of the clean pass did not reproduce it: the sweep must not use it."""



@contextmanager
def fused_gelu(model) -> Iterator[None]:
    """Run each MLP's slow Python GELU as torch's fused tanh GELU
    (`adapters.fast_activations`): the same function, equal to within float rounding
    (~5e-7). Always restored."""
    swapped = []
    for mlp, fast in adapters.fast_activations(model):
        swapped.append((mlp, mlp.act))
        mlp.act = fast
    try:
        yield
    finally:
        for mlp, act in swapped:
            mlp.act = act


def plain_parts(model) -> list | None:
    """Each block's modules for the plain replay the family's record names (GPT-2's in
    `replay`, the Llama family's and GPT-NeoX's in `replay_rotary`), if every block is the
    layout that replay reads; None otherwise (the bridge's blocks then run)."""
    kind = family(model).replay
    if kind is None:
        return None
    parts = replay.parts if kind == "gpt2" else (lambda b: replay_rotary.parts(b, kind))
    found = [parts(b) for b in model.blocks]
    return None if any(p is None for p in found) else found


def block_step(model, clean: Clean, j: int, x: torch.Tensor, plain) -> torch.Tensor:
    """Block j on x (B, T, d_model): plain torch calls if `plain` and it holds no hook,
    else the bridge block with the arguments the clean pass recorded."""
    if plain is not None and not replay.hooked(model.blocks[j]):
        return replay.block_forward(plain[j], x, clean.block_args[j])
    args, kwargs = clean.block_args[j]
    out = model.blocks[j](x, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def mlp_step(model, lay, j: int, x: torch.Tensor, plain) -> torch.Tensor:
    """Block j from its mid residual x (sequential blocks): its MLP half, then the block's
    own output hook point (`hook_resid_post`), so hooks there fire as in a full block."""
    block = model.blocks[j]
    if plain is not None and not replay.hooked(block):
        return replay.mlp_half(plain[j], x)
    h = block.ln2(x) if lay.pre_mlp_norm else x
    h = block.mlp(h)
    h = h[0] if isinstance(h, tuple) else h
    if "ln2_post" in block._modules:
        h = block.ln2_post(h)
    return block.hook_out(x + h)
