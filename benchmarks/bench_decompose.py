"""Time `ablate --decompose` against plain `ablate` on one model, in one process.

    python benchmarks/bench_decompose.py                       # smollm2-135m, 469 tokens
    python benchmarks/bench_decompose.py --model DIR --tokens 200 --repeat 3

Loads the model once (blockscope's own loader: `get-model smollm2-135m` first, or any
checkpoint directory), then alternates the cached block sweep (`block_ablation`) and the
cached decomposition (`decomposed`, blocks) on the same tokens, --repeat times each, so the
machine's drift falls on both alike; the naive decomposition once, for scale. It prints the
medians, the extra time of the decomposition over the plain sweep (the target: under 25%),
and how far the cached split is from the naive one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments.ablate import block_ablation, decomposed  # noqa: E402
from blockscope.inputs.text import DEFAULT_TEXT, read_passage, tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.sweeps.settings import RunSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=469)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-naive", action="store_true")
    args = parser.parse_args()
    tune_allocator()
    model = load_model(spec_for(args.model, device="cpu"))
    ids = tokenize(model.tokenizer, read_passage(DEFAULT_TEXT).text, prepend_bos=True,
                   max_tokens=args.tokens)
    times: dict[str, list[float]] = {"ablate": [], "decompose": []}
    for _ in range(args.repeat):
        for what in times:
            start = time.perf_counter()
            if what == "ablate":
                block_ablation(model, ids)
            else:
                cached, tokens = decomposed(model, ids)
                assert cached.attrs["engine"] == {"engine": "cached"}, cached.attrs["engine"]
            times[what].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{model.cfg.n_layers} blocks, {ids.shape[-1]} tokens: plain ablate (cached) "
          f"{med['ablate']:.2f} s {[round(t, 2) for t in times['ablate']]}, ablate --decompose "
          f"(cached) {med['decompose']:.2f} s {[round(t, 2) for t in times['decompose']]}: "
          f"{med['decompose'] / med['ablate'] - 1:+.1%} extra (target under +25%)")
    if not args.skip_naive:
        start = time.perf_counter()
        naive, naive_tokens = decomposed(model, ids, settings=RunSettings(engine="naive"))
        took = time.perf_counter() - start
        cols = ["total", "direct", "downstream", "final_norm"]
        off = float((tokens[cols] - naive_tokens[cols]).abs().max().max())
        scale = float(naive_tokens[cols].abs().max().max())
        print(f"ablate --decompose, naive: {took:.2f} s ({took / med['decompose']:.2f}x the "
              f"cached); cached = naive per token to {off:.1e} ({off / scale:.1e} of the "
              f"largest term, {scale:.1f})")


if __name__ == "__main__":
    main()
