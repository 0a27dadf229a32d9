"""Lets every query see every position: in a prefill, early tokens read the future. Even the
last row goes wrong from the second layer on, because the earlier rows' keys and values
there come from a residual stream that already saw the future."""
EXPECTED_FAILURES = ["test_attention_matches_the_reference",
                     "test_forward_without_a_cache_matches_the_reference",
                     "test_prefill_then_decode_matches_the_uncached_run",
                     "test_greedy_tokens_are_the_same_with_and_without_the_cache",
                     "test_the_cache_holds_what_the_formula_says"]


def attention(q, keys, values, positions):
    n, n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    out = np.empty((n, n_heads, head_dim), dtype=np.float32)
    for t in range(n):
        for h in range(n_heads):
            scores = keys[:, h // kv_mul] @ q[t, h] / math.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            out[t, h] = (weights / weights.sum()) @ values[:, h // kv_mul]
    return out
