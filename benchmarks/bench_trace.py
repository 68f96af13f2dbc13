"""Time `trace` (ROME's causal trace, the three kinds) on a real or random-init model, the
cached engine against the naive loop (a full forward per restored state, batched over the
noise samples, as ROME's `trace_with_patch`), and set both beside the time of the exact work
the sweep needs, priced at rates measured in the same run.

    python benchmarks/bench_trace.py [--model smollm2-135m] [--facts 1] [--length 10] [--samples 10]
                                     [--reps 1] [--no-naive]

The exact work: for each variant and sample, every block from the first one it changes at
the positions from the first one it changes (attention over the causal keys only), and the
unembedding of the one position the metric reads. Matrix products are priced at the rate
of each of the model's own products (q, k, v, o, gate, up, down, the unembedding; at a
batch's rows times half the prompt's positions), element-wise work (norms, rotary, the
gated activation, residual adds, the softmax over the keys) at the copy bandwidth measured
by a large copy into a buffer already touched. The rates are measured again after each
cached run (`--reps`), since this machine's speed drifts by a fifth within minutes: each
rep's ratio is printed, and the median. The allocator is tuned first, as the CLI tunes it
(`tune_allocator`: freed memory kept for reuse, not handed back and faulted in again).

`--split` then says where the cached sweep's time goes, in the same process: torch's
profiler splits one cached run into its matrix products, its attention kernel and the rest
(norms, rotary, the gated activation, indexing, copies); and the sweep's own sequence of
products (every `F.linear` call, recorded with its input shape and weight) is replayed
alone, set beside the same calls timed one shape at a time, hot.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments import facts as fx  # noqa: E402
from blockscope.experiments import trace  # noqa: E402
from blockscope.inputs.text import tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.sweeps import resume  # noqa: E402
from blockscope.sweeps.settings import RunSettings  # noqa: E402


def rate(m: int, k: int, n: int, reps: int = 20) -> float:
    """FLOP/s of an (m, k) @ (k, n) float32 product."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return reps * 2 * m * k * n / (time.perf_counter() - start)


def bandwidth() -> float:
    """Bytes/s read plus written by a 256 MB copy into a buffer already touched (a clone
    would time the kernel handing out fresh pages, at a tenth of the rate)."""
    x = torch.ones(64 * 2**20)
    y = torch.empty_like(x).copy_(x)
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    return 5 * 2 * x.numel() * 4 / (time.perf_counter() - start)


def exact_seconds(model, variants, T: int, samples: int, rows: int) -> dict:
    """The exact work's matmul FLOPs, element-wise bytes, and their time at the rates of
    the model's own shapes (measured now) and the copy bandwidth."""
    cfg = model.cfg
    d, d_mlp, H, dh, V = cfg.d_model, cfg.d_mlp, cfg.n_heads, cfg.d_head, cfg.d_vocab
    n_kv = getattr(cfg, "n_key_value_heads", None) or H
    d_kv = n_kv * dh
    shapes = {"q": (d, H * dh), "k": (d, d_kv), "v": (d, d_kv), "o": (H * dh, d),
              "gate": (d, d_mlp), "up": (d, d_mlp), "down": (d_mlp, d)}
    if not getattr(cfg, "gated_mlp", False):
        shapes.pop("gate")
    rates = {name: rate(rows, k, n) for name, (k, n) in shapes.items()}
    rates["unembed"] = rate(min(rows, 256), d, V, 3)
    per_pos = {name: 2 * k * n for name, (k, n) in shapes.items()}
    flops = {k: 0 for k in rates}
    elem = attn = 0
    n = cfg.n_layers
    for v in variants:
        layer, p = resume.entry(v)
        blocks = n - layer
        for t in range(p, T):
            for k, f in per_pos.items():
                flops[k] += samples * blocks * f
            attn += samples * blocks * 4 * H * dh * (t + 1)  # QK and PV, causal keys
            elem += samples * blocks * 4 * (14 * d + 3 * d_mlp + 3 * H * (t + 1)
                                            + 2 * (H * dh + d_kv))
        flops["unembed"] += samples * 2 * d * V
    matmul = sum(flops[k] / rates[k] for k in rates) + attn / rates["o"]
    gbs = bandwidth()
    return {"matmul_gflop": (sum(flops.values()) + attn) / 1e9, "elementwise_gb": elem / 1e9,
            "rates_gflops": {k: round(r / 1e9, 1) for k, r in rates.items()},
            "copy_gb_s": round(gbs / 1e9, 1), "matmul_s": matmul, "elementwise_s": elem / gbs,
            "seconds": matmul + elem / gbs}


