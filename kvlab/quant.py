"""Cache quantization formats in plain NumPy: the specification of the cache formats' codes,
which the C core (csrc/quant.c) must match bit for bit.

"Cache quantization is the same core idea as model quantization, applied to the cache":
store K and V in fewer bits, and pay in precision. Each format here maps float32 rows to
codes (plus scales and zero points) and back. Quantization works along the last axis
(head_dim), in groups of `group` values; every group gets its own scale.

    fp16  IEEE half precision, round to nearest even            2 bytes per value
    bf16  the top 16 bits of float32, round to nearest even     2 bytes per value
    int8  symmetric: code = rint(x / scale), scale = max|x| / 127 per group
          dequantized code * scale                              1 byte + 4 per group
    int4  asymmetric: code = rint((x - zero) / scale) in 0..15, zero = group min,
          scale = (max - min) / 15, two codes per byte (even index in the low nibble)
                                                                0.5 byte + 8 per group
    fp8   e4m3 (1 sign, 4 exponent, 3 mantissa bits, largest value 448, no infinity)
          of x / scale, scale = max|x| / 448 per group          1 byte + 4 per group

Every step is float32 arithmetic with round-half-to-even (np.rint), the default rounding
of C's nearbyintf, so a C implementation doing the same operations in the same order
gets the same codes bit for bit (csrc/quant.c does; tests/test_quant.py checks). This
module stores no cache: quantized caches belong to the C core.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from . import arguments

FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "fp8")


@dataclasses.dataclass
class Quantized:
    """Codes and per-group parameters of a quantized array x of shape (..., head_dim)."""
    format: str
    codes: np.ndarray                   # fp16/bf16: uint16 (..., d); int8: int8 (..., d);
                                        # int4: uint8 (..., d // 2); fp8: uint8 (..., d)
    scales: Optional[np.ndarray] = None  # float32 (..., d // group) for int8, int4 and fp8
    zeros: Optional[np.ndarray] = None   # float32 (..., d // group) for int4
    group: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.zeros) if a is not None)


def check_format(fmt: str, head_dim: int, group: Optional[int] = None) -> int:
    """The group size to use (default: all of head_dim for int8 and fp8, that is one scale
    per token per head; for int4 32 values, or all of head_dim when 32 does not divide
    it); raises ValueError for an unknown format or a group that does not divide head_dim."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt in ("fp32", "fp16", "bf16"):
        if group not in (None, 0):
            raise ValueError(f"{fmt} has no groups: leave the group size unset (got {group!r})")
        return 0
    if group is None or (not isinstance(group, (bool, np.bool_)) and group == 0):
        group = 32 if fmt == "int4" and head_dim % 32 == 0 else head_dim
    group = arguments.integer(group, "group size", None, arguments.C_INT_MAX)   # no bool, no float
    if group < 1 or head_dim % group:
        raise ValueError(f"group size {group!r} must divide head_dim ({head_dim})")
    if fmt == "int4" and group % 2:
        raise ValueError(f"int4 packs two codes per byte: group size {group} must be even")
    return int(group)


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """How a cache stores K and V: each one's format and group size, and the residual
    window (the most recent positions every query reads in float32). Build it with
    CacheFormat.make(head_dim, ...), which fills in default group sizes and checks them.

        CacheFormat.make(128, "int8")                      # K and V int8, a scale per head
        CacheFormat.make(128, key="int8", value="int4", window=32)
    """
    key: str = "fp32"
    value: str = "fp32"
    key_group: int = 0
    value_group: int = 0
    window: int = 0

    @classmethod
    def make(cls, head_dim: int, dtype: Union[str, "CacheFormat"] = "fp32", *,
             key: Optional[str] = None, value: Optional[str] = None,
             group: Optional[int] = None, key_group: Optional[int] = None,
             value_group: Optional[int] = None, window: int = 0) -> "CacheFormat":
        """dtype sets both formats, key/value override it; group applies to whichever of
        them has groups unless key_group/value_group say otherwise. dtype may also be a
        CacheFormat, then alone: it is checked against head_dim and returned as it is."""
        if isinstance(dtype, CacheFormat):
            given = {"key": key, "value": value, "group": group, "key_group": key_group,
                     "value_group": value_group, "window": window or None}
            extra = sorted(name for name, v in given.items() if v is not None)
            if extra:
                raise TypeError(f"dtype is a CacheFormat, which says everything: drop "
                                f"{', '.join(extra)} (or pass dtype as a name)")
            fmt = dtype
            return cls.make(head_dim, key=fmt.key, value=fmt.value,
                            key_group=fmt.key_group or None, value_group=fmt.value_group or None,
                            window=fmt.window)
        if not isinstance(dtype, str):
            raise TypeError(f"dtype must be a format name ({', '.join(FORMATS)}) or a "
                            f"kvlab.CacheFormat, got {type(dtype).__name__}")
        key, value = key or dtype, value or dtype
        for name in (key, value):
            if not isinstance(name, str) or name not in FORMATS:
                raise ValueError(f"unknown cache format {name!r}; known: {', '.join(FORMATS)}")
        grouped = [name for name in (key, value) if name not in ("fp32", "fp16", "bf16")]
        if group not in (None, 0) and not grouped:
            raise ValueError(f"{key} has no groups: leave the group size unset (got {group!r})")
        if key_group is None:
            key_group = group if key not in ("fp32", "fp16", "bf16") else None
        if value_group is None:
            value_group = group if value not in ("fp32", "fp16", "bf16") else None
        message = f"window must be a non-negative number of positions, got {window!r}"
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
            raise arguments.ArgumentTypeError(message)
        if window < 0:
            raise ValueError(message)
        arguments.count(window, "window")          # at most a C int
        return cls(key, value, check_format(key, head_dim, key_group),
                   check_format(value, head_dim, value_group), int(window))

    def row_bytes(self, n_kv_heads: int, head_dim: int) -> int:
        """Bytes one position of one layer takes, K and V, scales and zero points included."""
        kv_dim = n_kv_heads * head_dim
        return sum(int(round(kv_dim * bytes_per_value(fmt, head_dim, group or None)))
                   for fmt, group in ((self.key, self.key_group), (self.value, self.value_group)))

    def window_bytes(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence's full-precision window rows, K and V, every layer."""
        return 2 * n_layers * self.window * n_kv_heads * head_dim * 4

    def core_arguments(self) -> dict:
        """The keyword arguments of the core's KVCache and PagedPool."""
        return {"key_format": self.key, "value_format": self.value,
                "key_group": self.key_group, "value_group": self.value_group,
                "window": self.window}

    @property
    def name(self) -> str:
        """A short label: 'int8', 'int8/fp16', 'int4 g32 +w16'."""
        def one(fmt, group):
            return fmt if fmt in ("fp32", "fp16", "bf16") else f"{fmt} g{group}"
        label = one(self.key, self.key_group)
        if (self.value, self.value_group) != (self.key, self.key_group):
            label += "/" + one(self.value, self.value_group)
        return label + (f" +w{self.window}" if self.window else "")


def bytes_per_value(fmt: str, head_dim: int, group: Optional[int] = None) -> float:
    """Average bytes one cached value costs, scales and zero points included."""
    group = check_format(fmt, head_dim, group)
    return {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0,
            "int8": 1.0 + 4.0 / group if group else 0.0,
            "int4": 0.5 + 8.0 / group if group else 0.0,
            "fp8": 1.0 + 4.0 / group if group else 0.0}[fmt]


def _grouped(x: np.ndarray, group: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | np.uint32(0x0040)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


E4M3_MAX = np.float32(448.0)


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """float32 -> fp8 e4m3 bits (uint8), round to nearest even, saturating at +-448."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    sign = ((v.view(np.uint32) >> 24) & 0x80).astype(np.uint8)
    magnitude = np.where(np.isnan(v), np.float32(0), np.minimum(np.abs(v), E4M3_MAX))
    # below the smallest normal, 2**-6, codes are multiples of 2**-9
    subnormal = np.rint(magnitude * np.float32(512)).astype(np.uint32)
    bits = magnitude.view(np.uint32)
    normal = ((bits + np.uint32(0x7FFFF) + ((bits >> 20) & 1)) >> 20) - np.uint32(120 << 3)
    code = np.where(magnitude < np.float32(2.0 ** -6), subnormal, normal).astype(np.uint8)
    return np.where(np.isnan(v), sign | 0x7F, sign | code).astype(np.uint8)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """fp8 e4m3 bits (uint8) -> float32: (-1)^s * 2^(e-7) * 1.m, subnormal when e = 0."""
    codes = np.asarray(codes, dtype=np.uint8)
    exponent = ((codes >> 3) & 0x0F).astype(np.int32)
    mantissa = (codes & 0x07).astype(np.float32)
    value = np.where(exponent == 0, np.ldexp(mantissa, -9),
                     np.ldexp(np.float32(1) + mantissa / np.float32(8), exponent - 7))
    value = np.where((codes & 0x7F) == 0x7F, np.float32(np.nan), value).astype(np.float32)
    return np.where(codes & 0x80, -value, value).astype(np.float32)


# [quote ch06-quantize]
def quantize(x: np.ndarray, fmt: str, group: Optional[int] = None) -> Quantized:
    """Quantize float32 x (..., head_dim) along its last axis."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    group = check_format(fmt, x.shape[-1], group)
    if fmt == "fp32":
        return Quantized(fmt, x.copy())
    if fmt == "fp16":
        return Quantized(fmt, x.astype(np.float16).view(np.uint16))
    if fmt == "bf16":
        return Quantized(fmt, bf16_round(x))
    g = _grouped(x, group)
    if fmt == "fp8":
        scale = (np.abs(g).max(axis=-1) / E4M3_MAX).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        codes = e4m3_encode(g / safe[..., None])
        return Quantized(fmt, codes.reshape(x.shape), scale, None, group)
    if fmt == "int8":
        scale = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))           # an all-zero group
        codes = np.clip(np.rint(g / safe[..., None]), -127, 127).astype(np.int8)
        return Quantized(fmt, codes.reshape(x.shape), scale, None, group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scale = ((high - low) / np.float32(15)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint((g - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    codes = codes.reshape(x.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return Quantized(fmt, packed, scale, low.astype(np.float32), group)
# [end ch06-quantize]


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values the codes stand for."""
    if q.format == "fp32":
        return q.codes.copy()
    if q.format == "fp16":
        return q.codes.view(np.float16).astype(np.float32)
    if q.format == "bf16":
        return (q.codes.astype(np.uint32) << 16).view(np.float32)
    if q.format == "int8":
        g = _grouped(q.codes.astype(np.float32), q.group)
        return (g * q.scales[..., None]).reshape(q.codes.shape)
    if q.format == "fp8":
        g = _grouped(e4m3_decode(q.codes), q.group)
        return (g * q.scales[..., None]).reshape(q.codes.shape)
    codes = np.empty(q.codes.shape[:-1] + (2 * q.codes.shape[-1],), dtype=np.float32)
    codes[..., 0::2] = q.codes & 0x0F
    codes[..., 1::2] = q.codes >> 4
    g = _grouped(codes, q.group)
    return (g * q.scales[..., None] + q.zeros[..., None]).reshape(codes.shape)


def round_trip_error_bound(x: np.ndarray, fmt: str, group: Optional[int] = None) -> np.ndarray:
    """Largest |dequantize(quantize(x)) - x| each value may show: half a step of its group
    for the integer formats, half a unit in the last place for the float ones."""
    x = np.asarray(x, dtype=np.float32)
    group = check_format(fmt, x.shape[-1], group)
    if fmt == "fp32":
        return np.zeros_like(x)
    if fmt in ("fp16", "bf16"):
        mantissa_bits = 10 if fmt == "fp16" else 7
        # Below the smallest normal number the spacing stops shrinking (subnormals), so the
        # exponent is clamped there: 2**-14 for fp16, 2**-126 for bf16 (exact powers of two).
        smallest_normal = np.float32(2.0 ** -14) if fmt == "fp16" else np.finfo(np.float32).tiny
        exponent = np.floor(np.log2(np.maximum(np.abs(x), smallest_normal)))
        return (2.0 ** (exponent - mantissa_bits - 1)).astype(np.float32) * 1.0001
    g = _grouped(x, group)
    if fmt == "fp8":
        # 3 mantissa bits: half a unit in the last place of x / scale is at most 1/16 of
        # it, and below 2**-6 the spacing stops shrinking (2**-9, half of it 2**-10)
        scale = np.abs(g).max(axis=-1, keepdims=True) / E4M3_MAX
        scaled = np.abs(g) / np.where(scale > 0, scale, 1)
        exponent = np.floor(np.log2(np.maximum(scaled, 2.0 ** -6)))
        bound = 2.0 ** (exponent - 4) * scale * 1.0001 + 1e-30
        return bound.reshape(x.shape).astype(np.float32)
    if fmt == "int8":
        step = np.abs(g).max(axis=-1) / 127
    else:
        step = (g.max(axis=-1) - g.min(axis=-1)) / 15
    bound = np.broadcast_to((step * 0.5 * 1.0001 + 1e-12)[..., None], g.shape)
    return bound.reshape(x.shape).astype(np.float32)
