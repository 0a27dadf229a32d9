"""Lab 11: cache eviction with attention sinks, heavy hitters and re-rotated positions. Fill in
every function marked TODO.

A cache policy keeps at most `budget` rows of the KV cache however long the text grows
(chapter 8, chapters/08_fewer_positions.md). You write which rows stay, StreamingLLM's
attention sinks and H2O's heavy hitters, and StreamingLLM's re-rotation: after a drop,
every kept key is turned with RoPE from the position it was computed at to its new place in
the cache, so that the cache holds positions 0, 1, ..., n_keep - 1 again and the next token
comes at n_keep. No query then ever sees a distance longer than the budget.

Shapes, as kvlab's caches have them:
    keys       (n_layers, n, n_kv_heads, head_dim)  float32, each key already rotated by RoPE
    positions  (n_layers, n, n_kv_heads)            int, the position each key was rotated at
    scores     (n_layers, length, n_kv_heads)       the attention each row has received
    rows       (n_layers, n_keep, n_kv_heads)       int, row numbers, increasing along axis 1
Each layer and KV head may keep different rows (H2O chooses per head).

RoPE turns the i-th pair of a head's coordinates by the angle position * inv_freq[i]
(inv_freq: head_dim // 2 frequencies, given). The pairs are (x[2i], x[2i + 1]) when
`interleaved` (llama2.c and GGUF files: the models the grader runs), else
(x[i], x[i + head_dim // 2]) (Hugging Face's rotate_half). A pair (a, b) turned by angle t
becomes (a cos t - b sin t, a sin t + b cos t), and turns add up: a key rotated at position
p and turned by s is the key RoPE gives at position p + s.

The grader runs SmolLM2-135M over a text with your policy at several budgets, and compares
the perplexity with kvlab's own choice of rows and its RoPE (kvlab/grading/eviction.py runs
the policy: when the cache is full it asks your functions which rows to keep and for the
kept keys re-rotated, and drops a quarter of the budget at once).

Check your work with:  kvlab check cache_eviction cache_eviction.py
Your grade:            kvlab grade cache_eviction cache_eviction.py
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing the policies yourself: the grader refuses a file that imports kvlab, and
kvlab.cache_policy in particular).
"""
import numpy as np


def rotate(x, shift, inv_freq, interleaved):
    """x (..., head_dim) with each pair of coordinates turned by shift * inv_freq[i].

    x: float32 keys (or queries), any leading shape; shift: ints, one per head vector
    (shape x.shape[:-1], or a single int), negative ones too; inv_freq: (head_dim // 2,)
    float32; interleaved: which coordinates pair up (see the module text).
    Returns float32 of x's shape: what RoPE would have given at each position + shift.
    """
    # TODO
    raise NotImplementedError("rotate")


def sink_rows(length, n_keep, sinks):
    """Attention sinks (StreamingLLM): of a full cache of `length` rows, keep the first
    `sinks` rows (0 .. sinks - 1) and the newest n_keep - sinks (the last rows).
    1 <= sinks <= n_keep < length. Returns a 1-D int array of n_keep row numbers, increasing
    (the same rows for every layer and KV head)."""
    # TODO
    raise NotImplementedError("sink_rows")


def heavy_hitter_rows(scores, n_keep, n_recent):
    """Heavy hitters (H2O): for each layer and KV head, keep the newest n_recent rows, and of
    the older rows (0 .. length - n_recent - 1) the n_keep - n_recent with the largest scores,
    a tie going to the earlier row.

    scores: (n_layers, length, n_kv_heads), the attention each row has received so far;
    0 <= n_recent <= n_keep < length. Returns int rows (n_layers, n_keep, n_kv_heads),
    increasing along axis 1. A newest row is never counted as a heavy hitter as well.
    """
    # TODO
    raise NotImplementedError("heavy_hitter_rows")


def rerotate(keys, positions, inv_freq, interleaved):
    """StreamingLLM's re-rotation, after a drop: keys[l, i, h] is the i-th kept key of layer
    l and KV head h, rotated by RoPE at positions[l, i, h]; return every key as RoPE would
    have rotated it at position i, its place in the cache now (with rotate).
    keys (n_layers, n, n_kv_heads, head_dim), positions (n_layers, n, n_kv_heads).
    Returns float32 of keys' shape."""
    # TODO
    raise NotImplementedError("rerotate")


if __name__ == "__main__":
    # Try your code here: the grader never runs this block. kvlab.grading.eviction runs a
    # policy with your functions on a kvlab model, as the grader does.
    import sys

    import kvlab
    from kvlab.grading import eviction

    print(sink_rows(10, 6, 2))                                  # [0 1 6 7 8 9]
    x = np.array([[1.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    print(rotate(x, np.array([1]), np.array([np.pi / 2, np.pi], np.float32), True))
    # ~[[0, 1, -1, 0]]: the first pair turned a quarter, the second half a turn
    model = kvlab.load()                # the bundled model; the grader's is
    # kvlab.load("smollm2-135m", activations="fp32") (kvlab fetch smollm2-135m: 98 MB)
    text = open(kvlab.__file__.replace("__init__.py", "labs/cache_eviction/README.md")).read()
    ids = model.encode(text)[:400]
    yours = sys.modules[__name__]
    for policy in ("sinks", "h2o"):
        print(policy, eviction.curve(model, ids, (16, 32, 64), policy, yours),
              eviction.curve(model, ids, (16, 32, 64), policy, eviction.KitFunctions))
