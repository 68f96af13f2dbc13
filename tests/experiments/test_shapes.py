import pytest

from blockscope.errors import BlockscopeError
from blockscope.experiments.shapes import block_shapes
from blockscope.inputs.text import tokenize
from blockscope.model.loading import load_model, spec_for
from blockscope.model.toy import save_gpt2_checkpoint

PROMPT = "The capital of France is"


def test_every_shape_matches_the_config(tiny):
    ids = tokenize(tiny.tokenizer, PROMPT, prepend_bos=True)
    for block in range(tiny.cfg.n_layers):
        df = block_shapes(tiny, ids, block=block)
        assert df["matches"].all()
        shapes = dict(zip(df["tensor"], df["shape"], strict=True))
        assert shapes["residual in"] == "6 x 64" and shapes["q"] == "6 x 4 x 16"
        assert shapes["attention pattern"] == "4 x 6 x 6" and shapes["MLP out"] == "6 x 64"
        assert shapes["MLP hidden, after activation"] == "6 x 256"
    with pytest.raises(BlockscopeError, match="block"):
        block_shapes(tiny, ids, block=3)


def test_gpt2_small_width_gives_the_articles_shapes(tmp_path):
    """GPT-2 small's widths (d_model 768, 12 heads, d_mlp 3072, its vocabulary), one block:
    a block's shapes do not depend on how many follow it, and one block saves writing
    the full model's 500 MB."""
    model = load_model(spec_for(str(save_gpt2_checkpoint(tmp_path / "gpt2-random", n_layer=1)),
                                device="cpu"))
    ids = tokenize(model.tokenizer, PROMPT, prepend_bos=False)
    assert ids.shape[1] == 5  # one token per word
    df = block_shapes(model, ids)
    shapes = dict(zip(df["tensor"], df["shape"], strict=True))
    assert shapes["residual in"] == "5 x 768" and shapes["residual out"] == "5 x 768"
    assert shapes["q"] == shapes["k"] == shapes["v"] == shapes["z"] == "5 x 12 x 64"
    assert shapes["attention scores"] == shapes["attention pattern"] == "12 x 5 x 5"
    assert shapes["MLP hidden, before activation"] == "5 x 3072"
    assert df["matches"].all()


def test_notes_are_read_off_the_model(tiny):
    import torch

    notes = block_shapes(tiny, torch.tensor([[1, 2, 3]])).set_index("tensor")["note"]
    assert notes["ln1 out"].startswith("layer norm 1: centred")
    assert "4 x d_model" in notes["MLP hidden, before activation"]
    assert notes["MLP hidden, after activation"] == "after the activation (gelu_new)"
