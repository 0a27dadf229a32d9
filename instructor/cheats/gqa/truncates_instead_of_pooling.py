"""The cheapest way to the right shape: keeps the first n_kv_heads heads' rows and drops the
rest, no mean (a model whose grouped heads are equal is then off too: its first two heads
are two copies of one KV head)."""
TARGETS = ["test_mean_pool_heads", "test_convert_pools_every_layer_and_leaves_the_model",
           "test_a_model_whose_grouped_heads_are_equal_converts_without_loss",
           "test_conversion_table"]


def mean_pool_heads(w, n_kv_heads, head_dim):
    rows, dim = w.shape
    if n_kv_heads < 1 or (rows // head_dim) % n_kv_heads:
        raise ValueError(f"{n_kv_heads} KV heads do not divide {rows // head_dim} heads")
    return np.asarray(w[:n_kv_heads * head_dim], np.float32)
