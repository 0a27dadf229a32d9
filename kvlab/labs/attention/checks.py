"""Public self-checks for lab 1 (attention with a KV cache): `kvlab check attention attention.py`.

A few small cases worked out by hand. Passing them means your functions have the right
shapes and the basic idea; the grade comes from hidden tests with random shapes, the C
core's attention and the bundled MHA model's cache.
"""
import numpy as np

from kvlab.grading.testkit import as_array, check_close, points, raises


@points(1)
def test_a_zero_query_averages_the_values(sub, rng):
    """q = 0 weighs every position alike: attend returns the mean of the values"""
    values = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    keys = np.ones((3, 1, 4), dtype=np.float32)
    got = sub.attend(np.zeros((1, 4), np.float32), keys, values)
    check_close(got, values.mean(axis=0), "one head, 3 positions, q = 0", atol=1e-6)


@points(1)
def test_one_head_by_hand(sub, rng):
    """one head of 2 values, 2 positions: softmax([0, 2 / sqrt(2)]) weighs the values"""
    q = np.array([[1.0, 1.0]], np.float32)
    keys = np.array([[[0.0, 0.0]], [[1.0, 1.0]]], np.float32)
    values = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    w = np.exp([0.0, 2 / np.sqrt(2)])
    w /= w.sum()
    got = sub.attend(q, keys, values)
    check_close(got, np.array([[w[0], w[1]]]), "scores q.k / sqrt(head_dim) = [0, 1.414]")


@points(1)
def test_each_head_reads_its_own_keys_and_values(sub, rng):
    """2 heads: head 0 reads key and value head 0, head 1 reads head 1"""
    keys = np.zeros((2, 2, 2), np.float32)                 # equal scores: weights 1/2, 1/2
    values = np.array([[[1, 1], [5, 5]], [[3, 3], [7, 7]]], np.float32)
    got = sub.attend(np.ones((2, 2), np.float32), keys, values)
    check_close(got, np.array([[2, 2], [6, 6]], np.float64), "head h averages the values of head h")


@points(1)
def test_large_scores_do_not_overflow(sub, rng):
    """scores of 1,000: exp(1000) is inf, so the softmax must subtract the largest score first"""
    q = np.array([[100.0, 0.0, 0.0, 0.0]], np.float32)        # scores q.k / 2 = 500 and 1000
    keys = np.array([[[10.0, 0, 0, 0]], [[20.0, 0, 0, 0]]], np.float32)
    values = np.array([[[1.0, 2, 3, 4]], [[5.0, 6, 7, 8]]], np.float32)
    got = sub.attend(q, keys, values)
    check_close(got, np.array([[5.0, 6, 7, 8]]), "scores 500 and 1000 (is the largest score "
                                                 "subtracted before exp?)")


@points(1)
def test_the_cache_keeps_what_was_appended_and_refuses_overflow(sub, rng):
    """KVCache(1 layer, 3 positions): append 2, read them back; a third and fourth do not fit"""
    cache = sub.KVCache(1, 3, 1, 2)
    k = np.arange(8, dtype=np.float32).reshape(4, 1, 2)
    cache.append(0, k[:2], -k[:2])
    got = as_array(cache.keys(0), "keys(0) after appending 2 positions", shape=(2, 1, 2))
    assert np.array_equal(got, k[:2]), f"keys(0) should hold the 2 appended positions, got {got.tolist()}"
    assert cache.length == 2, f"expected length 2, got {cache.length!r}"
    with raises("CacheFullError", "appending 2 positions to a cache with 1 free"):
        cache.append(0, k[2:], -k[2:])
    assert cache.length == 2, f"a refused append must change nothing: length is now {cache.length!r}"


@points(1)
def test_causal_attention_row_0_sees_only_itself(sub, rng):
    """the first token attends to itself alone: row 0 of the output is v[0]"""
    q = np.ones((3, 2, 2), np.float32)
    k = np.array([[[1, 0]], [[0, 1]], [[1, 1]]], np.float32)
    v = np.array([[[4, 5]], [[6, 7]], [[8, 9]]], np.float32)
    got = as_array(sub.causal_attention(q, k, v), "causal_attention", shape=(3, 2, 2))
    check_close(got[0], np.array([[4, 5], [4, 5]]), "row 0 (position 0 sees position 0 only)")
