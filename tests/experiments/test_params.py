import json

import pytest

from blockscope.errors import BlockscopeError
from blockscope.experiments.params import parameter_counts
from blockscope.model.configs import load_config


def counts(name, **kw):
    return parameter_counts(load_config(name), **kw).set_index("component")["parameters"]


def test_gpt2_small_exactly():
    c = counts("gpt2")
    assert c["attention weights"] == 2_359_296 and c["attention biases"] == 3_072
    assert c["attention"] == 2_362_368
    assert c["MLP weights"] == 4_718_592 and c["MLP biases"] == 3_840 and c["MLP"] == 4_722_432
    assert c["layer norms"] == 3_072
    assert c["block"] == 7_087_872
    assert c["token embeddings"] == 38_597_376 and c["position embeddings"] == 786_432
    assert c["final norm"] == 1_536
    assert c["all 12 blocks"] == 12 * 7_087_872
    assert c["total"] == 124_439_808
    assert "unembedding (untied)" not in c  # tied to the token embeddings, counted once


def test_gpt3_to_the_articles_rounding():
    c = counts("gpt3-175b")
    assert round(c["block"] / 1e9, 2) == 1.81
    assert round(c["attention"] / 1e6) == 604 and round(c["MLP"] / 1e9, 2) == 1.21
    # exactly 173.96 billion: the article's "about 173.9 billion" is that figure cut (not
    # rounded) to one decimal, as is 96 x 12 d_model^2 = 173.95 billion
    assert int(c["all 96 blocks"] / 1e8) / 10 == 173.9
    assert abs(c["total"] / 175e9 - 1) < 0.005


def test_llama_to_the_articles_rounding():
    df = parameter_counts(load_config("llama-3.1-8b")).set_index("component")
    c = df["parameters"]
    assert round(c["attention"] / 1e6, 1) == 41.9 and round(c["MLP"] / 1e6, 1) == 176.2
    assert round(df.loc["MLP", "share_of_block"], 2) == 0.81
    assert round(c["all 32 blocks"] / 1e9, 2) == 6.98
    assert c["unembedding (untied)"] == c["token embeddings"] == 128_256 * 4096


def test_shortcut_and_shares():
    df = parameter_counts(load_config("gpt2")).set_index("component")
    assert df.loc["12 d_model^2 shortcut", "parameters"] == 12 * 768**2
    assert df.loc["12 d_model^2 shortcut", "shortcut_error"] == pytest.approx(
        12 * 768**2 / 7_087_872 - 1)
    assert df.loc["total", "share_of_model"] == 1.0 and df.loc["block", "share_of_block"] == 1.0


@pytest.mark.parametrize("model, heads", [("gpt2", (1, 12, 32)), ("llama-3.1-8b", (8, 64))])
def test_head_count_does_not_change_the_count(model, heads):
    base = counts(model)
    for n in heads:
        assert counts(model, n_heads=n).equals(base)
    with pytest.raises(BlockscopeError, match="divide"):
        counts(model, n_heads=7)


def test_grouped_query_heads_keep_their_grouping():
    with pytest.raises(BlockscopeError, match="multiple of 4"):
        counts("llama-3.1-8b", n_heads=2)


def test_local_config_json_and_checkpoint_dir(tmp_path, tiny_dir):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=100)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    c = counts(str(path))
    assert c["block"] == 12 * 64**2 + 13 * 64  # QKV+O and the 4x MLP, biases, two norms
    assert c["total"] == 2 * c["block"] + 100 * 64 + 32 * 64 + 2 * 64
    assert counts(str(tiny_dir))["all 3 blocks"] == 3 * (12 * 64**2 + 13 * 64)


def test_unknown_model_name_offline():
    with pytest.raises(BlockscopeError, match="preset"):
        load_config("no-such-org/no-such-model")
