"""The engine checks itself on every clean pass before any variant is reported.

For each window, on one block of each kind (the first of every kind, and the last block),
the engine's replay must reproduce the clean pass to `REL` relative (max abs difference over
max abs value), from every entry kind the sweep uses:

- a whole block from its input (the bridge block with its recorded arguments; and the
  plain replay, when there is one, which is dropped if it alone disagrees);
- the MLP half from the mid residual, when a variant enters there;
- a layer's attention write as sum_h z_h W_O[h] + b_O, when a variant's heads are
  subtracted that way; a parallel block's output as input + both writes, when a half is;
- the final norm and unembedding (softcapping included) from the last residual: the NLL,
  against the model's own logits for the window's last scored positions.

A failure raises `ReplayMismatch`, and `scoring.scores` scores that document with the naive
loop instead, saying so. Never a silent wrong number. The identities say the replay is
right; `check_variants` (below) then holds what each entry writes: the first variant of each
kind, as the engine scored it, against the hooked model on the first window's first tokens.
"""

from __future__ import annotations

import torch

from blockscope.inputs.text import Window
from blockscope.model import adapters
from blockscope.sweeps import replay, steps, unembed
from blockscope.sweeps.clean import Clean
from blockscope.sweeps.metrics import NllKl
from blockscope.sweeps.naive import naive_nlls
from blockscope.sweeps.replay_rotary import ReplayArgsMissing
from blockscope.sweeps.steps import ReplayMismatch

REL = 1e-5  # float32; half precision gets its own rounding scale (see tolerance)


def tolerance(dtype: torch.dtype) -> float:
    """1e-5 in float32; in half precision a few units of its rounding (eps * 8)."""
    return REL if dtype in (torch.float32, torch.float64) else float(torch.finfo(dtype).eps) * 8


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def block_kinds(model) -> list[int]:
    """One representative layer per block kind: the HF block class and, where the config
    says so, the layer's attention type (sliding or global); plus the last block."""
    seen, reps = set(), []
    for j in range(len(model.blocks)):
        key = adapters.block_kind(model, j)
        if key not in seen:
            seen.add(key)
            reps.append(j)
    last = len(model.blocks) - 1
    return reps if last in reps else reps + [last]


def verify(model, lay, clean: Clean, starts, plain):
    """Check the replay against `clean` for the entries `starts` use; return the plain
    parts to use (None: the bridge's blocks), or raise ReplayMismatch. A clean pass is
    checked once for each set of entry kinds and hooks (a pruning curve reuses it)."""
    mids = any(s.mid for s in starts)
    relies = frozenset(s.relies_on for s in starts) - {None}
    bridge = (plain is None or any(s.hooks for s in starts)
              or any(replay.hooked(b) for b in model.blocks))
    key = (mids, relies, plain is not None, bridge,
           tuple(name for name, point in model.hook_dict.items() if point.has_hooks()))
    if key not in clean.checked:
        try:
            clean.checked[key] = _verify(model, lay, clean, mids, relies, plain,
                                         bridge) is not None
        except ReplayMismatch as exc:
            clean.checked[key] = exc
    verdict = clean.checked[key]
    if isinstance(verdict, ReplayMismatch):
        raise verdict
    return plain if verdict else None


def _verify(model, lay, clean: Clean, mids: bool, relies, plain, bridge: bool = True):
    """`bridge`: whether any bridge block may run (a hook sits in one, a variant brings
    hooks, or there is no plain replay: `plain is None` implies it); if not, and the plain
    replay agrees, the bridge's own replay is not checked, since it will not run."""
    tol = tolerance(clean.pre[0].dtype)
    with torch.inference_mode(), steps.fused_gelu(model):
        for j in block_kinds(model):
            # block j's output is what block j+1 receives, before that block's own hooks
            x, want = clean.entering(j), clean.entering(j + 1)
            if plain is not None and not _plain_agrees(model, clean, j, x, plain, want, tol):
                # the plain replay only: the bridge's blocks will run, all of them checked
                return _verify(model, lay, clean, mids, relies, None)
            if bridge:
                err = _rel(steps.block_step(model, clean, j, x, None), want)
                if err > tol:
                    raise ReplayMismatch(f"replaying block {j} gives its output to {err:.1e} "
                                         f"relative (allowed {tol:.0e})")
            if mids:
                mid = clean.act("hook_resid_mid", j)
                for p in [*([None] if bridge else []), *([plain] if plain is not None else [])]:
                    err = _rel(steps.mlp_step(model, lay, j, mid, p), want)
                    if err > tol:
                        raise ReplayMismatch(f"block {j}'s MLP half from its mid residual "
                                             f"gives its output to {err:.1e} relative")
            if "heads" in relies:
                _check_heads(model, lay, clean, j, tol)
            if "halves" in relies:
                err = _rel(clean.pre[j] + clean.act("hook_attn_out", j)
                           + clean.act("hook_mlp_out", j),
                           want)
                if err > tol:
                    raise ReplayMismatch(f"block {j}'s output is not its input plus its two "
                                         f"writes ({err:.1e} relative)")
        # the window's last scored positions only, against the model's own logits
        w = clean.window
        last = Window(w.begin, w.end, w.end - len(clean.ref_nll))
        got = unembed.final_nll(model, clean.pre[-1], clean.chunk, last, lay.softcap)[0]
        err = _rel(got, clean.ref_nll)
        if err > tol:
            raise ReplayMismatch(f"the final norm and unembedding give the clean NLL to "
                                 f"{err:.1e} relative")
    return plain


