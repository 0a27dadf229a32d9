"""Chapter 2, "How big is the cache": the Check yourself questions whose answer is a number,
worked out with kvlab.kv_cache_bytes and kvlab.kv_bytes_per_token from the shapes (the
Llama presets; Llama 3 70B's and SmolLM2's as chapters/figures/ch02.json recorded them)."""
from __future__ import annotations

from .. import measure
from ..config import ModelConfig
from . import Number, figures

GB = 10 ** 9


def _llama3_8b_request() -> int:
    return measure.kv_cache_bytes(ModelConfig.llama3_8b(), 8192, dtype="fp16")


def _requests_in_80_gb() -> int:
    config = ModelConfig.llama2_7b()
    free = 80 * GB - measure.weights_bytes(config, "fp16")
    return free // measure.kv_cache_bytes(config, 4096, dtype="fp16")


def _gqa_factor() -> float:
    mha = ModelConfig.llama2_7b()                    # 32 heads of 128, all of them KV heads
    gqa = mha.replace(n_kv_heads=8)
    return measure.kv_bytes_per_token(mha, "fp16") / measure.kv_bytes_per_token(gqa, "fp16")


def _llama3_70b_per_gpu() -> int:
    fact = figures("ch02.json")["facts"]["llama3_70b"]
    config = ModelConfig(**fact["config"])
    one_gpu = config.replace(n_kv_heads=config.n_kv_heads // fact["gpus"])
    return measure.kv_bytes_per_token(one_gpu, "fp16")


def _smollm2_chats_int8() -> int:
    config = ModelConfig(**figures("ch02.json")["smollm2"]["config"])
    return GB // measure.kv_cache_bytes(config, 4096, dtype="int8")


NUMBERS = {
    1: Number(expected=_llama3_8b_request, unit="bytes", rel_tol=0.01,
              hint="2 x 32 layers x 8 KV heads x 128 x 2 bytes per token, times 8,192"),
    2: Number(expected=_requests_in_80_gb, unit="requests (fp16 cache)", rel_tol=0.01, whole=True,
              hint="(80e9 - the fp16 weights) // one request's cache; whole requests only"),
    5: Number(expected=_gqa_factor, unit="x", rel_tol=0.01,
              hint="the weights are the same; the cache per token is divided by "
                   "n_heads / n_kv_heads"),
    6: Number(expected=_llama3_70b_per_gpu, unit="bytes per token per GPU", rel_tol=0.01,
              hint="each GPU holds every layer, but only 8 / 8 = 1 KV head of each"),
    7: Number(expected=_smollm2_chats_int8, unit="chats (int8 cache)", rel_tol=0.01, whole=True,
              hint="10**9 // kvlab.kv_cache_bytes(config, 4096, dtype='int8'): the int8 "
                   "format stores a scale beside each head row, which kv_cache_bytes counts"),
}
