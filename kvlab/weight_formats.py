"""How a weight matrix can be stored: fp32, fp16, bf16 and GGUF's Q8_0, in NumPy.

Decode reads every weight once per token, so a step's time is about the weights' bytes
over the read bandwidth. Storing them in fewer bytes is the other half of quantization
(kvlab.quant does the cache's half):

    format  bytes a weight   a row of in_dim weights
    fp32    4                in_dim float32
    fp16    2                in_dim IEEE halves
    bf16    2                in_dim bf16 (the top 16 bits of a float32, rounded to nearest even)
    q8_0    34 / 32          in_dim / 32 blocks, each a half scale d and 32 int8 codes q;
                             the weight is d * q (GGUF's Q8_0 layout, byte for byte)

quantize() writes a matrix (out_dim, in_dim) as these bytes, one row of row_bytes() bytes
per output; dequantize() gives back the float32 values they stand for. The C core reads the
same bytes (csrc/weight_formats.c; kvlab._kvlab.matmul runs its product), and its product
is the float32 product over dequantize()'s values, bit for bit: every format's values are
exact float32 numbers, so only the bytes read change, not the arithmetic.

Q8_0 is quantized as ggml does it: d = max|x| / 127 in float32, q = round(x * (1 / d)),
halves away from zero, and d stored as a half. So a matrix the kit writes is the one
llama.cpp would write from the same float32 weights.
"""
from __future__ import annotations

import numpy as np

from .quant import bf16_round

FORMATS = ("fp32", "fp16", "bf16", "q8_0")
Q8_0_BLOCK = 32          # weights per block
Q8_0_BLOCK_BYTES = 34    # a half scale, then 32 int8 codes
Q8_0_DTYPE = np.dtype([("d", "<f2"), ("q", "i1", (Q8_0_BLOCK,))])


def check_format(fmt: str, in_dim: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "q8_0" and in_dim % Q8_0_BLOCK:
        raise ValueError(f"q8_0 stores blocks of {Q8_0_BLOCK} weights: a row of {in_dim} "
                         f"is not a whole number of blocks")


def row_bytes(fmt: str, in_dim: int) -> int:
    """Bytes of one row of in_dim weights."""
    check_format(fmt, in_dim)
    if fmt == "q8_0":
        return in_dim // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
    return in_dim * (4 if fmt == "fp32" else 2)


def bytes_per_weight(fmt: str) -> float:
    return {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "q8_0": Q8_0_BLOCK_BYTES / Q8_0_BLOCK}[fmt]


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (np.round takes them to even)."""
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """A float32 matrix (out_dim, in_dim) as the bytes of `fmt`: float32 (out_dim, in_dim)
    for fp32 (a copy), else uint8 (out_dim, row_bytes(fmt, in_dim))."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"a weight matrix is 2-D (out_dim, in_dim), got shape {w.shape}")
    out_dim, in_dim = w.shape
    check_format(fmt, in_dim)
    if fmt == "fp32":
        return w.copy()
    if fmt == "fp16":
        return w.astype("<f2").view(np.uint8).reshape(out_dim, -1)
    if fmt == "bf16":
        return bf16_round(w).astype("<u2").view(np.uint8).reshape(out_dim, -1)
    blocks = w.reshape(out_dim, in_dim // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)                 # float32, as ggml
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = _round_half_away(blocks * inverse[..., None]).astype(np.int8)
    packed = np.empty(blocks.shape[:2], dtype=Q8_0_DTYPE)
    packed["d"], packed["q"] = d.astype("<f2"), q
    return packed.view(np.uint8).reshape(out_dim, -1)


def dequantize(codes: np.ndarray, fmt: str, in_dim: int) -> np.ndarray:
    """The float32 values (out_dim, in_dim) that quantize()'s bytes stand for."""
    check_format(fmt, in_dim)
    if fmt == "fp32":
        return np.asarray(codes, dtype=np.float32).reshape(-1, in_dim)
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out_dim = codes.shape[0]
    if codes.shape[1:] != (row_bytes(fmt, in_dim),):
        raise ValueError(f"{fmt} rows of {in_dim} weights are {row_bytes(fmt, in_dim)} bytes, "
                         f"got shape {codes.shape}")
    if fmt == "fp16":
        return codes.view("<f2").astype(np.float32).reshape(out_dim, in_dim)
    if fmt == "bf16":
        bits = codes.view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(out_dim, in_dim)
    blocks = codes.view(Q8_0_DTYPE).reshape(out_dim, in_dim // Q8_0_BLOCK)
    values = blocks["d"].astype(np.float32)[..., None] * blocks["q"].astype(np.float32)
    return values.reshape(out_dim, in_dim)