def _plain_agrees(model, clean: Clean, j: int, x, plain, want, tol: float) -> bool:
    """Whether the plain replay of block j reproduces it (a replay that cannot run, e.g.
    without the rotary arguments it needs, does not)."""
    try:
        return _rel(steps.block_step(model, clean, j, x, plain), want) <= tol
    except ReplayArgsMissing:  # the clean pass recorded no rotary cos/sin for it
        return False


def _check_heads(model, lay, clean: Clean, j: int, tol: float) -> None:
    """A layer's attention write must be sum_h z_h W_O[h] + b_O for heads to be removed by
    subtracting their terms."""
    attn = model.blocks[j].attn
    z = clean.act("attn.hook_z", j)  # (1, T, n_heads, d_head)
    write = clean.act("hook_attn_out", j)  # (1, T, d_model)
    b_O = getattr(attn, "b_O", None)
    got = torch.einsum("bthd,hde->bte", z, attn.W_O.to(z)) + (0 if b_O is None else b_O)
    err = _rel(got, write)
    if err > tol:
        raise ReplayMismatch(f"block {j}'s attention write is not the sum of its heads' "
                             f"z @ W_O ({err:.1e} relative)")


def gradient_replay(model, lay, clean: Clean, mask: torch.Tensor):
    """(plain parts, None, ran) when the plain replay of `clean`'s window with heads scaled
    by `mask` (n_layers, n_heads) reproduces the hooked model (the heads intervention's own hooks at
    every layer) to `REL` in both the NLL and its gradient with respect to the mask, or,
    in float32 where it does not, lies within NOISE times the hooked pass's own distance
    from a float64 pass of the same (float32 rounding, not a wrong replay);
    (None, reason, ran) when it does not; (None, None, None) where no plain replay applies
    (a hook in a block or on the unembedding, or a family without one). Checked once per
    clean pass, set of hooks, and whether the mask removes a head (0: the replay leaves that
    head out, `replay.kept_heads`, which only such a mask exercises); the weights must be
    frozen by the caller. A removed head's gradient is not compared: both sides count it as
    0. `ran`: on the call that checked, the (NLL (n_scored,), gradient (n_layers, n_heads))
    of the side to use (the plain replay's if it agreed, else the hooked model's), so the
    caller need not compute them again; else None."""
    from blockscope.interventions import applied, mask_heads
    from blockscope.sweeps.naive import nll_from_logits

    hooked = tuple(name for name, point in model.hook_dict.items() if point.has_hooks())
    key = ("gradient", hooked, bool((mask == 0).any()))
    if key in clean.checked:
        return (*clean.checked[key], None)
    plain = steps.plain_parts(model)
    if plain is None or hooked:
        clean.checked[key] = (None, None)
        return None, None, None
    tol = tolerance(clean.pre[0].dtype)
    got, want = [], []
    with torch.enable_grad(), steps.fused_gelu(model):
        m = mask.detach().clone().requires_grad_(True)
        nll = replay.masked_nll(model, plain, clean, m, lay.softcap)
        grad = (torch.autograd.grad(nll.sum(), m, allow_unused=True)[0]
                if nll.requires_grad else None)  # None: the mask had no effect at all
        got = [nll.detach(), torch.zeros_like(m) if grad is None else grad * (m != 0)]
    with torch.enable_grad():
        m = mask.detach().clone().requires_grad_(True)
        with applied(model, mask_heads(m)):
            logits = model(clean.chunk, return_type="logits")[0]  # (T, d_vocab)
        nll = nll_from_logits(logits, clean.chunk, clean.window)
        want = [nll.detach(), torch.autograd.grad(nll.sum(), m)[0] * (m != 0)]  # as got
    worst = max(_rel(g, w) for g, w in zip(got, want, strict=True))
    ok = worst <= tol
    why = (f"the plain replay of the head-mask gradient differs from the hooked model by "
           f"{worst:.1e} relative (allowed {tol:.0e})")
    if not ok and clean.pre[0].dtype == torch.float32:
        # Two correct float32 orders of summation can differ by more than `tol` in a deep
        # model's gradient (SmolLM2: ~1e-4). Judge like with like: against a float64 pass,
        # the replay may be off by at most NOISE times what the hooked float32 pass is.
        exact = _float64_pass(model, clean, mask)
        noise = max(_rel(w, e) for w, e in zip(want, exact, strict=True))
        off = max(_rel(g, e) for g, e in zip(got, exact, strict=True))
        allowed = max(tol, NOISE * noise)
        ok = off <= allowed  # within float32 noise: a correct replay
        why = (f"the plain replay of the head-mask gradient differs from a float64 pass by "
               f"{off:.1e} relative, {off / max(noise, 1e-30):.0f}x the hooked float32 "
               f"model's own {noise:.1e} (allowed {allowed:.1e})")
    clean.checked[key] = (plain, None) if ok else (None, why)
    return (*clean.checked[key], got if ok else want)


