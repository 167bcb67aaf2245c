"""data: the stdlib corpus, the char tokenizer, layout-independent global batches."""
import numpy as np
import pytest

from pdist import data


def test_stdlib_corpus_is_real_printable_text():
    text = data.stdlib_corpus()
    assert len(text) > 100_000
    assert all(32 <= ord(c) < 127 or c == "\n" for c in text)
    assert "JSON" in text and "iterator" in text  # docstrings of json, itertools, ...
    assert data.stdlib_corpus(1000) == text[:1000]
    assert data.stdlib_corpus() == text  # deterministic


def test_char_tokenizer_round_trip_and_errors():
    tok = data.CharTokenizer("hello world")
    assert tok.vocab_size == len(set("hello world"))
    ids = tok.encode("low del")
    assert ids.dtype == np.int64 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == "low del"
    assert tok.chars == sorted(tok.chars)
    with pytest.raises(ValueError, match="'z' is not in the tokenizer's vocabulary"):
        tok.encode("hez")


def test_char_dataset():
    tokens, tok = data.char_dataset(5000)
    assert len(tokens) == 5000 and tokens.max() < tok.vocab_size
    assert tok.decode(tokens[:50]) == data.stdlib_corpus(50)


def test_get_batch_is_a_function_of_seed_and_step():
    tokens = np.arange(1000)
    x, y = data.get_batch(tokens, 4, 8, seed=1, step=3)
    assert x.shape == y.shape == (4, 8)
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
    np.testing.assert_array_equal(y[:, -1], x[:, -1] + 1)
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # contiguous windows of the text
    x2, y2 = data.get_batch(tokens, 4, 8, seed=1, step=3)
    np.testing.assert_array_equal(x, x2)
    assert not np.array_equal(x, data.get_batch(tokens, 4, 8, seed=1, step=4)[0])
    assert not np.array_equal(x, data.get_batch(tokens, 4, 8, seed=2, step=3)[0])
    assert (x + 8 < len(tokens)).all()  # the target window stays inside the corpus
    with pytest.raises(ValueError, match="too short for block_size 8"):
        data.get_batch(np.arange(9), 2, 8, 0, 0)


def test_shard_splits_global_batch_into_contiguous_rows():
    x, y = data.get_batch(np.arange(500), 8, 4, seed=0, step=0)
    parts = [data.shard((x, y), r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    assert parts[1][0].shape == (2, 4)
    with pytest.raises(ValueError, match="global batch size 8 does not divide by the data-parallel size 3"):
        data.shard((x, y), 0, 3)


def test_regression_batch():
    x, y = data.regression_batch(16, 3, 2, seed=0, step=5)
    assert x.shape == (16, 3) and y.shape == (16, 2)
    x2, y2 = data.regression_batch(16, 3, 2, seed=0, step=6)
    assert not np.allclose(x, x2)
    # one hidden map A for every step (seeded by seed alone): y = sin(x A). Rows with small
    # |y| have |x A| < pi/2 (for these seeds), where arcsin inverts sin: a single A fits both steps
    X, Y = np.concatenate([x, x2]), np.concatenate([y, y2])
    ok = (np.abs(Y) < 0.8).all(axis=1)
    assert ok.sum() >= 10
    A, res, *_ = np.linalg.lstsq(X[ok], np.arcsin(Y[ok]), rcond=None)
    np.testing.assert_allclose(X[ok] @ A, np.arcsin(Y[ok]), atol=1e-8)
    x3, y3 = data.regression_batch(16, 3, 2, seed=1, step=5)
    ok3 = (np.abs(y3) < 0.8).all(axis=1)
    assert not np.allclose(x3[ok3] @ A, np.arcsin(y3[ok3]), atol=1e-3)  # another seed, another A
