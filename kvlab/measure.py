"""Cache-size arithmetic: what the chapter computes by hand, as functions.

    bytes per token = 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes per element

Plain Python, no compiled code: it works for any ModelConfig, including presets far too
large to load here (kvlab.ModelConfig.llama2_7b()). Measuring real processes is not
here yet; compare with `cache.nbytes` / `pool.nbytes` of real caches.
"""
from __future__ import annotations

from .config import ModelConfig

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}


def _element_bytes(dtype: str) -> int:
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(BYTES_PER_ELEMENT)}") from None


def kv_bytes_per_token(config: ModelConfig, dtype: str = "fp16") -> int:
    """Bytes one token adds to the cache, over all layers, K and V."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * _element_bytes(dtype)


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype: str = "fp16") -> int:
    """Bytes of K and V for `batch` requests of `seq_len` tokens each."""
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return kv_bytes_per_token(config, dtype) * seq_len * batch


def weights_bytes(config: ModelConfig, dtype: str = "fp16") -> int:
    """Bytes of the model's weights stored in dtype."""
    return config.n_params() * _element_bytes(dtype)
