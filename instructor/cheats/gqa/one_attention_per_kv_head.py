"""Computes one attention per KV head, with the mean of its group's queries, and copies the
result to every query head of the group: the cost of MQA's attention, n_kv_heads instead of
n_heads. Exact for MHA (groups of one), where it is plain attention."""
TARGETS = ["test_attend_mha_gqa_and_mqa", "test_attend_over_the_bundled_models_cache",
           "test_causal_rows_equal_decode_steps"]


def _shared_query(q, n_kv_heads):
    """(..., n_heads, head_dim) -> the same shape, each group's query heads replaced by their mean."""
    *lead, n_heads, head_dim = q.shape
    groups = q.reshape(*lead, n_kv_heads, n_heads // n_kv_heads, head_dim)
    mean = groups.mean(axis=-2, keepdims=True)
    return np.broadcast_to(mean, groups.shape).reshape(q.shape).astype(np.float32)


_attend, _causal_attention = attend, causal_attention


def attend(q, keys, values):
    return _attend(_shared_query(q, keys.shape[1]), keys, values)


def causal_attention(q, k, v):
    return _causal_attention(_shared_query(q, k.shape[1]), k, v)
