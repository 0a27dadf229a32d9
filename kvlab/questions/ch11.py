"""Chapter 11, "Serving at scale": the Check yourself questions whose answer is a number,
worked out with kvlab.cluster (tensor parallelism's K/V bytes, block hashing's reuse, a
tier's transfer time)."""
from __future__ import annotations

from . import Number
from kvlab import cluster

# The inputs the questions state (chapters/11_serving_at_scale.md, "Check yourself")
LLAMA_70B, TP = cluster.SHAPES["Llama-3-70B"], 16              # question 1
SHARED, BLOCK = 100, 16                                         # question 2
LLAMA_8B, CONTEXT, PCIE = cluster.SHAPES["Llama-3-8B"], 4096, 64e9   # question 3


def _bytes_per_gpu() -> float:
    return cluster.kv_bytes_per_gpu(LLAMA_70B, TP, element_bytes=2)["per_gpu"]


def _block_reuse() -> float:
    return SHARED - cluster.block_loss(SHARED, BLOCK)


def _host_ms() -> float:
    nbytes = CONTEXT * cluster.kv_bytes_per_gpu(LLAMA_8B, 1, element_bytes=2)["per_gpu"]
    return 1e3 * cluster.Tier("host", PCIE).seconds(nbytes)


NUMBERS = {
    1: Number(expected=_bytes_per_gpu, unit="bytes", rel_tol=0.001, whole=True,
              hint="16 GPUs and 8 KV heads: each GPU still holds one whole KV head, in "
                   "each of 80 layers, K and V, 128 values of 2 bytes"),
    2: Number(expected=_block_reuse, unit="tokens", rel_tol=0.001, whole=True,
              hint="only full blocks are found by their hash: the shared prefix rounded "
                   "down to a multiple of 16"),
    3: Number(expected=_host_ms, unit="ms", rel_tol=0.01,
              hint="bytes = 4,096 tokens x 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 "
                   "bytes; seconds = bytes / 64e9"),
}
