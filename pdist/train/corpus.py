"""The tokens ``python -m pdist.train`` trains on, and their held-out split.

* a text file (or the bundled corpus, ``pdist/corpus.txt``): one token per character
  (``pdist.data.CharTokenizer``; the vocabulary is the text's sorted characters);
* a token file: ``.npy`` (a 1-D integer array) or ``.bin`` (raw ``uint16``, as nanoGPT writes
  them, or ``int32``: ``--token-dtype``), ids in [0, vocab).

The last ``--val-fraction`` of the tokens is held out. A step's training batch is
``data.get_batch(train, B, T, seed, step)`` (the same global batch under every layout and after
a resume); eval batch i is ``get_batch(val, B, T, seed + 1, i)``, the same at every eval.
"""
import os

import numpy as np

from pdist import data


class Tokens:
    """``train``, ``val`` (int64 arrays), ``vocab_size``, ``chars`` (the characters, or None), ``name``."""

    def __init__(self, ids, vocab_size, chars, name, val_fraction):
        n_val = int(len(ids) * val_fraction)
        self.train, self.val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
        self.vocab_size, self.chars, self.name = int(vocab_size), chars, name

    def describe(self):
        kind = "characters" if self.chars is not None else "tokens"
        return (f"{self.name}: {len(self.train) + len(self.val):,} {kind} (vocab {self.vocab_size}), "
                f"{len(self.val):,} held out")


def load(args):
    """The run's Tokens; every problem a ValueError naming the flag (the caller turns it into
    argparse's error)."""
    path = args.data
    if path is None:
        text = data.stdlib_corpus()
        ids, vocab, chars, name = *_chars(text), "the bundled corpus"
    elif path.endswith((".npy", ".bin")):
        ids = _token_file(path, args.token_dtype)
        top = int(ids.max()) if len(ids) else -1
        if ids.min(initial=0) < 0:
            raise ValueError(f"--data {path}: negative token ids (min {int(ids.min())})")
        vocab = args.vocab_size if args.vocab_size is not None else top + 1
        if top >= vocab:
            raise ValueError(f"--data {path}: token id {top} is not below --vocab-size {vocab}")
        chars, name = None, path
    else:
        if args.vocab_size is not None:
            raise ValueError(f"--vocab-size is for a token file (.npy, .bin), not the text file {path}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--data {path}: cannot read it as UTF-8 text ({e}); a token file ends in .npy or .bin")
        ids, vocab, chars, name = *_chars(text), path
    tokens = Tokens(ids, vocab, chars, name, args.val_fraction)
    T = args.block_size or 0
    for part, a in (("training", tokens.train), ("held-out", tokens.val)):
        if T and len(a) <= T + 1:
            raise ValueError(f"--data {name}: the {part} part has {len(a)} tokens, too few for --block-size {T} "
                             f"(change --val-fraction or --block-size, or give more data)")
    return tokens


def _chars(text):
    tok = data.CharTokenizer(text)
    return tok.encode(text), tok.vocab_size, tok.chars


def _token_file(path, dtype):
    try:
        if path.endswith(".npy"):
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            if os.path.getsize(path) % np.dtype(dtype).itemsize:
                raise ValueError(f"its size is not a multiple of {np.dtype(dtype).itemsize} bytes "
                                 f"(--token-dtype {dtype})")
            ids = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {path}: {e}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"--data {path}: want a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    return np.asarray(ids, dtype=np.int64)


def batches(tokens, args):
    """(training ``step -> (x, y)``, eval ``i -> (x, y)``): global batches, layout-free."""
    T = args.block_size
    return (data.batch_fn(tokens.train, args.batch_size, T, args.seed),
            data.batch_fn(tokens.val, args.batch_size, T, args.seed + 1))
