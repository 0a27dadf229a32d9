"""Hidden grading tests for lab 1 (attention with a KV cache). Each test says in its message
what it expected.

Run by the judge (kvlab/grading/judge.py), never shipped in the package. The answers are
checked against the C core's attention (cache.attend of a kvlab cache, filled by the
bundled MHA model or with random rows), against kvlab.reference.attention, and against the
cache's own invariant: a query over the cache gives what prefill gives. Shapes, lengths
and values are drawn at grading time. Every shape is MHA (a KV head per query head):
chapter 3 and lab 4 (gqa) are where query heads share KV heads.
"""
import functools

import numpy as np

from kvlab import reference
from kvlab.grading.testkit import as_array, c_attend, check_close, matches, mha_model, points, raises

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def shapes(rng):
    """(n_heads, n_kv_heads, head_dim) of each kind, drawn now. This lab is MHA: every query
    head has its own KV head (lab 4 lets groups share one)."""
    head_dim = lambda: int(rng.choice([4, 8, 16, 32]))     # noqa: E731
    n, many = int(rng.integers(2, 7)), int(rng.integers(7, 13))
    return {"one head": (1, 1, head_dim()), "MHA": (n, n, head_dim()),
            "MHA, many heads": (many, many, head_dim())}


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@functools.lru_cache(maxsize=None)
def filled():
    """The bundled MHA model (8 heads of 16, kvlab.MHA_MODEL) with its cache after a prompt."""
    model = mha_model()
    cache = model.new_cache(64)
    model.prefill(model.encode(PROMPT), cache)
    return model, cache


def prepare():
    filled()


@points(1)
def test_attend_a_zero_query_averages_the_values(sub, rng):
    """a query of zeros weighs every position alike: the output is the mean of the values
    (and a query that is not zero does not: its weights come from its scores)"""
    n_heads, n_kv_heads, head_dim = shapes(rng)[("one head", "MHA")[int(rng.integers(2))]]
    length = int(rng.integers(3, 12))
    keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
    what = f"{n_heads} head{'s' * (n_heads != 1)} of {head_dim}, {length} positions"
    got = sub.attend(np.zeros((n_heads, head_dim), np.float32), keys, values)
    check_close(got, values.mean(axis=0), f"{what}, q = 0", atol=1e-6)
    # scores of a few units: far from equal, so the weights are far from 1 / length
    q = normal(rng, n_heads, head_dim, scale=3.0)
    got = as_array(sub.attend(q, keys, values), f"{what}, q not 0", shape=(n_heads, head_dim))
    assert not matches(got, values.mean(axis=0)), (
        f"{what}, a query that is not zero: expected each position weighed by softmax(q . k / "
        f"sqrt(head_dim)), got the plain mean of the values, as if every score were equal")


@points(3)
def test_attend_mha(sub, rng):
    """multi-head attention (a KV head per query head) matches the C core: one head, a few, many"""
    for kind, (n_heads, n_kv_heads, head_dim) in shapes(rng).items():
        for length in (1, 2, int(rng.integers(3, 20)), int(rng.integers(20, 60))):
            q = normal(rng, n_heads, head_dim)
            keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
            got = sub.attend(q, keys, values)
            check_close(got, c_attend(q, keys, values), f"{kind}: {n_heads} head{'s' * (n_heads != 1)} "
                        f"of {head_dim}, {length} cached position{'s' * (length != 1)}")


@points(2)
def test_attend_large_scores_do_not_overflow(sub, rng):
    """scores of about 10,000: the softmax must subtract the largest score first"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["MHA"]
    scale = 400.0 / np.sqrt(head_dim)                 # scores of about 1e4 whatever head_dim is
    q = normal(rng, n_heads, head_dim, scale=scale)
    keys, values = normal(rng, 20, n_kv_heads, head_dim, scale=scale), normal(rng, 20, n_kv_heads, head_dim)
    got = sub.attend(q, keys, values)
    want = reference.attention(q[None], keys, values, np.array([19]))[0]
    check_close(got, want, "scores of about 1e4 (exp(1e4) overflows: is the largest score "
                           "subtracted before exp?)")
    # Scores that far apart give one-hot weights: a softmax of close scores of about 1e4 does
    # not. Keys moved along q add the same shift to every score of a head, which a softmax
    # does not see: the output must be the one for the small scores.
    length = int(rng.integers(8, 30))
    q = normal(rng, n_heads, head_dim)
    keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
    shift = rng.uniform(5e3, 1.2e4)
    along_q = shift * np.sqrt(head_dim) / np.sum(q.astype(np.float64) ** 2, axis=1)
    shifted = (keys + (along_q[:, None] * q)[None]).astype(np.float32)
    small = as_array(sub.attend(q, keys, values), "attend", shape=(n_heads, head_dim))
    got = sub.attend(q, shifted, values)
    check_close(got, small, f"{length} positions whose scores, a few units apart, are all raised by "
                            f"{shift:,.0f}: softmax(s + c) = softmax(s), so the output must be the one "
                            f"for the scores before the shift (subtract the largest score before exp; "
                            f"close scores do not give one-hot weights)", atol=1e-2)


@points(3)
def test_attend_matches_the_c_cache_of_the_mha_model(sub, rng):
    """over the bundled MHA model's cache (8 heads of 16), every layer, as cache.attend"""
    model, cache = filled()
    for layer in range(model.config.n_layers):
        q = normal(rng, model.config.n_heads, model.config.head_dim, scale=2.0)
        got = sub.attend(q, cache.keys[layer], cache.values[layer])
        check_close(got, cache.attend(q, layer), f"layer {layer} of the MHA model's cache "
                    f"({cache.length} positions; cache.keys[layer] is (length, n_kv_heads, head_dim))")


