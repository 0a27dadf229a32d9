"""Lab 3: cache size by hand, and measured. Fill in every function marked TODO.

Check your work with:  kvlab check cache_size cache_size.py    (the public checks)
Your grade:            kvlab grade cache_size cache_size.py    (your course runs hidden tests)
You may import numpy, math, Python's standard library, and from kvlab only
kvlab.measure.resident_bytes and kvlab.measure.release_freed_memory (the arithmetic is
yours to write: the grader refuses a file that uses kvlab's).
"""
import kvlab.measure


def kv_bytes_per_token(n_layers, n_kv_heads, head_dim, bytes_per_element):
    """Bytes one token adds to the KV cache: K and V, every layer, every KV head."""
    # TODO: the formula from chapter 2
    raise NotImplementedError("kv_bytes_per_token")


def kv_cache_bytes(config, seq_len, batch=1, dtype="fp16"):
    """Bytes of K and V for `batch` requests of `seq_len` tokens each.

    config: the model's shape, plain numbers: config.n_layers, config.n_heads,
    config.n_kv_heads, config.head_dim, config.dim, config.vocab_size, ... and
    config.n_params (its parameter count).

    dtype: "fp32" (4 bytes a value), "fp16" or "bf16" (2), or "int8" (1 byte a value plus
    one float32 scale per head row: every K row and every V row of every head, token and
    layer has its own scale).
    """
    # TODO
    raise NotImplementedError("kv_cache_bytes")


def max_requests(config, memory_bytes, seq_len, dtype="fp16", weights_dtype="fp16"):
    """How many requests of `seq_len` tokens fit in `memory_bytes` beside the weights
    (config.n_params parameters stored in weights_dtype). 0 if none fits."""
    # TODO
    raise NotImplementedError("max_requests")


def measure_resident_growth(model, seq_len, batch):
    """Create `batch` fp32 caches of `seq_len` positions, fill each with `seq_len` tokens,
    and return how many bytes the process's resident memory grew (see the lab's README).

    model: a model lent by the grader: model.config, model.new_cache(max_seq_len),
    model.prefill(tokens, cache), model.forward(tokens), model.encode(text)."""
    # TODO: kvlab.measure.release_freed_memory(), kvlab.measure.resident_bytes(),
    #       model.new_cache(...), model.prefill(...)
    raise NotImplementedError("measure_resident_growth")
