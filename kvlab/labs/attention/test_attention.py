"""Grader for lab 1 (attention with a KV cache). Each test says in its message what it expected.

The answers are checked against the C core's attention (cache.attend of a kvlab cache,
filled by the bundled model or with random rows), against kvlab.reference.attention, and
against the cache's own invariant: a query over the cache gives what prefill gives.
"""
import numpy as np
import pytest

import kvlab
from kvlab import reference

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
SHAPES = {"MHA": (4, 4, 8), "GQA": (8, 2, 16), "MQA": (6, 1, 8)}   # n_heads, n_kv_heads, head_dim


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def check_close(got, want, what, atol=1e-5):
    """got must have want's shape, be finite and agree to atol (plus 1e-5 relative)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    assert np.all(np.isfinite(got)), (f"{what}: expected finite numbers, got "
                                      f"{np.sum(~np.isfinite(got))} NaN or inf values")
    error = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(error), error.shape)
    assert np.all(error <= atol + 1e-5 * np.abs(want)), (
        f"{what}: off by up to {error.max():.3g} (at index {tuple(int(i) for i in worst)}: "
        f"expected {want[worst]:.6g}, got {got[worst]:.6g})")


def c_attend(q, keys, values):
    """What the C core computes for one token's q over these keys and values."""
    length, n_kv_heads, head_dim = keys.shape
    cache = kvlab.KVCache(1, n_kv_heads, head_dim, length)
    cache.append(np.ascontiguousarray(keys[:, None]), np.ascontiguousarray(values[:, None]))
    return cache.attend(np.ascontiguousarray(q), 0)


@pytest.fixture(scope="module")
def filled():
    """The bundled model (8 query heads, 2 KV heads of 16) with its cache after a prompt."""
    model = kvlab.load()
    cache = model.new_cache(64)
    model.prefill(model.encode(PROMPT), cache)
    return model, cache


@pytest.mark.points(1)
def test_attend_a_zero_query_averages_the_values(submission):
    """a query of zeros weighs every position alike: the output is the mean of the values"""
    rng = np.random.default_rng(0)
    keys, values = normal(rng, 5, 1, 4), normal(rng, 5, 1, 4)
    got = submission.attend(np.zeros((1, 4), np.float32), keys, values)
    check_close(got, values.mean(axis=0), "one head, 5 positions, q = 0", atol=1e-6)


@pytest.mark.points(2)
def test_attend_mha(submission):
    """multi-head attention (a KV head per query head) matches the C core"""
    rng = np.random.default_rng(1)
    n_heads, n_kv_heads, head_dim = SHAPES["MHA"]
    for length in (1, 2, 9, 33):
        q = normal(rng, n_heads, head_dim)
        keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
        got = submission.attend(q, keys, values)
        check_close(got, c_attend(q, keys, values), f"MHA, {n_heads} heads of {head_dim}, "
                                                     f"{length} cached positions")


@pytest.mark.points(2)
def test_attend_gqa_and_mqa(submission):
    """grouped-query and multi-query attention: query head h reads KV head h // kv_mul"""
    rng = np.random.default_rng(2)
    for kind in ("GQA", "MQA"):
        n_heads, n_kv_heads, head_dim = SHAPES[kind]
        for length in (1, 7, 40):
            q = normal(rng, n_heads, head_dim)
            keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
            got = submission.attend(q, keys, values)
            check_close(got, c_attend(q, keys, values),
                        f"{kind}: {n_heads} query heads, {n_kv_heads} KV head(s) of {head_dim}, "
                        f"{length} cached positions (query head h reads KV head h // "
                        f"{n_heads // n_kv_heads})")


@pytest.mark.points(2)
def test_attend_large_scores_do_not_overflow(submission):
    """scores of about 10,000: the softmax must subtract the largest score first"""
    rng = np.random.default_rng(3)
    n_heads, n_kv_heads, head_dim = SHAPES["MHA"]
    q = normal(rng, n_heads, head_dim, scale=70.0)
    keys, values = normal(rng, 20, n_kv_heads, head_dim, scale=70.0), normal(rng, 20, n_kv_heads, head_dim)
    got = submission.attend(q, keys, values)
    want = reference.attention(q[None], keys, values, np.array([19]))[0]
    check_close(got, want, "scores of about 1e4 (exp(1e4) overflows: is the largest score "
                           "subtracted before exp?)")


