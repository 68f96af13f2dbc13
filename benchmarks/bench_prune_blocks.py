"""Time `prune-blocks --order greedy` (SLEB) on GPT-2 small's shapes (random init, no
download) or on a local checkpoint, cached engine against the naive loop, and count the
block-forwards each ran against the minimum the order needs.

    python benchmarks/bench_prune_blocks.py [--model DIR] [--tokens 469] [--max-removed N]

The minimum: one clean pass; at each step, each candidate's blocks after the one it removes
(those not removed), one row each, and every candidate's own unembedding; and from the
second step on, the model without the blocks removed so far, from the first of them to the
last candidate's input, once: the residual a candidate after that block enters from.
The exact-work time is that work's FLOPs (one block and one unembedding counted by torch's
FlopCounterMode) at the rate of a large matmul timed in the same run.

`--breakdown` then profiles the first greedy step (every block removed alone) and splits its
time into matrix products (with their FLOPs, counted in a second run, and the rate they ran
at in place, beside a large matmul's rate timed around it), fused attention and everything
else: where the time beyond the exact work goes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments.prune_blocks import block_curve  # noqa: E402
from blockscope.inputs.text import read_passage, tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.sweeps import replay, steps  # noqa: E402
from blockscope.sweeps.settings import RunSettings

ALICE = Path(__file__).resolve().parent.parent / "data" / "alice.txt"


def matmul_rate() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 2048**3 / (time.perf_counter() - start)


def counted(fn):
    """Run fn() counting the rows that ran a block (plain replay or bridge)."""
    rows = [0]
    plain_mlp, bridge_step = replay.mlp_half, steps.block_step

    def mlp_half(p, x, *a, **k):
        rows[0] += x.shape[0]
        return plain_mlp(p, x, *a, **k)

    def block_step(model, clean, j, x, plain):
        if plain is None or replay.hooked(model.blocks[j]):
            rows[0] += x.shape[0]
        return bridge_step(model, clean, j, x, plain)

    replay.mlp_half, steps.block_step = mlp_half, block_step
    try:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start, rows[0]
    finally:
        replay.mlp_half, steps.block_step = plain_mlp, bridge_step


def minimum(curve, n_layers: int) -> tuple[int, int]:
    """(block rows, unembeddings) SLEB's greedy order needs at the least: the clean pass;
    then at each step every candidate's blocks after the one it removes (those not removed)
    and its unembedding, and, once removals exist, the model without them from its first
    removed block up to the last candidate's input: a candidate after the first removed
    block enters from that model's residual (shared by the step's candidates)."""
    rows, unembeds, removed = n_layers, 1, []  # the clean pass
    for r in curve.iloc[1:].itertuples():
        left = [i for i in range(n_layers) if i not in removed]
        for c in left:
            rows += sum(1 for j in left if j > c)
            unembeds += 1
        if removed:
            rows += sum(1 for j in left if min(removed) < j < max(left))
        removed = [int(i) for i in r.removed.split(",")]
    return rows, unembeds


def flops(model, ids) -> tuple[float, float]:
    """FLOPs of one block and of one final norm + unembedding on these tokens (block 0 with
    the arguments the clean pass gave it: rotary position embeddings, mask)."""
    from blockscope.sweeps.clean import clean_pass
    from blockscope.sweeps.naive import model_windows

    c = clean_pass(model, ids, model_windows(model, ids, None)[0])
    args, kwargs = c.block_args[0]
    x = torch.randn(1, ids.shape[1], model.cfg.d_model)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as f:
            model.blocks[0](x, *args, **kwargs)
        block = f.get_total_flops()
        with FlopCounterMode(display=False) as f:
            model.unembed(model.ln_final(x))
    return block, f.get_total_flops()


MATMULS = ("mm", "addmm", "bmm", "baddbmm")  # the profiler's own-time names of products


class ProductFlops(TorchDispatchMode):
    """Counts the FLOPs of matrix products, 2 x output elements x inner size (with the
    composites `matmul` and `linear` as this mode meets them). Not FlopCounterMode: its
    module tracking registers global module hooks, which send the engine through the
    bridge's blocks instead of the plain replay (`replay.hooked`)."""

    LEFT = {"mm": 0, "bmm": 0, "matmul": 0, "linear": 0, "addmm": 1, "baddbmm": 1}

    def __init__(self):
        super().__init__()
        self.flop = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        left = self.LEFT.get(func._overloadpacket.__name__)
        if left is not None:
            self.flop += 2 * out.numel() * args[left].shape[-1]
        return out