NOISE = 8  # how many times the hooked float32 pass's own rounding a replay may be off


def _float64_pass(model, clean: Clean, mask: torch.Tensor) -> list[torch.Tensor]:
    """[NLL, gradient] of the hooked model with heads scaled by `mask`, on `clean`'s window,
    with the HF model's weights and buffers in float64 for the pass (cast back after)."""
    from blockscope.interventions import applied, mask_heads
    from blockscope.sweeps.naive import nll_from_logits

    hf = model.original_model  # the bridge runs the HF modules' own weights
    dtype = next(hf.parameters()).dtype
    try:
        hf.double()
        with torch.enable_grad():
            m = mask.detach().double().clone().requires_grad_(True)
            with applied(model, mask_heads(m)):
                logits = model(clean.chunk, return_type="logits")[0]  # (T, d_vocab) float64
            nll = nll_from_logits(logits, clean.chunk, clean.window)
            grad = torch.autograd.grad(nll.sum(), m)[0] * (m != 0)
    finally:
        hf.to(dtype)  # float32 -> float64 -> float32 is exact
    return [nll.detach(), grad]


CHECKED_TOKENS = 64  # the first window's first targets on which each entry kind is held


def check_variants(model, ids, w: Window, c: Clean, nlls: list[torch.Tensor], variants,
                   starts) -> None:
    """The first variant of each entry kind (block, half, heads ...), as the engine scored
    it (`nlls`: baseline first, each over every window, window `w` = the first, first), held
    to the hooked model (its edits as hooks: the naive loop's forward) on the first
    CHECKED_TOKENS targets of `w` (a causal model's NLL there needs only that prefix). They
    must agree to a few units of float rounding (8 x `tolerance`, relative to
    the larger of 1 nat and the largest NLL), or `ReplayMismatch`: an entry that writes the
    wrong thing never gives a number, whatever the identities it relies on. Once per kind
    and clean pass `c` of `w` (a pruning curve's steps share the verdicts)."""
    firsts: dict[str, int] = {}
    for i, s in enumerate(starts):
        verdict = c.checked.get(("variant", s.kind))
        if isinstance(verdict, ReplayMismatch):
            raise verdict
        if verdict is None:
            firsts.setdefault(s.kind, i)
    if not firsts:
        return
    n = min(CHECKED_TOKENS, w.end - w.first_target)
    prefix = Window(w.begin, w.first_target + n, w.first_target)
    want = naive_nlls(model, ids, [variants[i] for i in firsts.values()], wins=[prefix],
                      baseline_nll=nlls[0][0, :n], metric=NllKl())
    limit = 8 * tolerance(model.cfg.dtype)
    for (kind, i), reference in zip(firsts.items(), (w[0] for w in want[1:]), strict=True):
        got = nlls[i + 1][0, :n]
        err = float((got - reference).abs().max() / reference.abs().max().clamp_min(1.0))
        c.checked[("variant", kind)] = True
        if not err <= limit:
            c.checked[("variant", kind)] = ReplayMismatch(
                f"its {kind} entry ({variants[i].label}) differs from the hooked model by "
                f"{err:.1e} relative on the first {n} tokens (allowed: {limit:.0e})")
            raise c.checked[("variant", kind)]