@points(2)
def test_kv_cache_appends_and_reads_back(sub, rng):
    """KVCache keeps what was appended, layer by layer, one or many positions at a time; its
    length is the smallest count of any layer, wherever that layer is"""
    n_layers, n_kv_heads, head_dim = int(rng.integers(3, 6)), int(rng.integers(1, 4)), int(rng.choice([2, 4, 8]))
    first, more = int(rng.integers(2, 5)), int(rng.integers(2, 5))     # positions per round
    max_len = first + 1 + more + int(rng.integers(0, 4))
    full = first + 1 + more                                           # what every layer ends with
    behind = int(rng.integers(1, n_layers - 1))                       # neither the first nor the last
    mine = sub.KVCache(n_layers, max_len, n_kv_heads, head_dim)
    k, v = normal(rng, n_layers, max_len, n_kv_heads, head_dim), normal(rng, n_layers, max_len, n_kv_heads, head_dim)
    assert mine.length == 0, f"a new cache: expected length 0, got {mine.length!r}"
    for layer in range(n_layers):
        mine.append(layer, k[layer, :first], v[layer, :first])       # several positions at once
    assert mine.length == first, (f"after appending {first} positions to each of {n_layers} layers: "
                                  f"expected length {first}, got {mine.length!r}")
    mine.append(0, k[0, first], v[0, first])                          # one position, (n_kv_heads, head_dim)
    mine.append(0, k[0, first + 1:full], v[0, first + 1:full])
    assert mine.length == first, (f"layer 0 holds {full} positions, the other layers {first}: expected "
                                  f"length {first} (the smallest count), got {mine.length!r}")
    for layer in range(1, n_layers):                                  # all but one catch up
        if layer != behind:
            mine.append(layer, k[layer, first:full], v[layer, first:full])
    assert mine.length == first, (f"every layer holds {full} positions but layer {behind} of "
                                  f"{n_layers}, which holds {first}: expected length {first} (the "
                                  f"smallest count, whichever layer has it), got {mine.length!r}")
    for layer in range(n_layers):
        count = first if layer == behind else full
        for name, got, want in (("keys", mine.keys(layer), k[layer, :count]),
                                ("values", mine.values(layer), v[layer, :count])):
            got = as_array(got, f"{name}({layer})")
            assert got.shape == want.shape, (f"{name}({layer}) after {count} positions: expected shape "
                                             f"{want.shape}, got {got.shape}")
            assert np.array_equal(got, want), f"{name}({layer}) does not hold what was appended to layer {layer}"
    mine.append(behind, k[behind, first:full], v[behind, first:full])
    assert mine.length == full, f"after {full} positions in every layer: expected length {full}, got {mine.length!r}"


