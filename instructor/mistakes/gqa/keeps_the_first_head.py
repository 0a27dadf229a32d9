"""Keeps the first head of each group instead of the mean (the GQA paper tried it: worse).
Where a group's heads are equal it does no harm, so that test still passes."""
EXPECTED_FAILURES = ["test_mean_pool_heads", "test_convert_pools_every_layer_and_leaves_the_model",
                     "test_conversion_table"]


def mean_pool_heads(w, n_kv_heads, head_dim):
    rows, dim = w.shape
    n_heads = rows // head_dim
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_kv_heads} KV heads do not divide {n_heads} heads")
    groups = w.reshape(n_kv_heads, n_heads // n_kv_heads, head_dim, dim)
    return groups[:, 0].reshape(n_kv_heads * head_dim, dim).astype(np.float32)
