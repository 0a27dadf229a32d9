"""Lab 2: your own KV cache. Fill in every function marked TODO.

Chapter 1 (chapters/01_kv_cache.md of the course) says a decode step needs only the new
token's query and the keys and values of every earlier token, and that keeping them (the KV
cache) gives exactly the same tokens as recomputing everything. Here you make that true
yourself: a cache of your own, a forward pass that uses it, greedy generation with and
without it, and a timing of your own steps with and without it.

The grader lends your functions a `model`: the NumPy reference model's weights behind every
building block a forward pass needs, except attention and the cache (yours):

    model.config                     shape: n_layers, n_heads, n_kv_heads, head_dim, dim, vocab_size, ...
    model.embed(tokens)              (n, dim) float32
    model.qkv(layer, x, positions)   q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim),
                                     with RoPE applied for those positions
    model.attention_output(layer, x, out)   x plus out (n, n_heads, head_dim) projected back
    model.mlp(layer, x)              x plus the MLP
    model.logits(x)                  (n, vocab_size)

Try things at the end of the file under `if __name__ == "__main__":`; there
`kvlab.grading.handouts.ReferenceModel(checkpoint="mha")` gives you the same model over the
bundled MHA model's weights (8 heads, each with its own key and value head).

Check your work with:  kvlab check own_cache own_cache.py    (the public checks)
Your grade:            kvlab grade own_cache own_cache.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library (time included); nothing from
kvlab (this lab is about writing the cache yourself: the grader refuses a file that imports
kvlab).
"""
import math
import time

import numpy as np


class KVCache:
    """Your cache: for every layer, a K array and a V array of shape
    (positions so far, n_kv_heads, head_dim), float32, that grow as tokens come.

        cache = KVCache(n_layers)
        cache.append(layer, k, v)     # k, v: (n, n_kv_heads, head_dim), the n newest positions
        cache.keys(layer)             # (positions so far, n_kv_heads, head_dim)
        cache.values(layer)
        cache.length                  # positions every layer holds (after a whole step)
        cache.nbytes                  # bytes of the K and V of the `length` positions it
                                      # holds (not of room reserved ahead): chapter 2's formula

    A new cache holds nothing: length 0, nbytes 0.
    """

    def __init__(self, n_layers):
        # TODO
        raise NotImplementedError("KVCache.__init__")

    def append(self, layer, k, v):
        # TODO: keep the rows of k and v after the ones the layer already holds
        raise NotImplementedError("KVCache.append")

    def keys(self, layer):
        # TODO
        raise NotImplementedError("KVCache.keys")

    def values(self, layer):
        # TODO
        raise NotImplementedError("KVCache.values")

    @property
    def length(self):
        # TODO: the last layer's count (every layer holds as many after a whole step)
        raise NotImplementedError("KVCache.length")

    @property
    def nbytes(self):
        # TODO: bytes of the K and V of the positions held (an array's .nbytes, if your
        #       arrays hold exactly those positions)
        raise NotImplementedError("KVCache.nbytes")


def attention(q, keys, values, positions):
    """Causal multi-head attention for n new tokens.

    q: (n, n_heads, head_dim), the new tokens' queries, at `positions` (n ints);
    keys, values: (length, n_heads, head_dim), positions 0..length-1, the new ones
    included. The token at position p sees positions 0..p (itself included) and nothing
    later. Query head h reads key and value head h (the lent models are MHA: n_kv_heads
    equals n_heads; lab 4 lets heads share); scores are divided by sqrt(head_dim); subtract the largest score before exp (lab 1). Returns (n, n_heads,
    head_dim) float32. One function for prefill (n tokens) and decode (n = 1).
    """
    # TODO
    raise NotImplementedError("attention")


def forward(model, tokens, cache=None):
    """Logits (n, vocab_size) for `tokens` (a list of n ids).

    With a cache, the tokens continue what the cache holds: their positions are
    cache.length, cache.length + 1, ...; each layer appends their K and V and attends
    over everything cached. Without one, the tokens are the whole sequence from position 0
    and every K and V is computed afresh and thrown away: the no-cache path.
    Each layer: q, k, v = model.qkv(...); attention; x = model.attention_output(...);
    x = model.mlp(...). Then model.logits(x).
    """
    # TODO
    raise NotImplementedError("forward")


def generate(model, prompt, n_new, use_cache=True):
    """Greedy generation of n_new tokens after `prompt` (a list of ids).

    Returns (tokens, step_logits): the n_new chosen ids (argmax of each step's last row)
    and an (n_new, vocab_size) array of the logits each step chose from.
    With the cache: step 0 is the prefill of the prompt, every later step decodes the one
    token chosen before it. Without: every step runs forward over the whole sequence so far.
    Both must choose exactly the same tokens.
    """
    # TODO
    raise NotImplementedError("generate")


def step_seconds(model, prompt, n_new, use_cache):
    """Time it: the wall seconds (time.perf_counter) of each of the n_new steps of
    generate(model, prompt, n_new, use_cache), as a list of n_new floats, each taken around
    that step's forward pass. The grader runs this on a model of its choosing, and the model
    notes when each step's forward pass ran: every time you report must match its step."""
    # TODO
    raise NotImplementedError("step_seconds")


def fit_line(positions, seconds):
    """The least-squares line t = a + b * p through the points (positions[i], seconds[i]).
    Returns (a, b). Step i of a generation after a prompt of P tokens reads position
    P - 1 + i: fit each mode's times against those positions."""
    # TODO
    raise NotImplementedError("fit_line")


def predicted_speedup(cached, uncached, prompt_len, n_new=48):
    """How many times faster generating n_new tokens after a prompt of prompt_len tokens is
    with the cache, by the two fitted lines: the sum over the steps' positions
    p = prompt_len - 1 + i (i = 0 .. n_new - 1) of uncached(p), over the same sum of
    cached(p), where cached = (a, b) means a + b * p."""
    # TODO
    raise NotImplementedError("predicted_speedup")


def share_saved(cached, uncached, position):
    """The share of a step's time the cache saves at `position`: 1 - cached(p) / uncached(p)."""
    # TODO
    raise NotImplementedError("share_saved")


if __name__ == "__main__":
    # Try your code here: the grader never runs this block. The same model it lends you:
    from kvlab.grading.handouts import ReferenceModel
    model = ReferenceModel(checkpoint="mha")       # the bundled MHA model's weights
    prompt = [10]                                  # one token
    print(generate(model, prompt, 8, use_cache=True)[0])
    print(generate(model, prompt, 8, use_cache=False)[0])   # the same tokens
    cached = step_seconds(model, prompt, 48, True)
    uncached = step_seconds(model, prompt, 48, False)
    # then fit_line over positions 0..47 (leave out step 0, the prefill: it also pays for
    # NumPy warming up), predicted_speedup, share_saved at positions 3 and 9
