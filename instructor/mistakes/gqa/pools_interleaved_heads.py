"""Averages heads g, g + n_kv_heads, g + 2 n_kv_heads, ... into KV head g: not the query
heads that will read it (h // kv_mul), so each query head gets another group's keys."""
EXPECTED_FAILURES = ["test_mean_pool_heads", "test_convert_pools_every_layer_and_leaves_the_model",
                     "test_a_model_whose_grouped_heads_are_equal_converts_without_loss",
                     "test_conversion_table"]


def mean_pool_heads(w, n_kv_heads, head_dim):
    rows, dim = w.shape
    n_heads = rows // head_dim
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_kv_heads} KV heads do not divide {n_heads} heads")
    strided = w.reshape(n_heads // n_kv_heads, n_kv_heads, head_dim, dim)
    return strided.mean(axis=0).reshape(n_kv_heads * head_dim, dim).astype(np.float32)
