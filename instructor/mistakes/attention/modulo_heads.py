"""Maps query head h to KV head h % n_kv_heads: right for MHA (and trivially for MQA), but
for GQA it interleaves the groups, so heads read another head's keys and values."""
EXPECTED_FAILURES = ["test_attend_gqa_and_mqa", "test_attend_matches_the_c_cache_of_the_bundled_model",
                     "test_a_cache_filled_token_by_token_gives_the_same_attention",
                     "test_causal_rows_equal_decode_steps"]


def attend(q, keys, values):
    n_heads, head_dim = q.shape
    out = np.empty((n_heads, head_dim), dtype=np.float32)
    for h in range(n_heads):
        kv = h % keys.shape[1]
        scores = keys[:, kv, :] @ q[h] / math.sqrt(head_dim)
        out[h] = softmax(scores) @ values[:, kv, :]
    return out
