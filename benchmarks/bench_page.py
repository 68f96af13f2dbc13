"""How fast a page draws (issue 63: a 30 x 30 x 3 heatmap within 1 s in headless Chromium).

    python benchmarks/bench_page.py [--reps 5]

A `patch`-shaped run, three sites of 30 layers x 30 positions (2,700 cells, random values),
written as its page into a temp folder and opened `--reps` times in headless Chromium
(network off). The time is the page's own clock when its last chart is drawn
(`performance.now()` at `data-ready`, from navigation start: parsing plotly.js included),
median over reps; beside it, the page's size without the shared script. Speed is
measured here, never in the tests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from blockscope.api.result import Result


def run() -> Result:
    rng = np.random.default_rng(0)
    rows = [{"site": s, "layer": layer, "head": None, "position": p, "token": f"t{p}",
             "logit_diff": float(rng.normal()), "normalized": float(rng.normal())}
            for s in ("resid-pre", "attn-out", "mlp-out") for layer in range(30)
            for p in range(30)]
    return Result("patch", "patch-bench", "00000000", {"main": pd.DataFrame(rows)},
                  {"command": "patch", "date": "2026-12-07T00:00:00+00:00"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    folder = Path(tempfile.mkdtemp())
    paths = run().save(folder)
    page = next(p for p in paths if p.suffix == ".html")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400",
                "--host-resolver-rules=MAP * ~NOTFOUND"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    times = []
    try:
        for _ in range(a.reps):
            driver.get("about:blank")
            driver.get(page.as_uri())
            while not (ready := driver.execute_script("return document.body.dataset.ready")):
                time.sleep(0.01)
            times.append(float(ready) / 1000)
    finally:
        driver.quit()
    print(f"30 x 30 x 3 heatmap page: {page.stat().st_size / 1000:.0f} KB without the script; "
          f"drawn in {statistics.median(times):.2f} s (median of {a.reps}; target 1 s), "
          f"runs: {', '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