@pytest.mark.points(3)
def test_attend_matches_the_c_cache_of_the_bundled_model(submission, filled):
    """over the bundled model's cache (GQA, 8 heads on 2 KV heads), every layer, as cache.attend"""
    model, cache = filled
    rng = np.random.default_rng(4)
    for layer in range(model.config.n_layers):
        q = normal(rng, model.config.n_heads, model.config.head_dim, scale=2.0)
        got = submission.attend(q, cache.keys[layer], cache.values[layer])
        check_close(got, cache.attend(q, layer), f"layer {layer} of the bundled model's cache "
                    f"({cache.length} positions; cache.keys[layer] is (length, n_kv_heads, head_dim))")


@pytest.mark.points(2)
def test_kv_cache_appends_and_reads_back(submission):
    """KVCache keeps what was appended, layer by layer, one or many positions at a time"""
    rng = np.random.default_rng(5)
    mine = submission.KVCache(3, 10, 2, 4)
    k, v = normal(rng, 3, 10, 2, 4), normal(rng, 3, 10, 2, 4)
    assert mine.length == 0, f"a new cache: expected length 0, got {mine.length!r}"
    for layer in range(3):
        mine.append(layer, k[layer, :3], v[layer, :3])       # three positions at once
    assert mine.length == 3, f"after appending 3 positions to every layer: expected length 3, got {mine.length!r}"
    mine.append(0, k[0, 3], v[0, 3])                         # one position, (n_kv_heads, head_dim)
    mine.append(0, k[0, 4:6], v[0, 4:6])
    assert mine.length == 3, (f"layer 0 holds 6 positions, layers 1 and 2 hold 3: expected length 3 "
                              f"(the smallest count), got {mine.length!r}")
    for layer, count in ((0, 6), (1, 3), (2, 3)):
        for name, got, want in (("keys", mine.keys(layer), k[layer, :count]),
                                ("values", mine.values(layer), v[layer, :count])):
            got = np.asarray(got)
            assert got.shape == want.shape, (f"{name}({layer}) after {count} positions: expected shape "
                                             f"{want.shape}, got {got.shape}")
            assert np.array_equal(got, want), f"{name}({layer}) does not hold what was appended to layer {layer}"
    for layer in (1, 2):
        mine.append(layer, k[layer, 3:6], v[layer, 3:6])
    assert mine.length == 6, f"after 6 positions in every layer: expected length 6, got {mine.length!r}"


@pytest.mark.points(2)
def test_kv_cache_refuses_what_does_not_fit_and_changes_nothing(submission):
    """appending past max_len raises CacheFullError and leaves the cache as it was"""
    rng = np.random.default_rng(6)
    mine = submission.KVCache(2, 5, 2, 4)
    k, v = normal(rng, 2, 8, 2, 4), normal(rng, 2, 8, 2, 4)
    for layer in range(2):
        mine.append(layer, k[layer, :3], v[layer, :3])
    attempts = [(1, 3, "3 positions into a layer with 2 free"), (0, 3, "3 positions into a layer with 2 free")]
    for layer, n, what in attempts:
        with pytest.raises(submission.CacheFullError):
            mine.append(layer, k[layer, 3:3 + n], v[layer, 3:3 + n])
        for other in range(2):
            got = np.asarray(mine.keys(other))
            assert got.shape[0] == 3 and np.array_equal(got, k[other, :3]) and \
                np.array_equal(np.asarray(mine.values(other)), v[other, :3]), (
                    f"after refusing {what} (layer {layer}), layer {other} should still hold its 3 "
                    f"positions and nothing else; its keys are now {got.shape[0]} positions")
        assert mine.length == 3, f"a refused append changed length from 3 to {mine.length!r}"
    for layer in range(2):
        mine.append(layer, k[layer, 3:5], v[layer, 3:5])     # exactly what is left: fits
    assert mine.length == 5 and np.array_equal(np.asarray(mine.keys(1)), k[1, :5]), (
        "after the refusals, 2 more positions (exactly what is left) should fit and be kept")
    with pytest.raises(submission.CacheFullError):
        mine.append(0, k[0, 5], v[0, 5])
    assert mine.length == 5, f"a refused append to a full cache changed length to {mine.length!r}"