@points(2)
def test_kv_cache_refuses_what_does_not_fit_and_changes_nothing(sub, rng):
    """appending past max_len raises CacheFullError and leaves the cache as it was"""
    n_layers, n_kv_heads, head_dim = int(rng.integers(2, 4)), int(rng.integers(1, 4)), int(rng.choice([2, 4, 8]))
    free = int(rng.integers(1, 4))
    filled = int(rng.integers(2, 6))
    max_len = filled + free
    mine = sub.KVCache(n_layers, max_len, n_kv_heads, head_dim)
    k, v = normal(rng, n_layers, max_len + 4, n_kv_heads, head_dim), normal(rng, n_layers, max_len + 4, n_kv_heads, head_dim)
    for layer in range(n_layers):
        mine.append(layer, k[layer, :filled], v[layer, :filled])
    attempts = [(int(rng.integers(n_layers)), free + int(rng.integers(1, 4))) for _ in range(2)]
    for layer, n in attempts:
        what = f"{n} positions into a layer with {free} free"
        with raises("CacheFullError", f"append of {what} (layer {layer}, max_len {max_len})"):
            mine.append(layer, k[layer, filled:filled + n], v[layer, filled:filled + n])
        for other in range(n_layers):
            got = as_array(mine.keys(other), f"keys({other})")
            assert got.shape[0] == filled and np.array_equal(got, k[other, :filled]) and \
                np.array_equal(as_array(mine.values(other), f"values({other})"), v[other, :filled]), (
                    f"after refusing {what} (layer {layer}), layer {other} should still hold its "
                    f"{filled} positions and nothing else; its keys are now {got.shape[0]} positions")
        assert mine.length == filled, f"a refused append changed length from {filled} to {mine.length!r}"
    for layer in range(n_layers):
        mine.append(layer, k[layer, filled:max_len], v[layer, filled:max_len])   # exactly what is left: fits
    assert mine.length == max_len and np.array_equal(as_array(mine.keys(1), "keys(1)"), k[1, :max_len]), (
        f"after the refusals, {free} more position{'s' * (free != 1)} (exactly what is left) should "
        f"fit and be kept")
    with raises("CacheFullError", "append of 1 position to a full layer"):
        mine.append(0, k[0, max_len], v[0, max_len])
    assert mine.length == max_len, f"a refused append to a full cache changed length to {mine.length!r}"


@points(2)
def test_a_cache_filled_token_by_token_gives_the_same_attention(sub, rng):
    """the MHA model's K and V appended one token at a time, or all at once: same attention"""
    model, cache = filled()
    c = model.config
    one_by_one = sub.KVCache(c.n_layers, 64, c.n_kv_heads, c.head_dim)
    at_once = sub.KVCache(c.n_layers, 64, c.n_kv_heads, c.head_dim)
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
        a = sub.attend(q, one_by_one.keys(layer), one_by_one.values(layer))
        b = sub.attend(q, at_once.keys(layer), at_once.values(layer))
        assert np.array_equal(as_array(a, "attend"), as_array(b, "attend")), (
            f"layer {layer}: attention over the cache filled token by token differs from the one "
            f"filled at once (they hold the same rows, so it must be identical)")
        check_close(a, cache.attend(q, layer), f"layer {layer}: your cache and attend, against "
                                               f"the C cache's attend")


@points(2)
def test_causal_rows_equal_decode_steps(sub, rng):
    """prefill row t equals attend(q[t], k[:t+1], v[:t+1]), and both are attention: the cache is exact"""
    for kind, (n_heads, n_kv_heads, head_dim) in shapes(rng).items():
        T = int(rng.integers(5, 14))
        q, k, v = normal(rng, T, n_heads, head_dim), normal(rng, T, n_kv_heads, head_dim), \
            normal(rng, T, n_kv_heads, head_dim)
        got = as_array(sub.causal_attention(q, k, v), f"{kind}: causal_attention")
        assert got.shape == q.shape, f"{kind}, T = {T}: expected shape {q.shape}, got {got.shape}"
        for t in range(T):
            step = as_array(sub.attend(q[t], k[:t + 1], v[:t + 1]), f"{kind}: attend").astype(np.float64)
            check_close(step, c_attend(q[t], k[:t + 1], v[:t + 1]),
                        f"{kind}: attend(q[{t}], k[:{t + 1}], v[:{t + 1}]) against the C core")
            check_close(got[t], step, f"{kind}, row {t} of causal_attention against "
                                      f"attend(q[{t}], k[:{t + 1}], v[:{t + 1}])")


@points(2)
def test_causal_attention_matches_the_reference(sub, rng):
    """prefill with the causal mask, as kvlab.reference.attention computes it"""
    drawn = shapes(rng)
    cases = [(kind, shape, T, 1.0) for kind, shape in drawn.items()
             for T in (1, 2, int(rng.integers(3, 25)))]
    cases.append(("MHA, scores of about 1e4", drawn["MHA"], 12, 400.0 / np.sqrt(drawn["MHA"][2])))
    for kind, (n_heads, n_kv_heads, head_dim), T, scale in cases:
        q, k = normal(rng, T, n_heads, head_dim, scale=scale), normal(rng, T, n_kv_heads, head_dim, scale=scale)
        v = normal(rng, T, n_kv_heads, head_dim)
        got = sub.causal_attention(q, k, v)
        want = reference.attention(q, k, v, np.arange(T))
        check_close(got, want, f"{kind}, T = {T}: causal_attention against kvlab.reference.attention "
                               f"(position t sees 0..t, itself included)")
