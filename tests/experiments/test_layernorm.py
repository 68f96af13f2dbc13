import pytest

from blockscope.errors import BlockscopeError
from blockscope.experiments.layernorm import layer_norm_steps


def step(df, name, ndigits=3):
    return [round(v, ndigits) for v in df[df["step"] == name]["value"]]


@pytest.mark.parametrize("x", [[2, 4, 6, 8], [20, 40, 60, 80]])
def test_the_articles_example(x):
    df = layer_norm_steps(x)
    scale = x[0] / 2
    assert step(df, "mean") == [5 * scale]
    assert step(df, "variance") == [5 * scale**2]
    assert step(df, "output") == [-1.342, -0.447, 0.447, 1.342]
    assert step(df, "torch layer_norm") == [-1.342, -0.447, 0.447, 1.342]
    assert step(df, "max abs difference", 9) == [0.0]
    if scale == 1:
        assert step(df, "std") == [2.236]
        assert step(df, "centred") == [-3, -1, 1, 3]


def test_gain_and_bias():
    df = layer_norm_steps([2, 4, 6, 8], gain=[2], bias=[0.5, 0, 0, 1])
    assert step(df, "output") == [round(2 * -1.3416, 3) + 0.5, -0.894, 0.894, 3.683]
    assert step(df, "max abs difference", 9) == [0.0]
    with pytest.raises(BlockscopeError, match="gain"):
        layer_norm_steps([1, 2, 3], gain=[1, 2])
    with pytest.raises(BlockscopeError, match="at least 2"):
        layer_norm_steps([1])
