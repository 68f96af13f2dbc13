"""Time `attribute` on a real or random-init model: AtP and integrated gradients over
`patch`'s whole grid, against one forward pass and against the exact grid by `patch`, all in
one process, with each estimate's correlation with exact patching beside its time.

    python benchmarks/bench_attribute.py [--model smollm2-135m] [--length 64] [--steps 5]
                                         [--reps 3] [--no-exact]

The pair: the first `length` tokens of data/alice.txt (BOS first) and the same with one
token in the middle replaced; the target is the clean run's top next token, the contrast
the corrupted run's. The grid: every (layer, position) of resid-pre, attn-out and mlp-out,
and every head's z. Times are medians over `--reps`, alternating the methods, with the
forward pass timed in every rep (this machine's speed drifts by a fifth within minutes:
only ratios within one rep are compared). The target (issue 62): AtP within the time of 4
forward passes. `atp-star`'s estimate is AtP's here (no q or k cells; the QK fix has
nothing to fix), plus GradDrop's bound, one backward more per block, whose ranking is set
against |exact|. Peak memory is the process's resident set after each stage (monotone: a
stage that needs more raises it).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from blockscope.allocator import tune_allocator  # noqa: E402
from blockscope.experiments import patch  # noqa: E402
from blockscope.inputs.text import tokenize  # noqa: E402
from blockscope.model.loading import load_model, spec_for  # noqa: E402
from blockscope.sweeps import attribution  # noqa: E402
from blockscope.sweeps.interchange import Run, sweep  # noqa: E402
from blockscope.sweeps.metrics import LogitDiff  # noqa: E402

SITES = ["resid-pre", "attn-out", "mlp-out", "z"]  # the grid; q, k, v run naive


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-exact", action="store_true")
    a = ap.parse_args()
    tune_allocator()
    model = load_model(spec_for(a.model, device="cpu"))
    text = open("data/alice.txt", encoding="utf-8").read()
    clean = tokenize(model.tokenizer, text, prepend_bos=True, max_tokens=a.length)
    corrupted = clean.clone()
    mid = a.length // 2
    corrupted[0, mid] = clean[0, mid + 1]  # another token of the passage, not a new one
    with torch.inference_mode():
        lc = model(clean, return_type="logits")[0, -1]
        lx = model(corrupted, return_type="logits")[0, -1]
    target, contrast = int(lc.argmax()), int(lx.argmax())
    if target == contrast:
        contrast = int(lx.topk(2).indices[1])
    metric = LogitDiff(target, contrast)
    cfg = model.cfg
    grid = patch.variants(cfg, a.length, SITES)
    base, sources = Run(corrupted), {"clean": Run(clean)}
    print(f"{a.model}: {cfg.n_layers} blocks, {a.length} tokens, changed at {mid}; "
          f"{len(grid)} cells; resident {rss_mb():.0f} MB after the load")

    def forward():
        with torch.inference_mode():
            return model(corrupted, return_type="logits")

    methods = {"atp": lambda: attribution.estimate(model, base, sources, grid, metric),
               f"ig({a.steps})": lambda: attribution.estimate(model, base, sources, grid,
                                                            metric, "ig", a.steps),
               "atp-star": lambda: attribution.estimate(model, base, sources, grid, metric,
                                                        "atp-star")}
    times = {k: [] for k in ["forward", *methods]}
    ratios = {k: [] for k in methods}
    peak, found = {}, {}
    forward()
    for _ in range(a.reps):
        for name, fn in methods.items():
            t_fwd, _ = timed(forward)
            t, found[name] = timed(fn)
            times["forward"].append(t_fwd)
            times[name].append(t)
            ratios[name].append(t / t_fwd)
            peak[name] = rss_mb()
    exact = None
    if not a.no_exact:
        t_exact, exact = timed(lambda: sweep(model, base, sources, grid, metric))
        peak["exact"] = rss_mb()
    fwd = statistics.median(times["forward"])
    print(f"one forward (corrupted prompt): {fwd * 1e3:.0f} ms (median of "
          f"{len(times['forward'])})")
    rows = []
    inert = found["atp"].inert
    for name in methods:
        est = found[name]
        row = {"method": name, "time_s": statistics.median(times[name]),
               "x_forward": statistics.median(ratios[name]),
               "forwards": est.how["forwards"], "backwards": est.how["backwards"],
               "peak_mb": peak[name]}
        if exact is not None:
            change = exact.values[:, 0] - exact.base[0]
            for site in SITES:
                sel = np.array([v.label["site"] == site for v in grid]) & ~inert
                row[f"spearman_{site}"] = pd.Series(est.values[sel]).corr(
                    pd.Series(change[sel]), method="spearman")
            if est.bound is not None:  # GradDrop's bound ranks magnitudes: against |exact|
                sel = ~inert
                row["spearman_graddrop_abs"] = pd.Series(est.bound[sel]).corr(
                    pd.Series(np.abs(change[sel])), method="spearman")
        rows.append(row)
    if exact is not None:
        rows.append({"method": "exact (patch, cached)", "time_s": t_exact,
                     "x_forward": t_exact / fwd, "peak_mb": peak["exact"],
                     "block_positions": exact.how.get("block_positions")})
    pd.set_option("display.width", 200)
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print("target: atp within 4 forward passes:",
          "met" if statistics.median(ratios["atp"]) <= 4 else "not met")


if __name__ == "__main__":
    main()
