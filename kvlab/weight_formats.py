"""How a weight matrix can be stored: fp32, fp16, bf16 and GGUF's Q8_0, Q4_0, Q4_1, in NumPy.

Decode reads every weight once per token, so a step's time is about the weights' bytes
over the read bandwidth. Storing them in fewer bytes is the other half of quantization
(kvlab.quant does the cache's half):

    format  bytes a weight   a row of in_dim weights
    fp32    4                in_dim float32
    fp16    2                in_dim IEEE halves
    bf16    2                in_dim bf16 (the top 16 bits of a float32, rounded to nearest even)
    q8_0    34 / 32          in_dim / 32 blocks, each a half scale d and 32 int8 codes q;
                             the weight is d * q (GGUF's Q8_0 layout, byte for byte)
    q4_0    18 / 32          blocks of 32: a half d, then 16 bytes, byte j holding weight
                             j's 4-bit code q in its low nibble and weight j + 16's in its
                             high nibble; the weight is d * (q - 8) (GGUF's Q4_0)
    q4_1    20 / 32          blocks of 32: a half d, a half m, then the same 16 bytes of
                             nibbles; the weight is d * q + m (GGUF's Q4_1)

quantize() writes a matrix (out_dim, in_dim) as these bytes, one row of row_bytes() bytes
per output; dequantize() gives back the float32 values they stand for. The C core reads the
same bytes (csrc/weight_formats.c; kvlab._kvlab.matmul runs its product), and its product
is the float32 product over dequantize()'s values, bit for bit: every format's values are
exact float32 numbers, so only the bytes read change, not the arithmetic.

matmul_int8() is the other way to use the block formats (Q8_0, Q4_0, Q4_1), llama.cpp's:
the activations are quantized to int8 per block of 32 as well, and the products are integer
sums. It is not the float32 product (x is rounded too), so it has its own definition here,
which the core's kvlab._kvlab.matmul(x, w, fmt, "int8") follows bit for bit.

Each format is quantized as ggml's reference quantizers do it, in float32. Q8_0: d =
max|x| / 127, q = round(x * (1 / d)), halves away from zero. Q4_0: `max` the value of
largest magnitude, with its sign, d = max / -8, q = min(15, trunc(x * (1 / d) + 8.5)).
Q4_1: d = (max - min) / 15, q = min(15, trunc((x - min) * (1 / d) + 0.5)), m = min. 1 / d
is 0 where d is. d and m are stored as halves (the codes come from the float32 d). So a
matrix the kit writes is the one llama.cpp would write from the same float32 weights (the
gguf package's own quantizer gives the same bytes, tests/test_weight_formats.py).

A model keeps each matrix as a typed array whose dtype says its format (stored() makes
one from values, empty() an unfilled one for a loader to fill, format_of() reads it):
float32, float16, BF16_DTYPE (a bf16 in a one-field record, since NumPy has no bf16) or
Q8_0_DTYPE, Q4_0_DTYPE, Q4_1_DTYPE (one record per block, so a (n_layers, out_dim, in_dim)
matrix is (n_layers, out_dim, in_dim / 32) blocks). values() gives the float32 numbers back;
as_bytes() the uint8 rows the core reads. A GGUF file's Q8_0, Q4_0 and Q4_1 tensors have
these bytes already: kvlab.loaders.gguf copies them as they are.
"""
from __future__ import annotations

import numpy as np

from .quant import bf16_round

