"""Time `prune-blocks --order greedy` (SLEB) on GPT-2 small's shapes (random init, no
download) or on a local checkpoint, cached engine against the naive loop, and count the
block-forwards each ran against the minimum the order needs.

    python benchmarks/bench_prune_blocks.py [--model DIR] [--tokens 469] [--max-removed N]

The minimum: at each step, each candidate's blocks after the one it removes (those not
removed), one row each, plus one clean pass; every candidate needs its own unembedding.
The exact-work time is that work's FLOPs (one block and one unembedding counted by torch's
FlopCounterMode) at the rate of a large matmul timed in the same run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments.prune_blocks import block_curve  # noqa: E402
from blockscope.inputs.text import read_passage, tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.sweeps import replay, steps  # noqa: E402

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
    """(block rows, unembeddings) SLEB's greedy order needs at the least."""
    rows, unembeds, removed = n_layers, 1, []  # the clean pass
    for r in curve.iloc[1:].itertuples():
        left = [i for i in range(n_layers) if i not in removed]
        for c in left:
            rows += sum(1 for j in left if j > c)
            unembeds += 1
        removed = [int(i) for i in r.removed.split(",")]
    return rows, unembeds


def flops(model, ids) -> tuple[float, float]:
    """FLOPs of one block and of one final norm + unembedding on these tokens."""
    x = torch.randn(1, ids.shape[1], model.cfg.d_model)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as f:
            model.blocks[0](x)
        block = f.get_total_flops()
        with FlopCounterMode(display=False) as f:
            model.unembed(model.ln_final(x))
    return block, f.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=469)
    ap.add_argument("--max-removed", type=int)
    ap.add_argument("--skip-naive", action="store_true")
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
            lambda: block_curve(model, ids, engine="naive", **kw))
        same = (naive[0]["removed"] == curve["removed"]).all()
        rel = float(((naive[0]["nll"] - curve["nll"]).abs() / naive[0]["nll"]).max())
        print(f"naive: {naive_s:.2f} s ({naive_s / cached_s:.2f}x the cached engine); same "
              f"order: {same}; NLL agree to {rel:.1e} relative")


if __name__ == "__main__":
    main()
