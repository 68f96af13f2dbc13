"""The README's picture of a run's page: `trace` on smollm2-135m, its page opened in headless
Chromium (no network), the top of it saved as docs/images/trace-page.png.

    python scripts/page-screenshot.py [--out-dir /tmp/trace-page]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="/tmp/trace-page")
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()
    out = Path(a.out_dir)
    subprocess.run([sys.executable, "-m", "blockscope", "trace", "The capital of France is",
                    "--subject", "France", "--model", a.model, "--out-dir", str(out), "-q"],
                   check=True)
    page = max(out.glob("trace-*.html"), key=lambda p: p.stat().st_mtime)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,1060",
                "--host-resolver-rules=MAP * ~NOTFOUND", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(page.as_uri())
        while not driver.execute_script("return document.body.dataset.ready"):
            time.sleep(0.05)
        target = REPO / "docs" / "images" / "trace-page.png"
        driver.save_screenshot(str(target))
        print(f"wrote {target} from {page}")  # noqa: T201 (a script says what it wrote)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
