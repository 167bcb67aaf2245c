"""Data that needs no download, and global batches that do not depend on the layout.

* ``stdlib_corpus()``: the docstrings of a fixed list of Python standard-library
  modules, cleaned to printable ASCII, frozen in ``pdist/corpus.txt`` (the same
  bytes in every process).
* ``CharTokenizer``: one token per character.
* ``get_batch(tokens, B, T, seed, step)``: the *global* batch of step ``step``,
  drawn from a generator seeded by (seed, step), so runs with 1, 2 or 4 ranks
  train on identical global batches. ``shard(batch, rank, n)`` gives a
  data-parallel rank its contiguous slice of rows.
* Synthetic tasks for tests: ``regression_batch``.
"""
import hashlib
import os

import numpy as np

CORPUS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
CORPUS_SHA256 = "53214a2004d1184240b72c2602c6233c74ef31395bf4ccde11f5f0f181091afc"
_cache = {}


def stdlib_corpus(max_chars=None):
    """Docstrings of standard-library modules, classes and functions, joined: the text of
    ``pdist/corpus.txt`` (130,644 printable ASCII characters), the same bytes in every
    process whatever it imported.

    The file was generated once (Python 3.11, ``python -I``, nothing else imported) from
    the docstrings of json, collections, functools, itertools, argparse, pathlib, textwrap,
    string, heapq, bisect, fractions, statistics, random, shutil, csv, contextlib,
    dataclasses, enum, typing, abc, copy, pprint, difflib. Reading them live made the
    corpus depend on the process: importing typing_extensions (torch does) changes
    typing's members, so two ranks could train on different batches. Its sha256 is
    checked on the first read; a changed file is an error, not another corpus."""
    if "text" not in _cache:
        with open(CORPUS_FILE, "rb") as f:
            raw = f.read()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != CORPUS_SHA256:
            raise RuntimeError(f"{CORPUS_FILE}: sha256 {digest} is not the bundled corpus's "
                               f"{CORPUS_SHA256}; reinstall pdist (the file was changed)")
        _cache["text"] = raw.decode("ascii")
    text = _cache["text"]
    return text[:max_chars] if max_chars else text


class CharTokenizer:
    """Characters <-> integer ids (the sorted set of characters of a text)."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text):
        try:
            return np.array([self.stoi[c] for c in text], dtype=np.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


def get_batch(tokens, batch_size, block_size, seed, step):
    """Global batch of step ``step``: x, y int64 arrays (B, T), y = x shifted by one."""
    if len(tokens) <= block_size + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for block_size {block_size}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - block_size - 1, size=batch_size)
    offs = starts[:, None] + np.arange(block_size)[None, :]  # (B, T)
    return tokens[offs], tokens[offs + 1]


def batch_fn(tokens, batch_size, block_size, seed, vocab_size=None):
    """``step -> (x, y)``: ``get_batch``'s batch of that step; with ``vocab_size``, the ids folded
    into [0, vocab_size) (a model with a smaller vocabulary than the corpus, as in the tests)."""
    def batch(step):
        x, y = get_batch(tokens, batch_size, block_size, seed, step)
        return (x, y) if vocab_size is None else (x % vocab_size, y % vocab_size)
    return batch


def shard(batch, rank, world_size):
    """Rows [rank * B/n, (rank + 1) * B/n) of a global batch (a tuple of arrays)."""
    B = len(batch[0])
    if B % world_size:
        raise ValueError(f"global batch size {B} does not divide by the data-parallel size "
                         f"{world_size}: choose a batch size that is a multiple of {world_size}")
    b = B // world_size
    return tuple(a[rank * b:(rank + 1) * b] for a in batch)


def regression_batch(batch_size, n_in, n_out, seed, step):
    """Synthetic regression data: x ~ N(0, 1), y = sin(x A) with a fixed A."""
    A = np.random.default_rng([seed, 2**31 - 1]).standard_normal((n_in, n_out)) / np.sqrt(n_in)
    x = np.random.default_rng([seed, step]).standard_normal((batch_size, n_in))
    return x, np.sin(x @ A)


def char_dataset(max_chars=200_000):
    """(tokens, tokenizer) for the stdlib corpus."""
    text = stdlib_corpus(max_chars)
    tok = CharTokenizer(text)
    return tok.encode(text), tok
