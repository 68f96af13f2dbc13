"""Every experiment command writes a valid PNG that follows its data."""

import io

import matplotlib.image as mpimg
import pytest
from typer.testing import CliRunner

from blockscope.cli import app
from blockscope.experiments.ablate import block_ablation
from blockscope.inputs.text import tokenize
from blockscope.results.plots import ablation_plot
from blockscope.results.plots import params_plot as plots_params
from blockscope.sweeps.settings import RunSettings

from ..conftest import ALICE, result


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

    from blockscope.sweeps.stats import Bootstrap

    ids = tokenize(tiny.tokenizer, ALICE.read_text(), prepend_bos=True, max_tokens=300)
    df = block_ablation(tiny, ids, settings=RunSettings(ci=Bootstrap(200)))
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
    ([2.0, 4e5, 6000.0, 2.5], {"1", "10", "100", "1,000", "10,000", "100,000"}),  # one style
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

    from blockscope.results.plots import resid_norm_plot

    df = pd.DataFrame({"position": 0, "token": " is", "after": ["embeddings", "block 1"],
                       "norm": [2.6, 619.2]})
    fig = resid_norm_plot(df, "norms")
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
    shown = [t for t in labels if t]
    assert len(shown) >= 3 and not any("$" in t or "e+" in t or "10^" in t for t in shown)
    assert "100" in shown


