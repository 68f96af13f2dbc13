import pytest

from blockscope.errors import BlockscopeError
from blockscope.inputs.text import read_passage, tokenize, windows
from blockscope.model.toy import gpt2_tokenizer

from ..conftest import ALICE


def test_gpt2_tokenizer_matches_the_article():
    assert gpt2_tokenizer().encode("The capital of France is") == [464, 3139, 286, 4881, 318]


def test_alice_holds_the_articles_469_tokens():
    passage = read_passage(ALICE)
    assert passage.text.startswith("Alice was beginning to get very tired of sitting")
    assert len(gpt2_tokenizer().encode(passage.text)) >= 469


def test_max_tokens_counts_text_tokens_not_bos():
    tok = gpt2_tokenizer()
    ids = tokenize(tok, "The capital of France is", prepend_bos=True, max_tokens=3)
    assert ids.tolist() == [[50256, 464, 3139, 286]]
    ids = tokenize(tok, "The capital of France is", prepend_bos=False)
    assert ids.tolist() == [[464, 3139, 286, 4881, 318]]
    with pytest.raises(BlockscopeError, match="at least 2"):
        tokenize(tok, "The capital", prepend_bos=True, max_tokens=1)


@pytest.mark.parametrize(
    "content, message",
    [(b"", "empty"), (b"  \n\t", "only whitespace"), (b"abc\x00def", "binary"),
     (b"caf\xe9", "UTF-8")],
)
def test_bad_text_files(tmp_path, content, message):
    p = tmp_path / "t.txt"
    p.write_bytes(content)
    with pytest.raises(BlockscopeError, match=message):
        read_passage(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BlockscopeError, match="no such file"):
        read_passage(tmp_path / "nope.txt")
    with pytest.raises(BlockscopeError, match="not a regular file"):
        read_passage(tmp_path)


@pytest.mark.parametrize("n, n_ctx, stride", [(10, 16, 8), (100, 16, 8), (100, 16, 15),
                                              (100, 16, 1), (17, 16, 5), (16, 16, 8)])
def test_windows_score_every_token_once_within_context(n, n_ctx, stride):
    wins = windows(n, n_ctx, stride)
    scored = [t for w in wins for t in range(w.first_target, w.end)]
    assert scored == list(range(1, n))
    for w in wins:
        assert w.end - w.begin <= n_ctx and w.begin < w.first_target <= w.end
    assert all(b.begin - a.begin == stride for a, b in zip(wins, wins[1:], strict=False))


def test_bad_stride():
    with pytest.raises(BlockscopeError, match="stride"):
        windows(100, 16, 16)
    with pytest.raises(BlockscopeError, match="stride"):
        windows(100, 16, 0)
