"""Lab 13: choosing 4-bit weights by their activations (AWQ's scale search). Fill in every
function marked TODO.

Chapter 10 (chapters/10_weight_quantization.md) stores a model's matrices in GGUF's Q4_0:
blocks of 32 weights, a half-precision scale d each, and a 4-bit code per weight. Round to
nearest picks each block's scale from its own weights alone. But a weight's error reaches
the layer's output multiplied by its input channel's activation, and a few channels carry
activations tens of times larger than the rest. AWQ (Lin et al., 2024) multiplies the
weight column of channel j by s_j and divides the channel's input by s_j: the product is
the same, but the scaled column is stored with relatively finer steps. Here you write Q4_0's
round to nearest, AWQ's scales, the search for the best ones, and the fold that moves the
division into the RMSNorm before the matrices.

Every array given is float32 (NumPy). A matrix w is (out_dim, in_dim), y = x @ w.T, and
the activations x are (n_tokens, in_dim): row t is token t's input.

Check your work with:  kvlab check weight_quantization weight_quantization.py
Your grade:            kvlab grade weight_quantization weight_quantization.py
You may import numpy, math and Python's standard library, not kvlab (kvlab/weight_formats.py
and kvlab/weight_quantization.py are the specification to read, not to call).
"""
import numpy as np


def q4_0_round_to_nearest(w):
    """The float32 values (out_dim, in_dim) that matrix w has once stored in Q4_0 by round
    to nearest, ggml's way, bit for bit. in_dim is a multiple of 32; each row is cut into
    blocks of 32 consecutive weights, and in each block:

        m  = the weight of largest magnitude, with its sign (the first of equal ones)
        d  = m / -8                                  float32
        q  = min(15, trunc(x * (1 / d) + 8.5))       the code of each weight, 0..15;
                                                     1 / d is 0 where d is 0
        value = d16 * (q - 8)                        d16: d stored as a half (float16)
                                                     and read back as float32
    """
    # TODO
    raise NotImplementedError("q4_0_round_to_nearest")


def channel_scales(magnitude, alpha):
    """AWQ's scales for input channels whose mean |activation| is `magnitude` (in_dim,),
    all > 0: s = magnitude ** alpha, then divided by sqrt(max(s) * min(s)) so that they
    spread around 1. Returns float32 (in_dim,). alpha = 0 gives all ones."""
    # TODO
    raise NotImplementedError("channel_scales")


def output_error(x, w, w_stored):
    """How far the layer's outputs move when w is replaced by w_stored, on inputs x:
    ||x @ w.T - x @ w_stored.T||^2, summed over every token and output (a float)."""
    # TODO
    raise NotImplementedError("output_error")


def search_scales(x, matrices, alphas):
    """AWQ's grid search for one group of matrices that read the same input x (n, in_dim)
    (wq, wk and wv, or w1 and w3). For each alpha of `alphas`, in order: the scales s =
    channel_scales(mean |x| of each input channel, alpha); each matrix stored as
    q4_0_round_to_nearest(w * s), its input divided by s, so its outputs become
    x @ (stored / s).T; the error of the group, the sum of output_error over the matrices.
    Returns {"alpha": the alpha with the least error, "scales": its scales (float32,
    (in_dim,)), "errors": the error of each alpha, in the grid's order}."""
    # TODO
    raise NotImplementedError("search_scales")


def fold_into_norm(norm_weight, matrices, scales):
    """Move the division by the scales into the RMSNorm before the matrices, so the model
    keeps its shape: returns (norm_weight / scales, [w * scales for each matrix]), float32.
    (RMSNorm multiplies its output by its weight, channel by channel.)"""
    # TODO
    raise NotImplementedError("fold_into_norm")


if __name__ == "__main__":
    # Try things here: the grader never runs this block. For instance, a layer of SmolLM2:
    #   import kvlab
    #   from kvlab import weight_quantization as wq
    #   model = kvlab.load("smollm2-135m")
    #   calibration = wq.calibrate(model.config, model.weights, model.encode("To be, or not to be ..."))
    #   x = calibration.attn[5]                        # the input of layer 5's wq, wk, wv
    #   w = model.weights.float32()
    #   print(search_scales(x, [w.wq[5], w.wk[5], w.wv[5]], [0.0, 0.2, 0.4, 0.6, 0.8]))
    pass
