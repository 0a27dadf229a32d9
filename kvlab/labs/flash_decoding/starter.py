"""Lab 10: flash-decoding in NumPy. Fill in every function marked TODO.

Chapter 7 (chapters/07_gpu_kernels.md of the course, sections 7.5 and 7.6) reduces a range of
positions to three things per query head: m, the largest score; l, the sum of
exp(s_i - m); and acc, the sum of exp(s_i - m) * v_i. Any two ranges' results merge:

    M   = max(m1, m2)
    acc = exp(m1 - M) * acc1 + exp(m2 - M) * acc2
    l   = exp(m1 - M) * l1   + exp(m2 - M) * l2

and the attention output is acc / l. Flash-decoding splits a sequence's positions into
pieces, reduces each piece on its own (on a GPU, each in its own thread block) and merges.
Here you write the pieces, the merge and two ways of splitting, and the grader compares
your answer with the C core's attention (cache.attend) for every way of splitting.

Shapes (float32): q (n_heads, head_dim), one decode step's query; keys, values
(length, n_kv_heads, head_dim). Query head h reads KV head h // (n_heads // n_kv_heads);
scores are q . k / sqrt(head_dim).

An empty piece (no positions) reduces to m = -inf, l = 0, acc = 0: merging it changes
nothing. Careful: exp(-inf - (-inf)) is NaN.

Check your work with:  kvlab check flash_decoding flash_decoding.py    (the public checks)
Your grade:            kvlab grade flash_decoding flash_decoding.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""
import math

import numpy as np


def partial(q, keys, values):
    """Reduce one piece of positions: returns (acc, m, l), acc (n_heads, head_dim),
    m (n_heads,), l (n_heads,), float32. m is the largest score of each query head over the
    piece; subtract it before exp, so that no exp overflows. A piece of no positions gives
    m = -inf, l = 0, acc = 0."""
    # TODO
    raise NotImplementedError("partial")


def merge(a, b):
    """Merge two pieces' (acc, m, l) into the (acc, m, l) of both together (the rule above),
    for every query head at once. Merging with an empty piece changes nothing; two empty
    pieces merge into an empty one (no NaN)."""
    # TODO
    raise NotImplementedError("merge")


def split_states(q, keys, values, n_splits):
    """What flash-decoding's thread blocks write: the (acc, m, l) of each of n_splits pieces
    of (nearly) equal size, in order (np.array_split(np.arange(length), n_splits)), as a
    list. Some pieces are empty when n_splits > length."""
    # TODO
    raise NotImplementedError("split_states")


def split_attend(q, keys, values, n_splits):
    """Attention output (n_heads, head_dim) float32 from those pieces: merge them all, then
    divide acc by l."""
    # TODO
    raise NotImplementedError("split_attend")


def attend_in_chunks(q, keys, values, chunk):
    """The same output with pieces of `chunk` consecutive positions (the last one shorter):
    the split depends on the context alone, never on what else runs (chapter 7.6)."""
    # TODO
    raise NotImplementedError("attend_in_chunks")
