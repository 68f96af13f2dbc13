"""Time blockscope's sweeps on random-init, full-size models (no download).

    python benchmarks/bench_sweeps.py            # needs the bench extra: pip install -e ".[bench]"
    python benchmarks/bench_sweeps.py --arch llama --skip-naive-heads

Builds, in a temp dir, GPT2LMHeadModel(GPT2Config()) (GPT-2 small's exact shapes and cost)
and a Llama at GPT-2 small's size (12 layers, d_model 768, 12 heads, 4 K/V heads, SwiGLU
width 2048, vocabulary 50,257), loads each through blockscope's own loader, and times in
one run, each the median of --repeat runs: one forward of 469 tokens (+ BOS); the block
sweep (baseline + 12 skips) and the
single-head sweep (144 heads), naive (one hooked forward per variant) against the cached
engine; and Michel et al.'s gradient pass. It prints each ratio, peak RSS per phase, the
floating-point work of each sweep (torch's FlopCounterMode), the GFLOP/s achieved, and a
large matmul's GFLOP/s as the machine's practical peak.

The naive loops run first with glibc's default allocator, as a notebook would; the engine
then runs with the allocator tuned (`tune_allocator`, as the CLI does), and the naive block
sweep is timed again under the tuned allocator to separate the two gains.

The peak RSS printed per phase is this process's, so it includes whatever the earlier phases
left on the heap (the tuned allocator keeps freed memory by design). At the end each engine
sweep runs once more alone in a fresh process, as the CLI would, for its own peak RSS.

What a user waits for is the whole command, so each model also runs `blockscope ablate` and
`blockscope prune-heads` (their defaults: PNG, metrics, CSV and JSON writes included) in fresh
processes through the `blockscope` script's own entry point (which tunes the allocator first,
for either engine), naive and cached alternating, timed net of loading: importing torch,
transformers and TransformerLens (done first, as any tool here must) and the time inside the
CLI's `load` (reading the weights). Each ratio is printed against its target (block sweep
2x, head sweep 1.8x), and the engine's numbers against the naive loop's (1e-5 relative).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments.ablate import block_ablation  # noqa: E402
from blockscope.experiments.heads import head_importance, single_head_ablation  # noqa: E402
from blockscope.inputs.text import read_passage, tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.model.toy import gpt2_tokenizer, save_gpt2_checkpoint  # noqa: E402
from blockscope.sweeps.settings import RunSettings

# A Llama at GPT-2 small's size: grouped-query attention (4 K/V heads), SwiGLU 2048.
LLAMA_SMALL = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=1024,
                   initializer_range=0.02)
def save_llama(path: str) -> None:
    """A random-init LlamaForCausalLM of LLAMA_SMALL's sizes with the GPT-2 tokenizer (as
    the tests' family builder makes them, with the real shapes)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50257, bos_token_id=50256, eos_token_id=50256,
                                      **LLAMA_SMALL)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    gpt2_tokenizer().save_pretrained(path)


TARGETS = {"blocks": 2.0, "heads": 1.8}  # engine / naive, sweep and whole command
REL = 1e-5  # engine and naive numbers must agree to this, relative


