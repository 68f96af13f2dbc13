"""Each run's page and `report`'s index, in a real browser: headless Chromium (Debian's
`chromium` and `chromium-driver`), driven by selenium, with every host name resolving to
nothing. A page must load with no console error and no request but for its own folder's
files; pointing at a heatmap's cell shows the CSV's value; a table sorts on a click; the
attention view switches heads; the index filters by command. Where no Chromium is found,
these tests are skipped, saying so (.ci/run installs it)."""

import json
import shutil
import time

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.results.page import SCRIPT

from ..conftest import ALICE, result

PROMPT = "The capital of France is"
PAIR = dict(clean=PROMPT, corrupted="The capital of Italy is", target=" Paris",
            contrast=" Rome")
TEXT = dict(text=str(ALICE), max_tokens=30)
# every command with a chart, and one with its table alone (params), run from Python on the
# tiny model held once (a load per command would double the fixture's time)
RUNS = {"patch": dict(**PAIR, site=["resid-pre", "z"]),
        "attribute": dict(**PAIR, site=["mlp-out"], check_cells="1"),
        "circuit": dict(**PAIR, method="atp"),
        "attention": dict(prompt="The capital of France", layer="1"),
        "trace": dict(prompt=PROMPT, subject="France", samples=1),
        "knockout": dict(prompt=PROMPT, subject="France"),
        "logit-lens": dict(prompt=PROMPT),
        "resid-norm": dict(prompt=PROMPT),
        "ablate": dict(**TEXT, bootstrap=0),
        "head-roles": dict(**TEXT),
        "prune-heads": dict(**TEXT, step=0.5, bootstrap=0),
        "prune-blocks": dict(**TEXT, bootstrap=0),
        "params": dict(model=["gpt2"])}
MAX_PAGE = 300_000  # bytes, without the shared script (issue 63)


def chromium() -> tuple[str, str] | None:
    """(the browser, its driver) where both are installed."""
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser",
                                              "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def pages(tiny, tmp_path_factory):
    """A run of each command in RUNS on the tiny model, saved in one folder as the command
    line saves it (`Result.save`: CSV, sidecar, page, script), and the folder's index."""
    import blockscope as bs

    out = tmp_path_factory.mktemp("pages")
    for name, options in RUNS.items():
        run = getattr(bs, name.replace("-", "_"))
        result = run(**options) if "model" in options else run(tiny, **options)
        result.pictures.clear()  # no PNG: the pages are what is tested here
        result.save(out)
    res = CliRunner().invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def browser():
    found = chromium()
    if found is None:
        pytest.skip("no Chromium and chromedriver found (apt-get install chromium "
                    "chromium-driver): the pages' browser tests are skipped")
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,1400", "--host-resolver-rules=MAP * ~NOTFOUND"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    yield driver
    driver.quit()


def opened(driver, path):
    """Load the page and wait until its charts are drawn (the body's data-ready)."""
    driver.get(path.as_uri())
    deadline = time.monotonic() + 30
    while not driver.execute_script("return document.readyState === 'complete' && "
                                    "(document.body.dataset.ready || !window.Plotly)"):
        assert time.monotonic() < deadline, "the page was never ready"
        time.sleep(0.02)
    return driver


def requests(driver) -> list[str]:
    """The URLs the page asked for since the last call (Chrome's network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def pointed(driver, x_value, y_value) -> str:
    """Move the real pointer onto chart-0's point (x_value, y_value), in its axes' own
    units (a category's index on a category axis), and return the hover label it shows."""
    from selenium.webdriver.common.action_chains import ActionBuilder

    x, y = driver.execute_script("""
        const gd = document.getElementById('chart-0'), l = gd._fullLayout;
        const box = gd.getBoundingClientRect();
        return [box.left + l.xaxis._offset + l.xaxis.l2p(arguments[0]),
                box.top + l.yaxis._offset + l.yaxis.l2p(arguments[1])];""", x_value, y_value)
    action = ActionBuilder(driver)
    action.pointer_action.move_to_location(int(x), int(y))
    action.perform()
    deadline = time.monotonic() + 5
    while not (shown := driver.execute_script(
            "const t = document.querySelector('#chart-0 .hovertext');"
            "return t ? t.textContent : ''")):
        assert time.monotonic() < deadline, "no value shown under the pointer"
        time.sleep(0.02)
    return shown


def test_every_page_loads_offline_with_no_error(pages, browser):
    htmls = sorted(pages.glob("*.html"))
    assert len(htmls) == len(RUNS) + 1  # and the index
    charted = set(RUNS) - {"params"}
    browser.get_log("performance")
    for path in htmls:
        opened(browser, path)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], (path.name, errors)
        asked = requests(browser)
        # the folder's own files, and images the page's code makes itself (data: URLs)
        assert asked and all(u.startswith((pages.as_uri(), "data:")) for u in asked), (
            path.name, [u[:80] for u in asked])
        if path.name != "index.html":
            assert f"{pages.as_uri()}/{SCRIPT}" in asked
            assert path.stat().st_size <= MAX_PAGE, path.name
            drawn = browser.execute_script("return document.querySelectorAll('.chart "
                                           ".main-svg').length")
            assert (drawn > 0) == (path.name.split("-tiny")[0] in charted), path.name


def test_pointing_at_a_cell_shows_the_csv_value(pages, browser):
    """The pointer on resid-pre's cell (layer 1, position 4: " France") shows the
    `normalized` value the CSV holds there."""
    df = pd.read_csv(result(pages, "patch-tiny-gpt2.csv"))
    want = df[(df["site"] == "resid-pre") & (df["layer"] == 1) & (df["position"] == 4)]
    opened(browser, result(pages, "patch-tiny-gpt2.html"))
    shown = pointed(browser, 4, 1)
    assert f"normalized {float(want['normalized'].iloc[0]):.6g}" in shown
    assert "layer 1" in shown and "position 4 ␣France" in shown


