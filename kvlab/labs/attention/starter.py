"""Lab 1: attention with a KV cache, in NumPy. Fill in every function marked TODO.

Chapter 1 (chapters/01_kv_cache.md) explains why a decode step only needs the new token's
query and the cached keys and values. Here you write that step, the cache that feeds it,
and the prefill that computes every position at once; the grader checks them against the
C core's own attention (kvlab's cache.attend) and against kvlab.reference.

Shapes (float32 throughout). Every query head has its own key head and value head here
(multi-head attention, MHA): n_kv_heads == n_heads. Lab 4 lets groups of heads share one.
    q of one token          (n_heads, head_dim)
    cached keys, values     (length, n_heads, head_dim)
    a prompt's q, k, v      (T, n_heads, head_dim)

Check your work with:  kvlab check attention attention.py    (the public checks)
Your grade:            kvlab grade attention attention.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""
import math

import numpy as np


class CacheFullError(ValueError):
    """KVCache.append was asked for more positions than the cache has left.
    (Already written: raise it from KVCache.append.)"""


def attend(q, keys, values):
    """One decode step of multi-head attention in one layer.

    q: (n_heads, head_dim); keys, values: (length, n_heads, head_dim).
    Returns (n_heads, head_dim) float32.

    For each head h: scores = keys[:, h] @ q[h] / sqrt(head_dim), one per position;
    weights = softmax(scores); output = weights @ values[:, h].

    The softmax must not overflow when scores are large (thousands): exp(1000) is inf.
    Subtract the largest score before exp(); the result is mathematically the same.
    """
    # TODO
    raise NotImplementedError("attend")


class KVCache:
    """A contiguous KV cache, reserved up front: for every layer a K array and a V array
    of shape (max_len, n_kv_heads, head_dim), float32, filled from position 0 on.

        cache = KVCache(n_layers=6, max_len=64, n_kv_heads=2, head_dim=16)
        cache.append(layer, k, v)     # k, v: (n_kv_heads, head_dim) for one position,
                                      #       or (n, n_kv_heads, head_dim) for n positions
        cache.keys(layer)             # (positions filled in that layer, n_kv_heads, head_dim)
        cache.values(layer)
        cache.length                  # positions every layer holds

    A model fills layer 0, then layer 1, ... in each step, so keep one count per layer;
    `length` is the smallest of them (after a whole step they are all equal).

    When the new positions do not fit in what is left of max_len, append raises
    CacheFullError and changes nothing: check first, then write.
    """

    def __init__(self, n_layers, max_len, n_kv_heads, head_dim):
        # TODO: allocate the arrays (np.zeros) and the per-layer counts
        raise NotImplementedError("KVCache.__init__")

    @property
    def length(self):
        """Positions held by every layer (the smallest per-layer count)."""
        # TODO
        raise NotImplementedError("KVCache.length")

    def append(self, layer, k, v):
        """Write k, v ((n_kv_heads, head_dim) or (n, n_kv_heads, head_dim)) at the layer's
        next free positions; raise CacheFullError, writing nothing, if they do not fit."""
        # TODO
        raise NotImplementedError("KVCache.append")

    def keys(self, layer):
        """The filled part of the layer's K: (count, n_kv_heads, head_dim). A view is fine."""
        # TODO
        raise NotImplementedError("KVCache.keys")

    def values(self, layer):
        """The filled part of the layer's V: (count, n_kv_heads, head_dim)."""
        # TODO
        raise NotImplementedError("KVCache.values")


def causal_attention(q, k, v):
    """Prefill: attention of T new tokens at positions 0..T-1, all at once.

    q, k, v: (T, n_heads, head_dim). Returns (T, n_heads, head_dim) float32. Position t
    sees positions 0..t (itself included) and nothing later: set the scores of later
    positions to -inf before the softmax (the causal mask).
    Row t must equal attend(q[t], k[:t + 1], v[:t + 1]): that is why a cache is exact.
    Same scaling as attend.
    """
    # TODO
    raise NotImplementedError("causal_attention")