@pytest.mark.points(2)
def test_a_cache_filled_token_by_token_gives_the_same_attention(submission, filled):
    """the bundled model's K and V appended one token at a time, or all at once: same attention"""
    model, cache = filled
    c = model.config
    rng = np.random.default_rng(7)
    one_by_one = submission.KVCache(c.n_layers, 64, c.n_kv_heads, c.head_dim)
    at_once = submission.KVCache(c.n_layers, 64, c.n_kv_heads, c.head_dim)
    keys, values = np.asarray(cache.keys), np.asarray(cache.values)
    for t in range(cache.length):
        for layer in range(c.n_layers):
            one_by_one.append(layer, keys[layer, t], values[layer, t])
    for layer in range(c.n_layers):
        at_once.append(layer, keys[layer], values[layer])
    assert one_by_one.length == at_once.length == cache.length, (
        f"{cache.length} positions appended: lengths are {one_by_one.length!r} (token by token) "
        f"and {at_once.length!r} (all at once)")
    for layer in range(c.n_layers):
        q = normal(rng, c.n_heads, c.head_dim, scale=2.0)
        a = submission.attend(q, one_by_one.keys(layer), one_by_one.values(layer))
        b = submission.attend(q, at_once.keys(layer), at_once.values(layer))
        assert np.array_equal(np.asarray(a), np.asarray(b)), (
            f"layer {layer}: attention over the cache filled token by token differs from the one "
            f"filled at once (they hold the same rows, so it must be identical)")
        check_close(a, cache.attend(q, layer), f"layer {layer}: your cache and attend, against "
                                               f"the C cache's attend")


@pytest.mark.points(2)
def test_causal_rows_equal_decode_steps(submission):
    """prefill row t equals attend(q[t], k[:t+1], v[:t+1]): the cache is exact"""
    rng = np.random.default_rng(8)
    for kind, (n_heads, n_kv_heads, head_dim) in SHAPES.items():
        T = 9
        q, k, v = normal(rng, T, n_heads, head_dim), normal(rng, T, n_kv_heads, head_dim), \
            normal(rng, T, n_kv_heads, head_dim)
        got = np.asarray(submission.causal_attention(q, k, v))
        assert got.shape == q.shape, f"{kind}, T = {T}: expected shape {q.shape}, got {got.shape}"
        for t in range(T):
            step = np.asarray(submission.attend(q[t], k[:t + 1], v[:t + 1]), dtype=np.float64)
            check_close(got[t], step, f"{kind}, row {t} of causal_attention against "
                                      f"attend(q[{t}], k[:{t + 1}], v[:{t + 1}])")


@pytest.mark.points(2)
def test_causal_attention_matches_the_reference(submission):
    """prefill with the causal mask, as kvlab.reference.attention computes it"""
    rng = np.random.default_rng(9)
    cases = [(kind, shape, T, 1.0) for kind, shape in SHAPES.items() for T in (1, 2, 17)]
    cases.append(("GQA, scores of about 1e4", SHAPES["GQA"], 12, 70.0))
    for kind, (n_heads, n_kv_heads, head_dim), T, scale in cases:
        q, k = normal(rng, T, n_heads, head_dim, scale=scale), normal(rng, T, n_kv_heads, head_dim, scale=scale)
        v = normal(rng, T, n_kv_heads, head_dim)
        got = submission.causal_attention(q, k, v)
        want = reference.attention(q, k, v, np.arange(T))
        check_close(got, want, f"{kind}, T = {T}: causal_attention against kvlab.reference.attention "
                               f"(position t sees 0..t, itself included)")
