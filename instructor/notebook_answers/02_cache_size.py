"""Worked answer to notebook 02's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("02_cache_size", requests_that_fit)
"""
import kvlab


def requests_that_fit(config, memory_bytes, seq_len, cache_format="fp16"):
    # The weights come first: fp16, 2 bytes per parameter.
    left = memory_bytes - 2 * config.n_params()
    if left <= 0:
        return 0                                # the weights alone fill the memory
    # One request's cache: the formula times seq_len, scales included for int8
    # (kvlab.kv_cache_bytes is exactly what model.new_cache(seq_len, dtype) allocates).
    per_request = kvlab.kv_cache_bytes(config, seq_len, dtype=cache_format)
    # Whole requests only: round down.
    return left // per_request

# 80 GB and Llama 2 7B: (80e9 - 13.48e9) // 2 GiB = 30 requests of 4,096 tokens in fp16,
# 60 in int8 (1 byte per value + a 4-byte scale per head row of 128: 1.03 GiB a request).
# Mistakes the check catches: forgetting the weights, rounding up, a negative count when the
# weights do not fit (Llama 2 70B on 80 GB), n_heads instead of n_kv_heads, ignoring the
# cache format.
