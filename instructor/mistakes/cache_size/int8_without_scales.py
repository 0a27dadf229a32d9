"""Counts int8 codes but forgets the float32 scale each head row carries."""
EXPECTED_FAILURES = ["test_cache_bytes_int8_counts_its_scales", "test_cache_bytes_match_a_real_cache",
                     "test_max_requests", "test_cache_bytes_worked_example"]


def kv_cache_bytes(config, seq_len, batch=1, dtype="fp16"):
    return kv_bytes_per_token(config.n_layers, config.n_kv_heads, config.head_dim,
                              BYTES[dtype]) * seq_len * batch
