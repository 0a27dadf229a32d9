"""Lab 3 reference solution (instructors only: never hand this to students)."""
import numpy as np

import kvlab
import kvlab.measure

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def kv_bytes_per_token(n_layers, n_kv_heads, head_dim, bytes_per_element):
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_element


def kv_cache_bytes(config, seq_len, batch=1, dtype="fp16"):
    per_token = kv_bytes_per_token(config.n_layers, config.n_kv_heads, config.head_dim,
                                   BYTES[dtype])
    if dtype == "int8":
        per_token += 2 * config.n_layers * config.n_kv_heads * 4   # a float32 scale per head row
    return per_token * seq_len * batch


def max_requests(config, memory_bytes, seq_len, dtype="fp16", weights_dtype="fp16"):
    weights = config.n_params * BYTES[weights_dtype]
    left = memory_bytes - weights
    if left <= 0:
        return 0
    return left // kv_cache_bytes(config, seq_len, 1, dtype)


def measure_resident_growth(model, seq_len, batch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, size=seq_len) for _ in range(batch)]
    model.forward(prompts[0][:1])             # touch the weights before measuring
    kvlab.measure.release_freed_memory()
    before = kvlab.measure.resident_bytes()
    caches = [model.new_cache(seq_len) for _ in range(batch)]
    for cache, prompt in zip(caches, prompts):
        model.prefill(prompt, cache)
    kvlab.measure.release_freed_memory()
    grown = kvlab.measure.resident_bytes() - before
    del caches
    return grown