class PeakRSS:
    """Samples this process's RSS every 20 ms while the `with` body runs."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        proc = psutil.Process()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                time.sleep(0.02)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


def timed(fn, repeat: int) -> tuple[float, list[float], int]:
    times = []
    with PeakRSS() as rss:
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times), times, rss.peak


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(repeat: int) -> tuple[float, float]:
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    big, _, _ = timed(lambda: a @ b, repeat)
    x, w = torch.randn(469, 768), torch.randn(768, 50257)
    unembed, _, _ = timed(lambda: x @ w, repeat)
    return 2 * 4096**3 / big / 1e9, 2 * 469 * 768 * 50257 / unembed / 1e9


def sweep_fn(kind: str, model, ids):
    if kind == "blocks":
        return lambda: block_ablation(model, ids)
    return lambda: single_head_ablation(model, ids)


def child(kind: str, model_dir: str, tokens: int) -> None:
    """Run one engine sweep in this fresh process and print its peak RSS in bytes."""
    tune_allocator()
    model = load_model(spec_for(model_dir, device="cpu"))
    ids = tokenize(model.tokenizer, read_passage(ALICE).text, prepend_bos=True,
                   max_tokens=tokens)
    sweep_fn(kind, model, ids)()
    # VmHWM: this process's own high-water mark (ru_maxrss would carry the parent's: Linux
    # keeps it across fork and exec), read without a sampling thread in the process.
    try:
        peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError):
        peak = psutil.Process().memory_info().rss
    print(f"RSS {peak}")


def isolated_rss(kind: str, model_dir: str, tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--model-dir", model_dir,
                          "--tokens", str(tokens)], capture_output=True, text=True, check=True)
    return int(out.stdout.split("RSS ")[-1]) / 2**30


ALICE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "alice.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], action="append",
                        help="model(s) to time; repeat for several (default: both)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing (median)")
    parser.add_argument("--tokens", type=int, default=469, help="text tokens (BOS added)")
    parser.add_argument("--skip-naive-heads", action="store_true",
                        help="skip the naive single-head sweep (about 100-140 s a run here)")
    parser.add_argument("--skip-commands", action="store_true",
                        help="skip timing the whole commands in fresh processes")
    parser.add_argument("--interleaved-only", action="store_true",
                        help="only time naive and engine sweeps alternately (allocator tuned): "
                        "the ratio least exposed to the machine's drift")
    parser.add_argument("--commands-only", choices=["ablate", "prune-heads"], action="append",
                        help="only time these whole commands (naive and cached alternating, "
                        "net of loading); repeat for both")
    parser.add_argument("--child", choices=["blocks", "heads"], help=argparse.SUPPRESS)
    parser.add_argument("--child-command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model_dir, args.tokens)
    if args.child_command:
        return child_command(args.child_command)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ["gpt2", "llama"]:
            path = os.path.join(tmp, f"{arch}-random")
            if arch == "gpt2":
                save_gpt2_checkpoint(path)
            else:
                save_llama(path)
            run(args, path, arch)


def child_command(argv: list[str]) -> None:
    """Run one blockscope command in this fresh process as the `blockscope` script does
    (`blockscope.cli.main`: the allocator tuned first); print its wall time net of loading:
    importing torch, transformers and TransformerLens, and the time inside the CLI's `load`
    (reading the weights)."""
    start = time.perf_counter()
    import torch  # noqa: F401  (the libraries any tool here imports before it can start)
    import transformer_lens.model_bridge  # noqa: F401
    import transformers  # noqa: F401

    imported = time.perf_counter() - start
    from blockscope import cli
    from blockscope.api import common

    in_load = []
    real = common.load

    def timed_load(*a, **kw):
        t = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            in_load.append(time.perf_counter() - t)

    common.load = timed_load
    sys.argv = ["blockscope", *argv]
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    total = time.perf_counter() - start
    loading = imported + sum(in_load)
    print(f"BENCH_NET {total - loading} LOAD {loading} IMPORTS {imported}")


def command_times(model_dir: str, tokens: int, command: list[str], repeat: int, out: str):
    """Median seconds net of loading per engine, naive and cached alternating."""
    times = {"naive": [], "cached": []}
    for _ in range(repeat):
        for engine in times:
            argv = [*command, "--model", model_dir, "--text", ALICE, "--max-tokens", str(tokens),
                    "--engine", engine, "--out-dir", os.path.join(out, engine)]
            done = subprocess.run([sys.executable, __file__, "--child-command", *argv],
                                  capture_output=True, text=True, check=True)
            times[engine].append(float(done.stdout.split("BENCH_NET ")[-1].split()[0]))
    return {e: statistics.median(t) for e, t in times.items()}, times


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x (target {target}x: {'met' if ratio >= target else 'NOT met'})"


def same_numbers(fast, naive) -> str:
    got, want = fast["perplexity"].to_numpy(), naive["perplexity"].to_numpy()
    rel = float(abs(got - want).max() / abs(want).max())
    met = "met" if rel <= REL else "NOT met"
    return f"max relative difference {rel:.1e} (target {REL:.0e}: {met})"


def interleaved(model, ids, repeat: int) -> None:
    """Naive and engine runs of each sweep alternating, allocator tuned: the machine's speed
    drifts by tens of percent over minutes, so the ratio of medians of alternating runs is
    the one to trust."""
    tune_allocator()
    for kind in ("blocks", "heads"):
        fn = block_ablation if kind == "blocks" else single_head_ablation
        times: dict[str, list[float]] = {"naive": [], "cached": []}
        frames = {}
        for _ in range(repeat):
            for engine in times:
                start = time.perf_counter()
                frames[engine] = fn(model, ids, settings=RunSettings(engine=engine))
                times[engine].append(time.perf_counter() - start)
        med = {e: statistics.median(t) for e, t in times.items()}
        print(f"{kind} sweep, alternating: naive {med['naive']:.2f} s "
              f"{[round(t, 2) for t in times['naive']]}, engine {med['cached']:.2f} s "
              f"{[round(t, 2) for t in times['cached']]}: "
              f"{verdict(med['naive'] / med['cached'], TARGETS[kind])}; numbers: "
              f"{same_numbers(frames['cached'], frames['naive'])}", flush=True)


def run(args, model_dir: str, arch: str) -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores, python {sys.version.split()[0]}")
    peak, unembed_rate = matmul_peak(args.repeat)
    print(f"matmul 4096^3: {peak:.0f} GFLOP/s (practical peak); "
          f"unembedding 469x768x50257: {unembed_rate:.0f} GFLOP/s")

    model = load_model(spec_for(model_dir, device="cpu"))
    ids = tokenize(model.tokenizer, read_passage(ALICE).text, prepend_bos=True,
                   max_tokens=args.tokens)
    what = "GPT-2 small" if arch == "gpt2" else "Llama at GPT-2 small's size"
    print(f"\n== random-init {what}, {ids.shape[1]} tokens (BOS + {args.tokens}), fp32, cpu")

    if args.interleaved_only:
        return interleaved(model, ids, args.repeat)
    if args.commands_only:
        return time_commands(model_dir, args, args.commands_only)

    def forward():
        with torch.inference_mode():
            model(ids, return_type="logits")

    results = []

    def report(name, fn, repeat, work=None):
        median, times, rss = timed(fn, repeat)
        work = flops(fn) if work is None else work
        rate = work / median / 1e9
        results.append((name, median))
        print(f"{name:<34} median {median:7.2f} s  runs {[round(t, 2) for t in times]}  "
              f"peak RSS {rss / 2**30:.2f} GB  work {work / 1e12:6.3f} TFLOP  "
              f"{rate:5.0f} GFLOP/s  (bound at peak {work / peak / 1e9:6.2f} s)", flush=True)
        return median

    f1 = flops(forward)
    report("one forward", forward, args.repeat, f1)
    n_blocks, n_heads = model.cfg.n_layers, model.cfg.n_layers * model.cfg.n_heads
    naive_blocks = report("block sweep, naive (default malloc)",
                          lambda: block_ablation(model, ids,
                                                 settings=RunSettings(engine="naive")), args.repeat,
                          f1 * (n_blocks + 1))
    naive_heads, ref = None, {}
    naive_blocks_df = block_ablation(model, ids, settings=RunSettings(engine="naive"))
    if not args.skip_naive_heads:
        naive_heads = report("head sweep, naive (default malloc)",
                             lambda: ref.update(heads=single_head_ablation(model, ids,
                                                                           settings=RunSettings(engine="naive"))),
                             args.repeat, f1 * (n_heads + 1))
    print(f"allocator tuned (mallopt): {tune_allocator()}")
    tuned_blocks = report("block sweep, naive (tuned malloc)",
                          lambda: block_ablation(model, ids,
                                                 settings=RunSettings(engine="naive")), args.repeat,
                          f1 * (n_blocks + 1))
    last = {}
    fast_blocks = report("block sweep, engine",
                         lambda: last.update(blocks=sweep_fn("blocks", model, ids)()),
                         args.repeat)
    fast_heads = report("head sweep, engine",
                        lambda: last.update(heads=sweep_fn("heads", model, ids)()), args.repeat)
    print(f"engine ran as: blocks {last['blocks'].attrs['engine']}, "
          f"heads {last['heads'].attrs['engine']}")
    report("Michel gradient pass", lambda: head_importance(model, ids), args.repeat)
    print(f"block sweep: engine {verdict(naive_blocks / fast_blocks, TARGETS['blocks'])} the "
          f"naive loop (default malloc), {tuned_blocks / fast_blocks:.2f}x naive (tuned malloc); "
          f"numbers: {same_numbers(last['blocks'], naive_blocks_df)}")
    if naive_heads:
        print(f"head sweep: engine {verdict(naive_heads / fast_heads, TARGETS['heads'])} the "
              f"naive loop (default malloc); numbers: "
              f"{same_numbers(last['heads'], ref['heads'])}")
    print(f"this process: RSS {psutil.Process().memory_info().rss / 2**30:.2f} GB now, "
          f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")
    for kind in ("blocks", "heads"):
        print(f"peak RSS of a fresh process loading the model and running only the engine's "
              f"{kind} sweep: {isolated_rss(kind, model_dir, args.tokens):.2f} GB", flush=True)
    if args.skip_commands:
        return
    time_commands(model_dir, args, ["ablate", "prune-heads"])


def time_commands(model_dir: str, args, commands: list[str]) -> None:
    """Each whole command in fresh processes, naive and cached alternating, net of loading."""
    with tempfile.TemporaryDirectory() as out:
        for command in commands:
            kind = "blocks" if command == "ablate" else "heads"
            med, runs = command_times(model_dir, args.tokens, [command], args.repeat, out)
            print(f"blockscope {command}, whole command net of loading: naive "
                  f"{med['naive']:.1f} s {[round(t, 1) for t in runs['naive']]}, cached "
                  f"{med['cached']:.1f} s {[round(t, 1) for t in runs['cached']]}: "
                  f"{verdict(med['naive'] / med['cached'], TARGETS[kind])}", flush=True)


if __name__ == "__main__":
    main()