class Linears(TorchFunctionMode):
    """Records every `F.linear` call: (input shape, weight, bias)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.calls.append((tuple(args[0].shape), args[1], bias))
        return func(*args, **kwargs)


def split(run) -> dict:
    """Seconds of one cached run (`run()`) by kind of op (torch's profiler, self CPU time),
    and its products replayed alone in their order, and one shape at a time, hot."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        total = time.perf_counter() - start
    by = {"products": 0.0, "attention": 0.0, "rest": 0.0}
    for e in prof.key_averages():
        part = ("products" if e.key in ("aten::mm", "aten::addmm", "aten::bmm") else
                "attention" if "scaled_dot_product" in e.key else "rest")
        by[part] += e.self_cpu_time_total / 1e6
    with Linears() as rec:
        run()
    with torch.inference_mode():
        size = {}  # one random buffer per input width, each call's input a view of it
        for shape, _, _ in rec.calls:
            size[shape[-1]] = max(size.get(shape[-1], 0), torch.Size(shape).numel())
        buf = {k: torch.randn(n) for k, n in size.items()}
        inputs = {shape: buf[shape[-1]][: torch.Size(shape).numel()].view(shape)
                  for shape, _, _ in rec.calls}
        start = time.perf_counter()
        for shape, w, b in rec.calls:
            F.linear(inputs[shape], w, b)
        replayed = time.perf_counter() - start
        hot = {}
        for shape, w, b in rec.calls:
            key = (shape, id(w))
            if key not in hot:
                F.linear(inputs[shape], w, b)
                start = time.perf_counter()
                for _ in range(3):
                    F.linear(inputs[shape], w, b)
                hot[key] = (time.perf_counter() - start) / 3
    return {"run_s": total, **{f"{k}_s": v for k, v in by.items()}, "replayed_s": replayed,
            "hot_s": sum(hot[(shape, id(w))] for shape, w, _ in rec.calls),
            "calls": len(rec.calls)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--facts", type=int, default=1, help="the first N built-in facts")
    ap.add_argument("--length", type=int, default=None,
                    help="only facts of this many tokens (BOS included)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--reps", type=int, default=1, help="cached runs, each with its bound")
    ap.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--split", action="store_true",
                    help="then where the first fact's cached time goes (profiler, products alone)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}; allocator tuned as the CLI does: {tune_allocator()}")
    model = load_model(spec_for(args.model, device="cpu"))
    facts = fx.read_facts(fx.BUILTIN)
    if args.length is not None:
        facts = [f for f in facts if len(tokenize(model.tokenizer, f.prompt,
                                                  prepend_bos=True)[0]) == args.length]
    items = fx.prepared(model, facts[: args.facts], True)
    totals = {"cached": [0.0] * args.reps, "bound": [0.0] * args.reps, "naive": 0.0,
              "work": 0, "naive_work": 0}
    for it in items:
        T = it["tokens"].shape[-1]
        kw = dict(target=it["target"], samples=args.samples)
        vs = trace.variants(model.cfg.n_layers, T, trace.KINDS, 10, None)
        for r in range(args.reps):
            start = time.perf_counter()
            a = trace.trace(model, it["tokens"], it["span"], **kw)
            totals["cached"][r] += time.perf_counter() - start
            how = a.attrs["how"]
            assert how["engine"] == "cached", how
            rows = how["batch_size"] * args.samples * max(1, T // 2)  # a batch's rows x positions
            bound = exact_seconds(model, vs, T, args.samples, rows)  # measured after the run
            totals["bound"][r] += bound["seconds"]
        totals["work"] += how["block_positions"]
        totals["naive_work"] += how["naive_block_positions"]
        if args.naive:
            start = time.perf_counter()
            b = trace.trace(model, it["tokens"], it["span"], **kw,
                            settings=RunSettings(engine="naive"))
            totals["naive"] += time.perf_counter() - start
            off = float((a["p_target"] - b["p_target"]).abs().max())
            print(f"{it['fact'].prompt!r}: {T} tokens, cached = naive to {off:.1e}")
        print(f"  exact work {bound['matmul_gflop']:.1f} GFLOP ({bound['matmul_s']:.1f} s), "
              f"{bound['elementwise_gb']:.2f} GB element-wise ({bound['elementwise_s']:.1f} s at "
              f"{bound['copy_gb_s']} GB/s); rates {bound['rates_gflops']} GFLOP/s")
    ratios = sorted(c / b for c, b in zip(totals["cached"], totals["bound"], strict=True))
    c, b, nv = totals["cached"][-1], totals["bound"][-1], totals["naive"]
    print(f"{len(items)} facts, {args.samples} samples, 3 kinds: cached {c:.1f} s, exact-work "
          f"bound {b:.1f} s (cached / bound, each rep: "
          + ", ".join(f"{x / y:.2f}" for x, y in zip(totals["cached"], totals["bound"],
                                                     strict=True))
          + f"; median {ratios[len(ratios) // 2]:.2f})"
          + (f", naive {nv:.1f} s (naive / cached {nv / c:.2f})" if args.naive else ""))
    print(f"block-positions: cached {totals['work']:,}, naive {totals['naive_work']:,} "
          f"({totals['naive_work'] / totals['work']:.2f}x), before the naive loop's "
          "unembedding of every position")
    if args.split:
        it = items[0]
        sp = split(lambda: trace.trace(model, it["tokens"], it["span"], target=it["target"],
                                       samples=args.samples))
        print(f"split of one cached run of the first fact ({sp['run_s']:.1f} s profiled): "
              f"products {sp['products_s']:.1f} s, attention {sp['attention_s']:.1f} s, "
              f"the rest {sp['rest_s']:.1f} s; its {sp['calls']:,} products replayed alone "
              f"{sp['replayed_s']:.1f} s, one shape at a time hot {sp['hot_s']:.1f} s")


if __name__ == "__main__":
    main()
