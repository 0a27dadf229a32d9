"""Lab 9: int8 cache quantization with an error bound. Fill in every function marked TODO.

Chapter 6 (chapters/06_quantization.md) stores K and V in fewer bits. Here you write the
int8 format kvlab's C core uses, exactly: the grader compares your codes bit for bit with
kvlab.quant.quantize(x, "int8", group) and with the codes an int8 cache stores
(cache.key_codes, cache.key_scales). kvlab/quant.py's quantize and round_trip_error_bound
are the specification: read them, but do not import them.

The format: the last axis of x (head_dim values of one head) is cut into groups of
`group` consecutive values. Each group gets one float32 scale and int8 codes:

    scale = max |x| over the group / 127          (float32 arithmetic)
    code  = rint(x / scale), clipped to [-127, 127], as int8
    value the code stands for = code * scale

rint rounds halves to even (np.rint: 2.5 -> 2, 3.5 -> 4), as C's nearbyintf does. Divide
by the scale (multiplying by 1 / scale gives different codes now and then). An all-zero
group has scale 0: divide it by 1 instead, so its codes are 0 (0 / 0 is NaN).

Check your work with:  kvlab check int8_cache int8_cache.py    (the public checks)
Your grade:            kvlab grade int8_cache int8_cache.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""
import math

import numpy as np


def quantize_int8(x, group):
    """Symmetric int8 quantization of float32 x (..., d) in groups of `group` values
    along the last axis (group divides d).

    Returns (codes, scales): codes int8 of x's shape, scales float32 of shape
    x.shape[:-1] + (d // group,), scales[..., j] belonging to x[..., j*group:(j+1)*group].
    Hint: x.reshape(*x.shape[:-1], d // group, group) puts each group on its own row.
    """
    # TODO
    raise NotImplementedError("quantize_int8")


def dequantize_int8(codes, scales, group):
    """The float32 values int8 codes (..., d) stand for: code * its group's scale.
    scales: (..., d // group) float32. Returns float32 of codes' shape."""
    # TODO
    raise NotImplementedError("dequantize_int8")


def error_bound(x, group):
    """The largest round-trip error |dequantize(quantize(x)) - x| each value of float32 x
    (..., d) can have: half a step of its group, scale / 2, with kvlab's allowance for
    float rounding: (scale / 2) * 1.0001 + 1e-12 (see kvlab.quant.round_trip_error_bound;
    the grader accepts scale / 2 too).
    Returns float32 of x's shape (every value of a group gets the group's bound)."""
    # TODO
    raise NotImplementedError("error_bound")


def int8_bytes_per_token(config, group):
    """Bytes one token adds to an int8 cache with this group size: K and V, every layer,
    every KV head: one byte per value plus one float32 scale per group.
    config: the model's shape, plain numbers (config.n_layers, config.n_kv_heads,
    config.head_dim, ...)."""
    # TODO
    raise NotImplementedError("int8_bytes_per_token")


def attend_int8(q, key_codes, key_scales, value_codes, value_scales, group):
    """One decode step of attention over an int8 cache of one layer, as the C core does it:
    on the values the codes stand for.

    q: (n_heads, head_dim) float32; key_codes, value_codes: (length, n_kv_heads, head_dim)
    int8; key_scales, value_scales: (length, n_kv_heads, head_dim // group) float32 (as
    cache.key_codes[layer], cache.key_scales[layer], ... of an int8 cache).
    Returns (n_heads, head_dim). Query head h reads KV head h // (n_heads // n_kv_heads);
    scores / sqrt(head_dim); a softmax that subtracts the largest score (as your attend of
    lab 1 does: write it here again, or copy it in).
    """
    # TODO
    raise NotImplementedError("attend_int8")
