"""A piece reduced without its largest score: m = 0 for every piece, l and acc sums of exp(s).
The merge rule holds for any m, so every output with small scores is right."""
TARGETS = ["test_a_piece_reduces_to_its_max_sum_and_weighted_values",
           "test_each_piece_of_a_split_is_reduced"]


def partial(q, keys, values):
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    acc = np.zeros((n_heads, head_dim), dtype=np.float32)
    m = np.full(n_heads, -np.inf, dtype=np.float32)
    l = np.zeros(n_heads, dtype=np.float32)
    if len(keys) == 0:
        return acc, m, l
    m[:] = 0
    for h in range(n_heads):
        weights = np.exp(keys[:, h // kv_mul] @ q[h] / np.float32(math.sqrt(head_dim)))
        l[h] = weights.sum()
        acc[h] = weights @ values[:, h // kv_mul]
    return acc, m, l