FORMATS = ("fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1")
Q8_0_BLOCK = 32          # weights per block
Q8_0_BLOCK_BYTES = 34    # a half scale, then 32 int8 codes
Q8_0_DTYPE = np.dtype([("d", "<f2"), ("q", "i1", (Q8_0_BLOCK,))])
Q4_BLOCK = 32            # weights per Q4_0 or Q4_1 block
Q4_0_BLOCK_BYTES = 18    # a half d, then 16 bytes of two 4-bit codes each
Q4_1_BLOCK_BYTES = 20    # a half d, a half m, then the same 16 bytes
Q4_0_DTYPE = np.dtype([("d", "<f2"), ("qs", "u1", (Q4_BLOCK // 2,))])
Q4_1_DTYPE = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (Q4_BLOCK // 2,))])
BF16_DTYPE = np.dtype([("bf16", "<u2")])
_DTYPES = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2"), "bf16": BF16_DTYPE,
           "q8_0": Q8_0_DTYPE, "q4_0": Q4_0_DTYPE, "q4_1": Q4_1_DTYPE}
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")   # blocks of 32; the ones matmul_int8 takes


def check_format(fmt: str, in_dim: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt in BLOCK_FORMATS and in_dim % Q8_0_BLOCK:
        raise ValueError(f"{fmt} stores blocks of {Q8_0_BLOCK} weights: a row of {in_dim} "
                         f"is not a whole number of blocks")


def row_bytes(fmt: str, in_dim: int) -> int:
    """Bytes of one row of in_dim weights."""
    check_format(fmt, in_dim)
    if fmt in BLOCK_FORMATS:
        return in_dim // Q8_0_BLOCK * _DTYPES[fmt].itemsize
    return in_dim * (4 if fmt == "fp32" else 2)


def bytes_per_weight(fmt: str) -> float:
    """4 for fp32, 2 for fp16 and bf16, a block's bytes over its 32 weights for the others
    (34 / 32 for q8_0, 18 / 32 for q4_0, 20 / 32 for q4_1)."""
    check_format(fmt, Q8_0_BLOCK)
    return row_bytes(fmt, Q8_0_BLOCK) / Q8_0_BLOCK


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0 .. 15 (..., 32) as GGUF packs them: byte j = q[j] | q[j + 16] << 4."""
    q = q.astype(np.uint8)
    return q[..., :Q4_BLOCK // 2] | (q[..., Q4_BLOCK // 2:] << np.uint8(4))


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """The 32 codes (..., 32) of a block's 16 bytes, in weight order."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, 0 where d is 0 (an all-equal block)."""
    return np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (np.round takes them to even)."""
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def block_scales(blocks: np.ndarray, fmt: str) -> tuple:
    """The scales ggml's quantizer picks for blocks (..., 32) of a block format, in float32:
    d (...,) and Q4_1's m (...,; zeros for Q8_0 and Q4_0). They are stored as halves."""
    if fmt == "q4_0":
        # the value of largest magnitude, sign kept: it gets code 0 (d = max / -8 < 0 when
        # max > 0), the other end of the range reaches code 16, which is cut to 15
        at = np.abs(blocks).argmax(axis=-1)[..., None]
        d = np.take_along_axis(blocks, at, axis=-1)[..., 0] / np.float32(-8)
        return d, np.zeros_like(d)
    if fmt == "q4_1":
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        return (high - low) / np.float32(15), low
    d = np.abs(blocks).max(axis=-1) / np.float32(127)                 # float32, as ggml
    return d, np.zeros_like(d)


def block_codes(values: np.ndarray, fmt: str, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The integer codes of values (..., k) in a block whose float32 scales are d and m
    (..., 1) or (...,) broadcast against them: ggml's rounding for each format, then cut to
    the format's range. The cut changes nothing for the scales block_scales() picks from
    the same values; it matters when the scales come from other values (GPTQ's error
    feedback moves a block's later columns after its scales were chosen)."""
    if fmt == "q4_0":
        q = np.trunc(values * _inverse(d) + np.float32(8.5))
        return np.clip(q, 0, 15).astype(np.uint8)
    if fmt == "q4_1":
        q = np.trunc((values - m) * _inverse(d) + np.float32(0.5))
        return np.clip(q, 0, 15).astype(np.uint8)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return np.clip(_round_half_away(values * inverse), -127, 127).astype(np.int8)


def block_values(fmt: str, d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The float32 values codes q (..., k) stand for with scales d, m (..., 1) as stored
    (halves): d * q for Q8_0, d * (q - 8) for Q4_0 (exact in float32), d * q + m for Q4_1
    (d * q exact, then one rounding: the add's)."""
    d = d.astype(np.float16).astype(np.float32)
    if fmt == "q4_0":
        return d * (q.astype(np.float32) - np.float32(8))
    if fmt == "q4_1":
        return d * q.astype(np.float32) + m.astype(np.float16).astype(np.float32)
    return d * q.astype(np.float32)


def pack_blocks(fmt: str, d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Blocks of a block format from float32 scales d, m (out_dim, n_blocks) and codes q
    (out_dim, n_blocks, 32): the rows' bytes, uint8 (out_dim, row_bytes)."""
    packed = np.empty(d.shape, dtype=_DTYPES[fmt])
    packed["d"] = d.astype("<f2")
    if fmt == "q8_0":
        packed["q"] = q
    else:
        packed["qs"] = _pack_nibbles(q)
    if fmt == "q4_1":
        packed["m"] = m.astype("<f2")
    return packed.view(np.uint8).reshape(d.shape[0], -1)


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
    # round to nearest: each block's scales from its own values, then each value's code
    blocks = w.reshape(out_dim, in_dim // Q8_0_BLOCK, Q8_0_BLOCK)
    d, m = block_scales(blocks, fmt)
    return pack_blocks(fmt, d, m, block_codes(blocks, fmt, d[..., None], m[..., None]))


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
    blocks = codes.view(_DTYPES[fmt]).reshape(out_dim, in_dim // Q8_0_BLOCK)
    d = blocks["d"].astype(np.float32)[..., None]
    m = blocks["m"][..., None] if fmt == "q4_1" else np.zeros_like(d)
    q = blocks["q"] if fmt == "q8_0" else _unpack_nibbles(blocks["qs"])
    return block_values(fmt, d, m, q).reshape(out_dim, in_dim)


def quantize_activations(x: np.ndarray) -> tuple:
    """A row of activations (in_dim, a multiple of 32) as int8 per block of 32: float32
    scales amax / 127 (in_dim / 32,) and codes round(x / scale), halves away from zero."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(-1, Q8_0_BLOCK)
    # A block holding inf or NaN has no codes: scale NaN (its products are NaN, as in
    # float32), codes 0. A scale whose inverse overflows float32 rounds every code to 0.
    finite = np.isfinite(blocks).all(axis=-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scales = np.where(finite, np.abs(blocks).max(axis=-1) / np.float32(127), np.nan)
        scales = scales.astype(np.float32)
        inverse = np.where(scales > 0, np.float32(1) / np.where(scales > 0, scales, 1), 0)
        inverse = np.where(np.isfinite(inverse), inverse, 0).astype(np.float32)
        products = np.where(finite[:, None], blocks * inverse[:, None], 0)
    codes = _round_half_away(products).astype(np.int8)
    return scales, codes.reshape(-1)


def _weight_codes(codes: np.ndarray, fmt: str, in_dim: int) -> tuple:
    """A block-format matrix's integer codes (out_dim, n_blocks, 32), d (out_dim, n_blocks)
    and Q4_1's m (out_dim, n_blocks; zeros for the others), all as the products use them:
    Q8_0's q, Q4_0's q - 8, Q4_1's q (its m apart)."""
    blocks = np.ascontiguousarray(codes, dtype=np.uint8).view(_DTYPES[fmt])
    blocks = blocks.reshape(codes.shape[0], in_dim // Q8_0_BLOCK)
    d = blocks["d"].astype(np.float32)
    if fmt == "q8_0":
        return blocks["q"].astype(np.int32), d, np.zeros_like(d)
    q = _unpack_nibbles(blocks["qs"]).astype(np.int32)
    if fmt == "q4_0":
        return q - 8, d, np.zeros_like(d)
    return q, d, blocks["m"].astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a * b in float32 with one rounding (a fused multiply-add, as the core does
    where the CPU has one): float64 holds these products exactly."""
    return (a.astype(np.float64) * b.astype(np.float64) + acc.astype(np.float64)).astype(np.float32)


def matmul_int8(x: np.ndarray, codes: np.ndarray, in_dim: int, fmt: str = "q8_0") -> np.ndarray:
    """x (n_tokens, in_dim) against block-format weights (q8_0, q4_0 or q4_1), llama.cpp's
    way: x quantized per block of 32 too (quantize_activations). In each block the 32
    products code * x_code are added exactly, as integers (at most 2^19: exact in float32
    too); that block total times d_w * d_x is added to one running float32 sum, block after
    block in order, with one rounding (a fused multiply-add, as the core does where the CPU
    has one). This is llama.cpp's reference rule for q8_0 x q8_0. q4_1's weight is
    d_w * q + m_w: its m part is m_w times the block's d_x * (sum of its 32 x codes), made
    once per activation block (llama.cpp's Q8_1 idea), summed block after block in a
    running sum of its own (one rounding each) and added to the main sum at the end."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"int8 activations go with {', '.join(BLOCK_FORMATS)} weights, "
                         f"not {fmt!r}")
    check_format(fmt, in_dim)
    w_codes, w_d, w_m = _weight_codes(codes, fmt, in_dim)   # (out, blocks, 32), (out, blocks) x2
    out = np.empty((len(x), codes.shape[0]), dtype=np.float32)
    for t, row in enumerate(np.asarray(x, dtype=np.float32)):
        x_scales, x_codes = quantize_activations(row)
        x_blocks = x_codes.reshape(-1, Q8_0_BLOCK).astype(np.int32)           # (blocks, 32)
        totals = np.einsum("obi,bi->ob", w_codes, x_blocks)                   # (out, blocks), exact
        x_sums = (x_scales * x_blocks.sum(-1).astype(np.float32)).astype(np.float32)  # (blocks,)
        scale = (w_d * x_scales).astype(np.float32)                          # float32 products
        total = np.zeros(codes.shape[0], dtype=np.float32)
        m_part = np.zeros(codes.shape[0], dtype=np.float32)
        for b in range(totals.shape[1]):
            total = _fma(scale[:, b], totals[:, b].astype(np.float32), total)
            m_part = _fma(w_m[:, b], x_sums[b], m_part)
        out[t] = total + m_part if fmt == "q4_1" else total
    return out


# ---- matrices of a model, as typed arrays -------------------------------------------------

def format_of(array: np.ndarray) -> str:
    """The format a matrix is stored in, from its dtype ('fp32', 'fp16', 'bf16', 'q8_0',
    'q4_0', 'q4_1'); ValueError for any other dtype."""
    for fmt, dtype in _DTYPES.items():
        if array.dtype == dtype:
            return fmt
    raise ValueError(f"a weight matrix is float32, float16, bf16 (weight_formats.BF16_DTYPE) "
                     f"or Q8_0, Q4_0, Q4_1 blocks (weight_formats.Q8_0_DTYPE, Q4_0_DTYPE, "
                     f"Q4_1_DTYPE), got dtype {array.dtype}")


def logical_shape(array: np.ndarray) -> tuple:
    """The shape of the float32 values a stored matrix stands for."""
    if format_of(array) in BLOCK_FORMATS:
        return (*array.shape[:-1], array.shape[-1] * Q8_0_BLOCK)
    return array.shape


def empty(shape: tuple, fmt: str) -> np.ndarray:
    """A new, unfilled matrix stored in `fmt` whose float32 values have `shape` (..., in_dim):
    what a loader fills layer by layer from a file's bytes."""
    check_format(fmt, shape[-1])
    if fmt in BLOCK_FORMATS:
        shape = (*shape[:-1], shape[-1] // Q8_0_BLOCK)
    return np.empty(shape, dtype=_DTYPES[fmt])


def stored(values: np.ndarray, fmt: str) -> np.ndarray:
    """Float32 values (..., in_dim) stored in `fmt`: the same array for fp32, else a typed
    array made a layer (a leading index) at a time, so that no float64 copy of a whole
    model is ever needed."""
    values = np.asarray(values)
    in_dim = values.shape[-1]
    check_format(fmt, in_dim)
    if fmt == "fp32" and values.dtype == np.float32:
        return values
    if values.dtype != np.float32:
        values = values.astype(np.float32)
    rows = values.reshape(-1, in_dim)
    n_rows = rows.shape[0]
    out = np.empty((n_rows, row_bytes(fmt, in_dim)), dtype=np.uint8)
    step = max(1, (16 << 20) // (in_dim * 4))            # about 16 MiB of values at a time
    for first in range(0, n_rows, step):
        out[first:first + step] = quantize(rows[first:first + step], fmt).view(np.uint8)
    return out.view(_DTYPES[fmt]).reshape(*values.shape[:-1], -1)


def values(array: np.ndarray) -> np.ndarray:
    """The float32 numbers a stored matrix stands for (the array itself if it is float32)."""
    fmt = format_of(array)
    if fmt == "fp32":
        return array
    shape = logical_shape(array)
    in_dim = shape[-1]
    rows = np.ascontiguousarray(array).reshape(-1, array.shape[-1])
    out = np.empty((rows.shape[0], in_dim), dtype=np.float32)
    step = max(1, (16 << 20) // (in_dim * 4))
    for first in range(0, rows.shape[0], step):
        chunk = rows[first:first + step]
        out[first:first + step] = dequantize(chunk.view(np.uint8).reshape(len(chunk), -1), fmt, in_dim)
    return out.reshape(shape)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A stored matrix as the core reads it: uint8 (..., row_bytes), the same memory
    (float32 matrices are passed as they are)."""
    if format_of(array) == "fp32":
        return array
    array = np.ascontiguousarray(array)
    return array.view(np.uint8).reshape(*array.shape[:-1], -1)
