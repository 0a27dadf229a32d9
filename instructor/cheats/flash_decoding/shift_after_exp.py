"""The shift by the largest score done after exp instead of before: exp(s) * exp(-m) is
exp(s - m) on paper, m is reported right, and every check with small scores passes; a score
of 100 makes it inf * 0."""
TARGETS = ["test_large_scores_do_not_overflow"]


def partial(q, keys, values):
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    acc = np.zeros((n_heads, head_dim), dtype=np.float32)
    m = np.full(n_heads, -np.inf, dtype=np.float32)
    l = np.zeros(n_heads, dtype=np.float32)
    if len(keys) == 0:
        return acc, m, l
    for h in range(n_heads):
        scores = keys[:, h // kv_mul] @ q[h] / np.float32(math.sqrt(head_dim))
        m[h] = scores.max()
        weights = np.exp(scores) * np.exp(-m[h])         # the shift, after the exp
        l[h] = weights.sum()
        acc[h] = weights @ values[:, h // kv_mul]
    return acc, m, l
