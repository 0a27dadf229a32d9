"""Maps query head h to KV head h % n_kv_heads: right for MHA and MQA, wrong for GQA."""
EXPECTED_FAILURES = ["test_a_piece_reduces_to_its_max_sum_and_weighted_values",
                     "test_each_piece_of_a_split_is_reduced",
                     "test_any_number_of_splits_gives_the_c_cores_attention",
                     "test_large_scores_do_not_overflow",
                     "test_fixed_chunks_give_the_same_attention"]


def partial(q, keys, values):
    n_heads, head_dim = q.shape
    acc = np.zeros((n_heads, head_dim), dtype=np.float32)
    m = np.full(n_heads, -np.inf, dtype=np.float32)
    l = np.zeros(n_heads, dtype=np.float32)
    if len(keys) == 0:
        return acc, m, l
    for h in range(n_heads):
        kv = h % keys.shape[1]
        scores = keys[:, kv] @ q[h] / np.float32(math.sqrt(head_dim))
        m[h] = scores.max()
        weights = np.exp(scores - m[h])
        l[h] = weights.sum()
        acc[h] = weights @ values[:, kv]
    return acc, m, l
