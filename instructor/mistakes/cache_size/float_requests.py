"""Divides with / and returns a fraction of a request (and never clamps at zero)."""
EXPECTED_FAILURES = ["test_max_requests", "test_max_requests_returns_a_whole_number"]


def max_requests(config, memory_bytes, seq_len, dtype="fp16", weights_dtype="fp16"):
    weights = config.n_params * BYTES[weights_dtype]
    return (memory_bytes - weights) / kv_cache_bytes(config, seq_len, 1, dtype)
