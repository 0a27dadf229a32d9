"""Chapter 6, "Quantizing the cache": the Check yourself questions whose answer is a number,
worked out with the kit's own byte counts and quantizer."""
from __future__ import annotations

import numpy as np

from . import Number
import kvlab
from kvlab import quant
from kvlab import measure

# The inputs the questions state (chapters/06_quantization.md, "Check yourself")
GROUP = [0.01, -0.02, 0.03, 12.7]            # question 2
OUTLIER, REST = 3065.0, 0.9                   # question 7: one large value, 31 below 1


def _llama2_int8() -> float:
    return kvlab.kv_bytes_per_token(kvlab.ModelConfig.llama2_7b(), "int8")


def _int8_scale() -> float:
    return float(quant.quantize(np.asarray(GROUP, dtype=np.float32), "int8").scales.ravel()[0])


def _window_share() -> float:
    config = kvlab.ModelConfig.llama3_8b()
    plain = kvlab.kv_cache_bytes(config, 4096, dtype="int4")
    windowed = kvlab.kv_cache_bytes(config, 4096, dtype="int4", window=32)
    return 100 * (windowed - plain) / plain


def _better_saving() -> float:
    config = kvlab.ModelConfig.llama3_8b()

    def total(weights, cache):
        return sum(measure.decode_step_bytes(config, 8192, 16, weights, cache))
    base = total("fp16", "fp16")
    return 100 * max(1 - total("q8_0", "fp16") / base, 1 - total("fp16", "int8") / base)


def _outlier_step() -> float:
    block = np.full(32, REST, dtype=np.float32)
    block[0] = OUTLIER
    return float(quant.quantize(block, "int8").scales.ravel()[0])


NUMBERS = {
    1: Number(expected=_llama2_int8, unit="bytes", rel_tol=0.001,
              hint="2 x layers x KV heads x head_dim codes of 1 byte, plus one 4-byte scale "
                   "per head row: (1 + 4/128) bytes per value"),
    2: Number(expected=_int8_scale, unit="(the scale)", rel_tol=0.001,
              hint="the scale is the group's largest magnitude over 127"),
    4: Number(expected=_window_share, unit="%", rel_tol=0.01,
              hint="the window is 2 x layers x 32 positions x kv_dim float32 values; the "
                   "int4 cache of 4,096 positions is kvlab.kv_cache_bytes(config, 4096, "
                   "dtype='int4')"),
    6: Number(expected=_better_saving, unit="%", rel_tol=0.01,
              hint="compare 1 - new total / old total for each choice, with "
                   "kvlab.measure.decode_step_bytes(config, 8192, 16, weights, cache)"),
    7: Number(expected=_outlier_step, unit="(the step)", rel_tol=0.01,
              hint="the step is the block's largest magnitude over 127"),
}