def texts_placed(fig):
    """Draw `fig`; every visible non-empty text's box (pixels), and the figure's box."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(
        lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
             if t.get_visible() and t.get_text().strip()]
    return boxes, fig.bbox


def assert_readable(fig, titles):
    """Nothing drawn outside the figure, and no text in `titles` overlapping another."""
    boxes, frame = texts_placed(fig)
    for text, box in boxes:
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= frame.x1 + 1 and (
            box.y1 <= frame.y1 + 1), f"{text!r} is cut off: {box} outside {frame}"
    for title in titles:
        (_, own), = [(t, b) for t, b in boxes if t == title]
        for text, box in boxes:
            if text != title:
                assert not own.overlaps(box), f"{title!r} overlaps {text!r}"


@pytest.mark.parametrize("n_layers, n_heads", [(3, 4), (12, 12), (24, 16), (32, 32)])
def test_head_roles_picture_has_whole_ticks_and_nothing_overlaps(n_layers, n_heads):
    import numpy as np
    import pandas as pd

    from blockscope.results.plots import head_roles_plot

    roles = ["previous_token", "duplicate_token", "induction"]
    rng = np.random.default_rng(0)
    df = pd.DataFrame([{"layer": la, "head": h, **{r: rng.random() for r in roles}}
                       for la in range(n_layers) for h in range(n_heads)])
    fig = head_roles_plot(df, roles, n_layers, n_heads, "tiny-checkpoint: head roles")
    assert_readable(fig, ["tiny-checkpoint: head roles", "previous token", "duplicate token",
                          "induction"])
    for ax in fig.axes[:3]:
        for ticks, n in ((ax.get_xticks(), n_heads), (ax.get_yticks(), n_layers)):
            shown = [t for t in ticks if -0.5 <= t <= n - 0.5]
            assert shown and all(float(t).is_integer() for t in shown), ticks
    assert [ax.get_ylabel() for ax in fig.axes[:3]] == ["layer", "", ""]  # shared, said once


@pytest.mark.parametrize("layers, heads", [([5], [1, 5]), ([0, 5, 11], [0, 1, 2, 3])])
def test_attention_picture_has_a_colour_bar_and_its_title_clear(layers, heads):
    import pandas as pd

    from blockscope.results.plots import attention_plot

    tokens = ["<|endoftext|>", "The", " capital", " of", " France", " is"]
    heads = heads or list(range(12))
    df = pd.DataFrame([{"layer": la, "head": h, "query_pos": q, "query_token": tokens[q],
                        "key_pos": k, "weight": 1 / (q + 1) if k <= q else 0.0}
                       for la in layers for h in heads for q in range(6) for k in range(6)])
    fig = attention_plot(df, "toy: attention on 'The capital of France is'")
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)
    assert_readable(fig, ["toy: attention on 'The capital of France is'"])


def test_params_picture_names_a_checkpoint_by_its_folder(tmp_path, tiny_dir, monkeypatch):
    """`params -m /a/long/path/tiny-gpt2`: its bar and title say tiny-gpt2, and fit."""
    from blockscope.results import plots

    drawn = []
    monkeypatch.setattr(plots, "params_plot",
                        lambda df, title: drawn.append(plots_params(df, title)) or drawn[-1])
    res = CliRunner().invoke(app, ["params", "-m", str(tiny_dir.resolve()), "--out-dir",
                                   str(tmp_path)])
    assert res.exit_code == 0, res.output
    (fig,) = drawn
    title = f"where the parameters live: {tiny_dir.name}"
    assert_readable(fig, [title])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [tiny_dir.name]


def test_ablation_baseline_line_is_above_the_bottom_axis():
    import pandas as pd

    rows = [{"layer": -1, "part": "block", "perplexity": 22.2}]
    rows += [{"layer": i, "part": "block", "perplexity": p}
             for i, p in enumerate([1684.0, 40.0, 23.4, 90.0])]
    fig = ablation_plot(pd.DataFrame(rows), "every removal raises perplexity")
    low, high = fig.axes[0].get_ylim()
    assert low < 0.97 < 1  # the baseline at 1 is drawn inside the axes, not on its edge


def test_mlp_memory_cards_are_readable(tiny_dir, tmp_path, monkeypatch):
    """One card per neuron with its keys: nothing cut, the title clear of every card."""
    from blockscope.results import mlp_plots as plots

    drawn = []
    real = plots.memory_plot
    monkeypatch.setattr(plots, "memory_plot", lambda *a: drawn.append(real(*a)) or drawn[-1])
    res = CliRunner().invoke(app, ["mlp-memory", "The capital of France is", "--model",
                                   str(tiny_dir), "--text", str(ALICE), "--n-layers", "2",
                                   "--per-layer", "2", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (fig,) = drawn
    title = fig._suptitle.get_text()
    assert_readable(fig, [title])
    assert result(tmp_path, "mlp-memory-tiny-gpt2.png").read_bytes()[:4] == b"\x89PNG"


def test_norm_train_picture_is_loss_against_rate_with_the_plateau():
    import math

    import pandas as pd

    from blockscope.results.norm_plots import norm_train_plot

    rows = [{"layout": lay, "warmup_steps": w, "peak_lr": lr, "loss": loss, "kind": "final"}
            for lay, w, losses in (("pre", 0, (2.3, 2.0, 2.9)), ("post", 100, (2.6, 2.4,
                                                                             math.nan)))
            for lr, loss in zip((3e-4, 1e-3, 3e-3), losses, strict=True)]
    df = pd.DataFrame(rows)
    df.attrs.update(plateau=3.08, margin=0.3)
    fig = norm_train_plot(df, "final loss")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.0003", "0.001", "0.003"]
    labels = ax.get_legend_handles_labels()[1]
    assert "unigram plateau 3.08" in labels and "trained: below 2.78" in labels
    assert any(line.get_marker() == "x" for line in ax.get_lines())  # the diverged run


@pytest.mark.parametrize("low, high", [(0.85, 1.7), (0.3, 1.7), (0.9, 1400)])
def test_a_log_axis_has_readable_ticks_over_any_span(low, high):
    """`ablate --part attn --method mean` drew bars up to 1.7x on a log axis labelled only
    at 0.9 and 1: every log axis now has at least four labelled ticks inside its range."""
    import numpy as np
    import pandas as pd

    ratios = [1.0, *np.linspace(low, high, 30)]
    df = pd.DataFrame({"layer": [None, *range(30)], "part": ["none"] + ["attn"] * 30,
                       "perplexity": [22.24 * r for r in ratios]})
    fig = ablation_plot(df, "x")
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels()
             if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(shown) >= 4 and "1" in shown, shown
