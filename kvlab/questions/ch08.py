"""Chapter 8, "Keeping fewer positions": the Check yourself questions whose answer is a number.

1. A 4,096-row sliding window on Llama 3 8B in fp16: the bytes its cache holds
   (kvlab.measure.kv_cache_bytes at Llama 3 8B's shape).
6. DeepSeek-V2's MLA cache per token in bf16, and 7. DeepSeek-V3's: worked out from the
   published shapes that chapters/figures/ch08.py records in ch08.json (layers, latent
   d_c, decoupled RoPE key d_R, bytes per element), with their sources.
"""
from __future__ import annotations

from . import Number, figures
from ..config import ModelConfig
from ..measure import kv_cache_bytes


def _mla_bytes_per_token(key: str) -> float:
    """(d_c + d_R) values per layer, times layers, times bytes per element."""
    shape = figures("ch08.json")[key]["shape"]
    return float((shape["kv_lora_rank"] + shape["rope_head_dim"]) * shape["n_layers"]
                 * shape["bytes_per_element"])


NUMBERS = {
    1: Number(expected=lambda: float(kv_cache_bytes(ModelConfig.llama3_8b(), 4096, dtype="fp16")),
              unit="bytes", rel_tol=0.01,
              hint="the window holds 4,096 rows whatever the conversation's length: rows x "
                   "bytes per token (2 x layers x KV heads x head_dim x 2 bytes)"),
    6: Number(expected=lambda: _mla_bytes_per_token("mla"), unit="bytes", rel_tol=0.01,
              hint="per layer MLA caches d_c + d_R values (no factor 2: the latent serves K "
                   "and V), times 60 layers, times 2 bytes"),
    7: Number(expected=lambda: _mla_bytes_per_token("mla_v3"), unit="bytes", rel_tol=0.01,
              hint="the same latent and RoPE key as DeepSeek-V2, 512 + 64 values a layer, "
                   "over 61 layers, 2 bytes each in bf16"),
}
