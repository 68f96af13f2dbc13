"""Time two source trees of blockscope against each other: the cached block sweep, the cached
single-head sweep and the whole `blockscope ablate` command, on a random-init model of
GPT-2 small's shapes (or the Llama of bench_sweeps), alternating the trees run by run.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_versions.py --before /tmp/before --repeat 3

Each timing runs in a fresh process whose PYTHONPATH puts that tree's `src` first, so the
same interpreter and packages run both; the order alternates (before, after, after, before,
...) so the machine's drift falls on both alike. The sweeps are timed inside the process,
after loading; the command is timed whole (import and load included, the same on both). A
tree with the older flat layout (blockscope.ablate, blockscope.loading) is found as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALICE = os.path.join(HERE, "..", "data", "alice.txt")

CHILD = r"""
import json, sys, time
from blockscope.allocator import tune_allocator
tune_allocator()
try:
    from blockscope.experiments.ablate import block_ablation
    from blockscope.experiments.heads import single_head_ablation
    from blockscope.inputs.text import read_passage, tokenize
    from blockscope.model.loading import load_model, spec_for
except ImportError:  # the flat layout before the subpackages
    from blockscope.ablate import block_ablation
    from blockscope.heads import single_head_ablation
    from blockscope.loading import load_model, spec_for
    from blockscope.text import read_passage, tokenize
kind, model_dir, alice, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = load_model(spec_for(model_dir, device="cpu"))
ids = tokenize(model.tokenizer, read_passage(alice).text, prepend_bos=True, max_tokens=n)
sweep = block_ablation if kind == "blocks" else single_head_ablation
start = time.perf_counter()
df = sweep(model, ids)
print(json.dumps({"s": time.perf_counter() - start, "ppl": df["perplexity"].tolist()}))
"""


def run(tree: str, args: list[str], what: str, model_dir: str, tokens: int) -> tuple[float, list]:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"), HF_HUB_OFFLINE="1")
    if what == "ablate":
        out_dir = tempfile.mkdtemp()
        cmd = [sys.executable, "-c", "import sys; from blockscope.cli import main; "
               "sys.argv[0] = 'blockscope'; main()", "ablate", "--model", model_dir,
               "--text", ALICE, "--max-tokens", str(tokens), "--out-dir", out_dir, "-q"]
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        return time.perf_counter() - start, []
    out = subprocess.run([sys.executable, "-c", CHILD, what, model_dir, ALICE, str(tokens)],
                         env=env, check=True, capture_output=True, text=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    return record["s"], record["ppl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the other source tree's root")
    parser.add_argument("--after", default=os.path.join(HERE, ".."), help="default: this one")
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--what", action="append", choices=["blocks", "heads", "ablate"],
                        help="what to time; repeat for several (default: all three)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=469)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from bench_sweeps import save_llama

    from blockscope.model.toy import save_gpt2_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, args.arch)
        if args.arch == "gpt2":
            save_gpt2_checkpoint(model_dir)
        else:
            save_llama(model_dir)
        for what in args.what or ["blocks", "heads", "ablate"]:
            times: dict = {"before": [], "after": []}
            ppl: dict = {}
            for i in range(args.repeat):
                order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                for side in order:
                    s, p = run(getattr(args, side), [], what, model_dir, args.tokens)
                    times[side].append(s)
                    ppl[side] = p
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            same = ""
            if ppl["before"]:
                rel = max(abs(x - y) / abs(x) for x, y in zip(ppl["before"], ppl["after"],
                                                              strict=True))
                same = f"; perplexities agree to {rel:.1e} relative"
            print(f"{args.arch} {what}: before {b:.2f} s {[round(t, 2) for t in times['before']]}, "
                  f"after {a:.2f} s {[round(t, 2) for t in times['after']]}: after/before "
                  f"{a / b:.3f}{same}", flush=True)


if __name__ == "__main__":
    main()
