"""Maps query head h to KV head h % n_kv_heads instead of h // (n_heads // n_kv_heads): the
same under MHA and MQA, wrong under GQA, whose consecutive query heads share a KV head. An
attention mistake, so the attention tests fail, and the stale-row test does not."""
EXPECTED_FAILURES = ["test_paged_attention_matches_contiguous_attention",
                     "test_a_pool_the_bundled_model_filled",
                     "test_a_forked_sequence_reads_its_shared_blocks"]


def paged_attend(q, key_blocks, value_blocks, block_table, length):
    n_heads, head_dim = q.shape
    block_size, n_kv_heads = key_blocks.shape[1], key_blocks.shape[2]
    keys = gather(key_blocks, block_table, length)
    values = gather(value_blocks, block_table, length)
    out = np.zeros((n_heads, head_dim), dtype=np.float32)
    for h in range(n_heads):
        scores = keys[:, h % n_kv_heads] @ q[h] / math.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ values[:, h % n_kv_heads]
    return out