def test_a_table_sorts_on_a_click(pages, browser):
    df = pd.read_csv(result(pages, "patch-tiny-gpt2.csv"))
    opened(browser, result(pages, "patch-tiny-gpt2.html"))

    def first() -> float:
        return float(browser.execute_script(
            "return document.querySelector('#table-main tbody tr td:nth-child(7)')"
            ".dataset.value"))

    header = browser.find_element("xpath", "//table[@id='table-main']//th[.='normalized']")
    header.click()
    assert first() == pytest.approx(df["normalized"].min(), rel=1e-12, abs=1e-300)
    header.click()
    assert first() == pytest.approx(df["normalized"].max(), rel=1e-12, abs=1e-300)


def test_the_attention_view_switches_heads(pages, browser):
    from selenium.webdriver.support.ui import Select

    csv = next(pages.glob("attention-tiny-gpt2-*.csv"))  # the prompt's digest in its name
    df = pd.read_csv(csv)
    opened(browser, csv.with_suffix(".html"))
    for head in (2, 0):
        Select(browser.find_element("id", "heads")).select_by_value(f"1.{head}")
        shown = browser.execute_script("return document.getElementById('chart-0').data[0].z")
        want = (df[(df["layer"] == 1) & (df["head"] == head)]
                .pivot_table(index="query_pos", columns="key_pos", values="weight",
                             dropna=False).to_numpy())
        got = np.array([[np.nan if v is None else v for v in row] for row in shown])
        # float32 weights: the CSV's shortest repr reads back as the same float32
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
        title = browser.execute_script("return document.querySelector('#chart-0 .gtitle')"
                                       ".textContent")
        assert title.startswith(f"layer 1, head {head}")


def test_the_index_filters_by_command(pages, browser):
    from selenium.webdriver.support.ui import Select

    opened(browser, pages / "index.html")
    rows = "return [...document.querySelectorAll('#runs tbody tr')].filter(r => !r.hidden)" \
           ".map(r => r.cells[0].textContent)"
    assert sorted(browser.execute_script(rows)) == sorted(RUNS)
    browser.find_element("xpath", "//table[@id='runs']//th[.='command']").click()
    assert browser.execute_script(rows) == sorted(RUNS)  # the page's sorting, as text
    Select(browser.find_element("css selector", "select[data-key=command]")
           ).select_by_value("trace")
    assert browser.execute_script(rows) == ["trace"]
    link = browser.find_element("css selector", "#runs tbody tr:not([hidden]) a")
    link.click()
    assert browser.current_url.endswith(result(pages, "trace-tiny-gpt2.html").name)


def test_pages_name_no_network_and_no_html_writes_none(pages, tmp_path):
    """Without a browser: no page names a URL of the network (their one script is the
    folder's), `--no-html` writes no page and no script, and a notebook gets plotly.js
    once (offline mode), then the charts alone."""
    from blockscope.api.result import Result
    from blockscope.results import page

    for path in pages.glob("*.html"):
        text = path.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text, path.name
    res = CliRunner().invoke(app, ["report", str(tmp_path)])  # no run in it yet
    assert res.exit_code == 2 and res.stderr.startswith(f"error: DIR {tmp_path}: no run's")
    res = CliRunner().invoke(app, ["layernorm", "1", "2", "4", "--no-html", "--out-dir",
                                   str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert not list(tmp_path.glob("*.html")) and not (tmp_path / SCRIPT).exists()
    run = Result("patch", "patch-x", "00000000", {"main": pd.read_csv(
        result(pages, "patch-tiny-gpt2.csv"))}, {"command": "patch"})
    page._INLINED = False
    first, second = run._repr_html_(), run._repr_html_()
    assert first.count(page.script()[:200]) == 1 and page.script()[:200] not in second
    assert second.count("Plotly.newPlot") == 2  # the two sites' heatmaps


def test_a_heatmap_refuses_two_rows_for_one_cell():
    """A cell the frame holds twice is a bug to see, never one of the two picked."""
    from blockscope.results.charts import heatmap

    df = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 0, 0], "delta": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="several rows for one"):
        heatmap(df, "delta", "", cols="head")
    fig = heatmap(df.iloc[1:], "delta", "", cols="head")
    assert fig["data"][0]["z"] == [[2.0], [3.0]]
    # on a page: no chart, said, and the tables still there (the run keeps its files)
    from blockscope.api.result import Result
    from blockscope.results.page import page

    df = df.assign(method="zero", ablation_perplexity=1.0)
    text = page(Result("prune-heads", "prune-heads-x", "00000000", {"main": df},
                       {"command": "prune-heads"}))
    assert "The charts could not be drawn (ValueError: delta: several rows" in text
    assert 'id="table-main"' in text and 'id="chart-0"' not in text


def test_pointing_at_a_line_shows_the_csv_value(pages, browser):
    """ablate's line: the pointer on block 1's point shows the perplexity the CSV holds."""
    df = pd.read_csv(result(pages, "ablate-tiny-gpt2-alice.csv"))
    want = float(df.loc[df["layer"] == 1, "perplexity"].iloc[0])
    opened(browser, result(pages, "ablate-tiny-gpt2-alice.html"))
    shown = pointed(browser, 1, want)
    assert f"perplexity {want:.6g}" in shown and "layer 1" in shown
