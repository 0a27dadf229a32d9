"""Chapter 10, "Choosing weight codes: RTN, AWQ, GPTQ": the Check yourself questions
whose answer is a number, worked out with the kit's formats and scales."""
from __future__ import annotations

import numpy as np

from . import Number
from kvlab import weight_formats
from kvlab import weight_quantization as wq
from kvlab.config import ModelConfig

# The inputs the questions state (chapters/10_weight_quantization.md, "Check yourself")
SMOLLM2 = ModelConfig(dim=576, hidden_dim=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                      vocab_size=49152, max_seq_len=8192)      # question 1
LOUD, ALPHA = 50.0, 0.5                                         # question 2


def _layer_bytes_q4_0() -> float:
    c = SMOLLM2
    weights = c.n_layers * (c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim
                            + 3 * c.dim * c.hidden_dim)
    return weights * weight_formats.bytes_per_weight("q4_0")


def _loud_scale_ratio() -> float:
    s = wq.awq_scales(np.array([1.0, LOUD]), ALPHA)
    return float(s[1] / s[0])


NUMBERS = {
    1: Number(expected=_layer_bytes_q4_0, unit="bytes", rel_tol=0.001,
              hint="count the weights of wq, wk, wv, wo, w1, w2 and w3 in one layer, times "
                   "30 layers, times 18 bytes per 32 weights"),
    2: Number(expected=_loud_scale_ratio, unit="x", rel_tol=0.01,
              hint="s = magnitude ** alpha; the normalization divides every scale by the "
                   "same number, so it leaves their ratio alone"),
}