def breakdown(model, ids, timer, block_f: float, unembed_f: float) -> None:
    """Profile one greedy step (block_curve with max_removed=1): seconds in matrix products,
    fused attention and the rest, by each op's own time; the products' FLOPs from a second
    run counting them (recording shapes in the profiler slows the small ops ~15x). `timer`
    times the large matmul, before and after the profiled run; block_f, unembed_f: `flops`."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        return block_curve(model, ids, orders=("greedy",), max_removed=1)[0][0]

    with ProductFlops() as counter:
        curve = step()
    flop = counter.flop
    before = timer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    rate = (before + timer()) / 2
    own = {e.key.removeprefix("aten::"): e.self_cpu_time_total / 1e6
           for e in prof.key_averages()}
    products = sum(own.pop(k, 0.0) for k in MATMULS)
    attention = sum(own.pop(k) for k in list(own) if "scaled_dot_product" in k)
    rest = sum(own.values())
    total = products + attention + rest
    rows, unembeds = minimum(curve, model.cfg.n_layers)
    exact = (rows * block_f + unembeds * unembed_f) / rate
    top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:6])
    print(f"one greedy step, profiled: {total:.2f} s (exact work {exact:.2f} s, "
          f"x{total / exact:.3f})"
          f"\n  matrix products {products:.2f} s ({products / total:.0%}): {flop / 1e9:.0f} GFLOP "
          f"at {flop / products / 1e9:.1f} GFLOP/s in place ({flop / rate:.2f} s at the large "
          f"matmul's rate)\n  fused attention {attention:.2f} s ({attention / total:.0%})"
          f"\n  the rest {rest:.2f} s ({rest / total:.0%}): {top}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=469)
    ap.add_argument("--max-removed", type=int)
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    tune_allocator()
    path = args.model
    if path is None:
        from blockscope.model.toy import write_toy_model

        path = Path(tempfile.mkdtemp()) / "gpt2-small-shapes"
        write_toy_model(path)
    model = load_model(spec_for(str(path), device="cpu"))
    ids = tokenize(model.tokenizer, read_passage(str(ALICE)).text, prepend_bos=True,
                   max_tokens=args.tokens)
    L = model.cfg.n_layers
    kw = dict(orders=("greedy",), max_removed=args.max_removed)
    rate = matmul_rate()
    (curves, _), cached_s, cached_rows = counted(lambda: block_curve(model, ids, **kw))
    cached_rows += L  # the clean pass: the bridge's own forward, which `counted` does not see
    rate = (rate + matmul_rate()) / 2
    curve = curves[0]
    need_rows, need_unembeds = minimum(curve, L)
    block_f, unembed_f = flops(model, ids)
    exact_s = (need_rows * block_f + need_unembeds * unembed_f) / rate
    print(f"{path}: {L} blocks, {ids.shape[1]} tokens, {len(curve) - 1} greedy steps")
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s; one block {block_f / 1e9:.2f} GFLOP, one "
          f"unembedding {unembed_f / 1e9:.2f} GFLOP")
    print(f"cached: {cached_s:.2f} s, {cached_rows} block rows (minimum {need_rows}, "
          f"x{cached_rows / need_rows:.3f}); exact-work time {exact_s:.2f} s: "
          f"x{cached_s / exact_s:.3f} of it")
    if not args.skip_naive:
        (naive, _), naive_s, naive_rows = counted(
            lambda: block_curve(model, ids, **kw, settings=RunSettings(engine="naive")))
        same = (naive[0]["removed"] == curve["removed"]).all()
        rel = float(((naive[0]["nll"] - curve["nll"]).abs() / naive[0]["nll"]).max())
        print(f"naive: {naive_s:.2f} s ({naive_s / cached_s:.2f}x the cached engine); same "
              f"order: {same}; NLL agree to {rel:.1e} relative")
    if args.breakdown:
        breakdown(model, ids, matmul_rate, block_f, unembed_f)


if __name__ == "__main__":
    main()
