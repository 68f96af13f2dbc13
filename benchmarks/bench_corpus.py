"""Corpus sweeps: tokens per second of `ablate --dataset`, and peak memory at two corpus sizes.

    python benchmarks/bench_corpus.py                       # GPT-2 small's shapes, 5k and 50k
    python benchmarks/bench_corpus.py --n-layer 4 --n-embd 256 --sizes 5000,50000

Builds, in a temp dir, a random-init GPT-2 (default GPT-2 small's exact shapes; the
vocabulary is always GPT-2's 50,257, so the unembedding costs what it costs there) and a
jsonl corpus of documents of 40 to 900 tokens cut from the Alice passage. Then, for each
corpus size, `blockscope ablate --dataset corpus.jsonl --n-tokens N --bootstrap 1000` runs in
a fresh process, as a user would run it, and the benchmark reads that process's peak RSS
from the kernel (`wait4`) and its sweep time from the sidecar (wall time net of loading).
It prints tokens per second (scored tokens x variants / sweep seconds, and the corpus's
tokens / sweep seconds) and the peak RSS ratio of the largest size to the smallest (medians of
--repeat alternating runs), against the target: within 10% (memory flat in corpus size).

Peak RSS is set by the longest document a run meets (up to the context: the engine's batch of
variants over its tokens), not by how many it meets; a larger sample of one length
distribution tends to meet longer ones. So the corpus starts with a document of the longest
length (default 900 tokens, the rest drawn from 40-900): both sizes meet it, and the ratio
measures what the corpus size adds.
Repeated runs of one size differ by a few percent (allocation timing across threads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FLAT = 0.10  # peak RSS at the largest size within 10% of the smallest's


def write_corpus(path: Path, tokenizer, n_tokens: int, lengths: tuple[int, int],
                 seed: int = 0) -> int:
    """Documents of `lengths` (min, max) tokens cut from the Alice passage, until
    `n_tokens`."""
    from blockscope.inputs.text import packaged_alice

    ids = tokenizer.encode(packaged_alice().read_text(encoding="utf-8"))
    rng = random.Random(seed)
    total, n_docs = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while total < n_tokens:
            # the longest first: every corpus size meets it (peak RSS follows it)
            length = lengths[1] if n_docs == 0 else rng.randint(*lengths)
            start = rng.randint(0, max(0, len(ids) - length))
            text = tokenizer.decode(ids[start:start + length])
            f.write(json.dumps({"text": text}) + "\n")
            total += length
            n_docs += 1
    return n_docs


def run_ablate(model_dir: Path, corpus: Path, n_tokens: int, out: Path) -> dict:
    """`blockscope ablate --dataset` in a fresh process: its peak RSS, wall and sweep time."""
    cmd = [sys.executable, "-m", "blockscope", "ablate", "--model", str(model_dir),
           "--dataset", str(corpus), "--n-tokens", str(n_tokens), "--bootstrap", "1000",
           "--no-plot", "-q", "--out-dir", str(out)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ablate failed: {stderr.strip()[-2000:]}")
    csv = Path(stdout.strip())
    meta = json.loads(csv.with_suffix(".json").read_text())
    variants = len(csv.read_text().splitlines()) - 1  # baseline + one per block
    return {"n_tokens": n_tokens, "n_docs": meta["n_docs"], "wall_s": wall,
            "sweep_s": meta["sweep_s"], "peak_rss_gb": usage.ru_maxrss / 2**20,
            "variants": variants, "n_scored": meta["n_scored"],
            "replay": meta.get("replay"), "batch_size": meta.get("batch_size")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--sizes", default="5000,50000", help="corpus token budgets")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each size, alternating; the median peak RSS is compared")
    parser.add_argument("--doc-tokens", default="40,900",
                        help="document lengths min,max (drawn uniformly; 500,500: all equal)")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    from blockscope.model.toy import gpt2_tokenizer, save_gpt2_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = save_gpt2_checkpoint(tmp / "model", n_layer=args.n_layer,
                                         n_embd=args.n_embd, n_head=args.n_head)
        corpus = tmp / "corpus.jsonl"
        lengths = tuple(int(x) for x in args.doc_tokens.split(","))
        n_docs = write_corpus(corpus, gpt2_tokenizer(), max(sizes) + 1000, lengths)
        print(f"model: {args.n_layer} layers, d_model {args.n_embd}, {args.n_head} heads, "
              f"vocabulary 50,257 (random weights); corpus: {n_docs} documents of "
              f"{lengths[0]}-{lengths[1]} tokens")
        runs = [run_ablate(model_dir, corpus, n, tmp / f"out-{n}-{i}")
                for i in range(args.repeat) for n in sizes]
    for r in runs:
        work = r["n_scored"] * r["variants"]
        print(f"{r['n_tokens']:>7,} tokens in {r['n_docs']:>4} documents: sweep "
              f"{r['sweep_s']:7.1f} s ({r['n_scored'] / r['sweep_s']:7.0f} corpus tokens/s, "
              f"{work / r['sweep_s']:8.0f} token-variants/s, {r['variants']} variants), "
              f"wall {r['wall_s']:6.1f} s, peak RSS {r['peak_rss_gb']:.2f} GB "
              f"(replay {r['replay']}, batch {r['batch_size']})")
    peak = {n: statistics.median(r["peak_rss_gb"] for r in runs if r["n_tokens"] == n)
            for n in sizes}
    growth = peak[sizes[-1]] / peak[sizes[0]] - 1
    print(f"peak RSS (median of {args.repeat}) at {sizes[-1]:,} tokens vs {sizes[0]:,}: "
          f"{peak[sizes[-1]]:.2f} vs {peak[sizes[0]]:.2f} GB, {growth:+.1%} "
          f"(target within {FLAT:.0%}: {'met' if abs(growth) <= FLAT else 'NOT met'})")


if __name__ == "__main__":
    main()
