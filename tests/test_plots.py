"""Every experiment command writes a valid PNG that follows its data."""

import io

import matplotlib.image as mpimg
import pytest
from typer.testing import CliRunner

from blockscope.ablate import block_ablation
from blockscope.cli import app
from blockscope.plots import ablation_plot
from blockscope.text import tokenize

from .conftest import ALICE, result


def png_pixels(data: bytes):
    return mpimg.imread(io.BytesIO(data), format="png")


@pytest.mark.parametrize("args, name, size", [
    (["ablate", "--text", ALICE, "--max-tokens", 30], "ablate-tiny-gpt2-alice.png", (540, 960)),
    (["resid-norm", "The capital of France is", "--all-positions"], "resid-norm-tiny-gpt2.png",
     (540, 1080)),
    (["prune-heads", "--text", ALICE, "--max-tokens", 20, "--step", 0.5, "--order", "random",
      "--order", "gradient"], "prune-heads-tiny-gpt2-alice.png", (576, 1440)),
])
def test_commands_write_a_valid_png(tiny_dir, tmp_path, args, name, size):
    res = CliRunner().invoke(app, [*map(str, args), "--model", str(tiny_dir),
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    pixels = png_pixels(result(tmp_path, name).read_bytes())
    assert pixels.shape[:2] == size  # figsize x 120 dpi (it was 100 by mistake for a while)
    assert pixels.std() > 0  # not a blank canvas


def test_params_png_and_no_plot(tmp_path):
    res = CliRunner().invoke(app, ["params", "-m", "gpt2", "-m", "llama-3.1-8b",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    png_pixels((result(tmp_path, "params-gpt2-llama-3.1-8b.png")).read_bytes())
    res = CliRunner().invoke(app, ["params", "--no-plot", "--out-dir", str(tmp_path / "n")])
    assert res.exit_code == 0 and not list((tmp_path / "n").glob("*.png"))


def test_picture_changes_with_the_data(tiny):
    ids = tokenize(tiny.tokenizer, ALICE.read_text(), prepend_bos=True, max_tokens=40)
    df = block_ablation(tiny, ids)
    changed = df.copy()
    changed.loc[2, "perplexity"] *= 3

    def render(frame):
        buf = io.BytesIO()
        ablation_plot(frame, "t").savefig(buf, format="png")
        return buf.getvalue()

    assert render(df) == render(df)  # deterministic
    assert (png_pixels(render(df)) != png_pixels(render(changed))).any()


def test_ablation_plot_draws_the_paired_intervals(tiny):
    """Error bars from 1 + delta_ci / baseline around each bar's top; none without them."""
    from matplotlib.container import ErrorbarContainer

    from blockscope.stats import Bootstrap

    ids = tokenize(tiny.tokenizer, ALICE.read_text(), prepend_bos=True, max_tokens=300)
    df = block_ablation(tiny, ids, ci=Bootstrap(200))
    fig = ablation_plot(df, "t")
    bars = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1
    segments = bars[0].lines[2][0].get_segments()  # one vertical segment per block
    base = df.loc[0, "perplexity"]
    for seg, row in zip(segments, df.iloc[1:].itertuples(), strict=True):
        (_, lo), (_, hi) = seg
        assert lo == pytest.approx(1 + row.delta_ci_low / base)
        assert hi == pytest.approx(1 + row.delta_ci_high / base)
    no_ci = ablation_plot(block_ablation(tiny, ids), "t")
    assert not [c for c in no_ci.axes[0].containers if isinstance(c, ErrorbarContainer)]


@pytest.mark.parametrize("ppl, want", [
    ([100.0, 99.8, 100.3, 99.5], {"0.998", "1", "1.002"}),  # a narrow span: every tick
    ([22.2, 1684.0, 28.3, 23.4], {"1", "10"}),  # over decades: the decades at least
])
def test_ablation_axis_labels_are_plain_numbers(ppl, want):
    """The log axis of perplexity / baseline is labelled 0.998 and 1.002, not 1e+00, and a
    span of decades keeps its decade labels."""
    import pandas as pd

    df = pd.DataFrame({"variant": ["baseline"] + ["ablated"] * 3, "layer": [None, 0, 1, 2],
                       "part": ["none"] + ["block"] * 3, "perplexity": ppl})
    fig = ablation_plot(df, "labels")
    fig.savefig(io.BytesIO(), format="png")  # lays the ticks out
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)} - {""}
    assert want <= labels, labels
    assert not any("e+" in t or "e-" in t or "times" in t for t in labels), labels


def test_every_log_axis_has_plain_labels():
    """resid-norm and the pruning curve wrote 6x10^0 and 8x10^4; all log axes now write
    plain numbers (80,000) as the ablation plot does."""
    import pandas as pd

    from blockscope.plots import resid_norm_plot

    df = pd.DataFrame({"position": 0, "token": " is", "after": ["embeddings", "block 1"],
                       "norm": [2.6, 619.2]})
    fig = resid_norm_plot(df, "norms")
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
    shown = [t for t in labels if t]
    assert len(shown) >= 3 and not any("$" in t or "e+" in t or "10^" in t for t in shown)
    assert "100" in shown
