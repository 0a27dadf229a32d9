"""Refuses exactly the head counts the worked case tried (0, 4 and 5 of 6 heads) and checks
nothing else: a table of refusals, not the rule."""
TARGETS = ["test_mean_pool_refuses_a_count_that_does_not_divide"]

_pool = mean_pool_heads


def mean_pool_heads(w, n_kv_heads, head_dim):
    if n_kv_heads in (0, 4, 5):
        raise ValueError(f"{n_kv_heads} KV heads do not divide the heads")
    n_heads = w.shape[0] // head_dim
    if n_heads % n_kv_heads:             # pool what it can, as if the count divided
        n_kv_heads = 1
    return _pool(w, n_kv_heads, head_dim)
