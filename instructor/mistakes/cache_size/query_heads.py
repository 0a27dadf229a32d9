"""Sizes the cache by query heads: right for MHA, too big for GQA (the bundled model) and MQA."""
EXPECTED_FAILURES = ["test_cache_bytes_gqa", "test_cache_bytes_every_shape_and_float_dtype",
                     "test_cache_bytes_int8_counts_its_scales", "test_cache_bytes_match_a_real_cache"]


def kv_cache_bytes(config, seq_len, batch=1, dtype="fp16"):
    per_token = kv_bytes_per_token(config.n_layers, config.n_heads, config.head_dim, BYTES[dtype])
    if dtype == "int8":
        per_token += 2 * config.n_layers * config.n_heads * 4
    return per_token * seq_len * batch
