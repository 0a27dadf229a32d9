"""Public self-checks for lab 2 (your own KV cache): `kvlab check own_cache own_cache.py`.

Small cases you can follow by hand, and one short generation. The grade comes from hidden
tests: random shapes for the cache and attention, prompts and decode steps compared row by
row with the reference run without a cache, greedy tokens, the cache's bytes, and your
timing run on a model the grader picks.
"""
import numpy as np

from kvlab import reference
from kvlab.grading.handouts import ReferenceModel
from kvlab.grading.testkit import as_array, mha_model, check_close, check_tokens, described, points


def last_token_at_position_zero(model, tokens, sees_only_itself):
    """The logits of tokens[-1], decoded after the others, by a forward pass that gives it
    position 0 (RoPE at 0) instead of len(tokens) - 1: the mistake the decode check names.
    sees_only_itself: the causal mask at position 0 too, so it reads the cache's first row
    only; else it reads every cached row. (What the mistake computes, for a hint shown only
    when the student's logits match it.)"""
    c, w = model.config, model.weights.float32()
    prefix = reference.ReferenceCache(c, max_seq_len=len(tokens))
    reference.forward(c, model.weights, tokens[:-1], prefix)
    n, H, KVH, hd = 1, c.n_heads, c.n_kv_heads, c.head_dim
    at = np.array([0])
    x = w.token_embedding[np.array(tokens[-1:])].astype(np.float32)
    for layer in range(c.n_layers):
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q = reference.rope((h @ w.wq[layer].T).reshape(n, H, hd), at, c.rope_inv_freq(), c.rope_interleaved)
        k = reference.rope((h @ w.wk[layer].T).reshape(n, KVH, hd), at, c.rope_inv_freq(), c.rope_interleaved)
        v = (h @ w.wv[layer].T).reshape(n, KVH, hd)
        keys = np.concatenate([prefix.key[layer, :len(tokens) - 1], k])
        values = np.concatenate([prefix.value[layer, :len(tokens) - 1], v])
        mask_at = at if sees_only_itself else np.array([len(tokens) - 1])
        out = reference.attention(q, keys, values, mask_at)
        x = x + out.reshape(n, H * hd) @ w.wo[layer].T
        h = reference.rmsnorm(x, w.ffn_norm[layer], c.norm_eps)
        x = x + (reference.silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T
    return (reference.rmsnorm(x, w.final_norm, c.norm_eps) @ w.classifier.T)[-1]


@points(1)
def test_a_cache_of_two_layers(sub, rng):
    """append 2 positions then 1 to each of 2 layers: length 3, and 2 x 2 x 3 x 1 x 2 x 4 B"""
    cache = sub.KVCache(2)
    k = np.arange(12, dtype=np.float32).reshape(6, 1, 2)
    for layer in range(2):
        cache.append(layer, k[:2], -k[:2])
    for layer in range(2):
        cache.append(layer, k[2:3], -k[2:3])
    got = as_array(cache.keys(1), "keys(1)", shape=(3, 1, 2))
    assert np.array_equal(got, k[:3]), f"keys(1) should hold the 3 appended rows in order, got {got.tolist()}"
    assert cache.length == 3, f"expected length 3, got {cache.length!r}"
    assert cache.nbytes == 96, f"K and V, 2 layers, 3 positions of 1 x 2 float32: expected 96, got {described(cache.nbytes)}"


@points(1)
def test_the_first_position_sees_only_itself(sub, rng):
    """attention at position 0 returns v[0], whatever the query"""
    q = np.ones((1, 2, 2), np.float32)                          # 2 heads, each its own K and V
    keys = np.array([[[1, 0], [0, 1]], [[0, 1], [1, 0]]], np.float32)
    values = np.array([[[4, 5], [6, 7]], [[8, 9], [1, 2]]], np.float32)
    got = sub.attention(q, keys, values, np.array([0]))
    check_close(got, np.array([[[4, 5], [6, 7]]]), "a query at position 0 over 2 positions "
                                                   "(position 1 is in the future)")


@points(1)
def test_forward_without_a_cache(sub, rng):
    """the bundled model over "ROMEO:": every row of the logits as the reference's"""
    model = mha_model()
    tokens = list(model.encode("ROMEO:"))
    got = sub.forward(ReferenceModel(checkpoint="mha"), tokens)
    check_close(got, reference.forward(model.config, model.weights, tokens),
                "forward over the 6 tokens of 'ROMEO:' without a cache", atol=1e-4, rtol=1e-4)


@points(1)
def test_one_decode_step_after_a_prefill(sub, rng):
    """"ROMEO:" into your cache, then "\\n" at position 6: the last row of the uncached run"""
    model = mha_model()
    tokens = list(model.encode("ROMEO:\n"))
    lent = ReferenceModel(checkpoint="mha")
    cache = sub.KVCache(model.config.n_layers)
    sub.forward(lent, tokens[:-1], cache)
    got = as_array(sub.forward(lent, tokens[-1:], cache), "the decode step's logits")
    hint = "that is what token 6 gives at position 0: its position is cache.length, 6, not 0"
    check_close(got[-1], reference.forward(model.config, model.weights, tokens)[-1],
                "the decode step of token 6", atol=1e-4, rtol=1e-4,
                hints=[(last_token_at_position_zero(model, tokens, only), hint) for only in (False, True)])


@points(1)
def test_five_greedy_tokens_with_the_cache(sub, rng):
    """after "ROMEO:", 5 greedy tokens with your cache: the reference's, run without one"""
    model = mha_model()
    tokens = list(model.encode("ROMEO:"))
    want = []
    for _ in range(5):
        want.append(int(np.argmax(reference.forward(model.config, model.weights, tokens + want)[-1])))
    got = sub.generate(ReferenceModel(checkpoint="mha"), tokens, 5, True)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"generate returns (tokens, step_logits), got {described(got)}")
    check_tokens(got[0], want, "5 greedy tokens after 'ROMEO:' with your cache",
                 text=model.decode_text)


@points(1)
def test_step_seconds_times_each_step(sub, rng):
    """step_seconds without a cache: 8 times, each its own step's (an uncached step grows with the sequence)"""
    model = mha_model()
    tokens = list(model.encode("ROMEO:"))
    got = sub.step_seconds(ReferenceModel(checkpoint="mha"), tokens, 8, False)
    times = as_array(got, "step_seconds without a cache", shape=(8,)).astype(np.float64)
    assert np.all(np.isfinite(times)) and np.all(times > 0), (
        f"step_seconds: each step's wall time is a positive number of seconds, got {times.tolist()}")
    assert len(set(times.tolist())) > 1, (
        f"step_seconds without a cache: every step reports the same {times[0] * 1e3:.3f} ms, "
        f"an average; each step's own time is asked for (the grader compares each with the time "
        f"its forward pass ran, and an uncached step runs the whole sequence so far, so later "
        f"ones take longer): time each step itself (time.perf_counter before and after it)")


@points(1)
def test_a_line_through_exact_points(sub, rng):
    """fit_line through points on t = 0.002 + 0.0001 p gives (0.002, 0.0001)"""
    positions = list(range(10))
    got = sub.fit_line(positions, [0.002 + 0.0001 * p for p in positions])
    check_close(np.asarray(got, dtype=np.float64), np.array([0.002, 0.0001]), "(a, b)", atol=1e-12)
