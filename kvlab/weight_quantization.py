"""Three ways to choose a model's 4- and 8-bit weights: round to nearest, AWQ, GPTQ.

kvlab.weight_formats stores a matrix in GGUF's block formats (Q8_0, Q4_0, Q4_1: a scale,
Q4_1 also a minimum, per block of 32 weights) by rounding each weight to the nearest
level its block offers: round to nearest (RTN), what the kit and llama.cpp's basic
quantizers do. The bytes are fixed by the format; which codes fill them is a choice, and
two published methods choose better by looking at what the matrix is multiplied with:
activations from a little calibration text, run through the float model.

  - AWQ-style activation-aware scaling (after Lin et al., 2024): a few input channels
    carry much larger activations than the rest, so their weights' errors count for more.
    Multiply weight column j by s_j > 1 and divide the input channel by s_j: the product is
    unchanged, but the scaled column is rounded with relatively finer steps. With s =
    mean|x| ** alpha, alpha is found per layer by a grid search that minimizes the layer's
    output error on the calibration activations. The division by s is folded into the
    operation before the matrix, so the model keeps its shape and the kit runs it as it
    is: into the RMSNorm weight before wq/wk/wv and before w1/w3, into w3's rows before
    w2 (w2's input is silu(w1 x) * (w3 x)), and into wv's rows before wo (attention mixes
    value rows linearly; with GQA a value channel feeds kv_mul query heads, so those heads
    share one scale).
  - GPTQ-style error feedback (after Frantar et al., 2023): quantize a matrix column by
    column, and after each column move the rounding error onto the columns not yet
    quantized, in the direction that keeps the layer's output on the calibration inputs
    closest (the inverse of the Hessian H = X^T X, through its Cholesky factor). A block
    format fixes each block's scales when the block's first column is reached, from the
    weights as the feedback has left them; then its 32 columns go one by one.

Every result is a kvlab.Weights in the same formats as round to nearest, so a Model runs
it at the same speed (a decode step reads the same bytes); only the codes differ.

    calibration = calibrate(model.config, model.weights, tokens)        # float32 model
    weights = quantize_weights(model.config, model.weights, "q4_0", "awq", calibration)
    kvlab.Model(model.config, weights, model.tokenizer)

This is a readable NumPy version for a 135M-parameter model on a laptop CPU, not a
production quantizer: no search over clipping ranges (AWQ's second step), no activation
ordering or sequential re-calibration (GPTQ's options), one calibration pass of the float
model for every layer. The token embedding and classifier are stored as they are (or as
`embedding_format` says), by round to nearest: the embedding is a table lookup, with no
activations to weigh it by.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np

from . import reference, weight_formats
from .config import ModelConfig
from .weight_formats import BLOCK_FORMATS, Q8_0_BLOCK
from .weights import Weights

METHODS = ("rtn", "awq", "gptq")
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# AWQ's grid: alpha = 0 (no scaling, round to nearest), 0.05, ..., 0.95
ALPHAS = tuple(i / 20 for i in range(20))
# which calibration input each matrix multiplies
INPUT_OF = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "wo", "w1": "ffn", "w3": "ffn",
            "w2": "w2"}


@dataclasses.dataclass
class Calibration:
    """What each layer's matrices multiply, on calibration text run through the model."""
    attn: np.ndarray   # (n_layers, n_tokens, dim)        normed input of wq, wk, wv
    wo: np.ndarray     # (n_layers, n_tokens, q_dim)      attention's output, wo's input
    ffn: np.ndarray    # (n_layers, n_tokens, dim)        normed input of w1, w3
    w2: np.ndarray     # (n_layers, n_tokens, hidden_dim) silu(w1 x) * (w3 x), w2's input

    def inputs(self, name: str, layer: int) -> np.ndarray:
        """The calibration inputs (n_tokens, in_dim) of matrix `name` in `layer`."""
        return getattr(self, INPUT_OF[name])[layer]


def calibrate(config: ModelConfig, weights: Weights, tokens: Sequence[int],
              window: Optional[int] = None) -> Calibration:
    """Run tokens through the model (its float32 values, kvlab.reference's pieces) in
    windows of `window` tokens (default 256, or the model's context if shorter), each from
    position 0, and keep every matrix's input."""
    window = min(256, config.max_seq_len) if window is None else window
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or len(tokens) < 1:
        raise ValueError("calibration tokens must be a non-empty 1-D sequence of ids")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"calibration token ids must be in [0, {config.vocab_size})")
    if not 1 <= window <= config.max_seq_len:
        raise ValueError(f"window must be between 1 and {config.max_seq_len}, got {window}")
    w = weights.float32()
    # Each window's inputs are written straight into their place in the result: a list of
    # windows stacked, then joined, copied these hundreds of megabytes three more times.
    widths = {"attn": config.dim, "wo": config.q_dim, "ffn": config.dim, "w2": config.hidden_dim}
    seen = {key: np.empty((config.n_layers, len(tokens), width), np.float32)
            for key, width in widths.items()}
    for i in range(0, len(tokens), window):
        _layer_inputs(config, w, tokens[i:i + window],
                      {key: array[:, i:i + window] for key, array in seen.items()})
    return Calibration(**seen)


def _layer_inputs(config: ModelConfig, w: Weights, tokens: np.ndarray,
                  out: Dict[str, np.ndarray]) -> None:
    """One window's matrix inputs, layer by layer (the math of reference.forward, uncached),
    written into out[key][layer] (each (n_layers, len(tokens), width), float32)."""
    n, c = len(tokens), config
    positions, inv_freq = np.arange(n), c.rope_inv_freq()
    x = w.token_embedding[tokens].astype(np.float32)
    for layer in range(c.n_layers):
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q, k, v = (h @ w.wq[layer].T, h @ w.wk[layer].T, h @ w.wv[layer].T)
        q = reference.rope(q.reshape(n, c.n_heads, c.head_dim), positions, inv_freq,
                           c.rope_interleaved)
        k = reference.rope(k.reshape(n, c.n_kv_heads, c.head_dim), positions, inv_freq,
                           c.rope_interleaved)
        mixed = reference.attention(q, k, v.reshape(n, c.n_kv_heads, c.head_dim),
                                    positions).reshape(n, c.q_dim)
        x = x + mixed @ w.wo[layer].T
        g = reference.rmsnorm(x, w.ffn_norm[layer], c.norm_eps)
        gated = reference.silu(g @ w.w1[layer].T) * (g @ w.w3[layer].T)
        x = x + gated @ w.w2[layer].T
        for key, value in (("attn", h), ("wo", mixed), ("ffn", g), ("w2", gated)):
            out[key][layer] = value          # (cast to float32 as it is stored)


# ---- round to nearest --------------------------------------------------------------------

def rounded(w: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 values a matrix (out_dim, in_dim) has once stored in `fmt` by round to
    nearest (kvlab.weight_formats' quantizer, ggml's)."""
    return weight_formats.dequantize(weight_formats.quantize(w, fmt), fmt, w.shape[-1])


def output_error(x: np.ndarray, w: np.ndarray, w_stored: np.ndarray) -> float:
    """||x w^T - x w_stored^T||^2: how far a layer's outputs on inputs x (n, in_dim) move
    when weights w (out_dim, in_dim) are replaced by w_stored. float64 sums."""
    diff = x.astype(np.float32) @ (w - w_stored).T
    return float(np.square(diff, dtype=np.float64).sum())


# ---- AWQ: activation-aware scales --------------------------------------------------------

def awq_scales(magnitude: np.ndarray, alpha: float) -> np.ndarray:
    """AWQ's per-channel scales s = magnitude ** alpha, normalized so that the largest and
    the smallest multiply to 1 (the scales spread around 1, neither all large nor all small).
    magnitude: mean |x| per input channel, (in_dim,); alpha 0 gives all ones."""
    s = np.maximum(np.asarray(magnitude, dtype=np.float64), 1e-8) ** alpha
    s = np.maximum(s, 1e-4)
    return (s / np.sqrt(s.max() * s.min())).astype(np.float32)


@dataclasses.dataclass
class ScaleSearch:
    """awq_search's result for one group of matrices sharing an input."""
    alpha: float                 # the grid's best
    scales: np.ndarray           # (in_dim,) float32: multiply the columns, divide the input
    errors: Dict[float, float]   # summed output error of the group for every alpha tried


# [quote ch10-awq-search]
def awq_search(x: np.ndarray, matrices: Sequence[np.ndarray], fmt: str,
               alphas: Sequence[float] = ALPHAS, magnitude: Optional[np.ndarray] = None
               ) -> ScaleSearch:
    """The alpha of the grid whose scales give the smallest output error, summed over the
    matrices (each (out_dim, in_dim)) that read the same inputs x (n, in_dim): with scales
    s, a matrix is stored as round-to-nearest(w * s) and its input divided by s, so its
    outputs become x @ (stored / s)^T. magnitude (default mean |x| per channel) sets s."""
    if magnitude is None:
        magnitude = np.abs(x).mean(axis=0)
    errors, best = {}, None
    for alpha in alphas:
        s = awq_scales(magnitude, alpha)
        errors[alpha] = sum(output_error(x, w, rounded(w * s, fmt) / s) for w in matrices)
        if best is None or errors[alpha] < errors[best]:
            best = alpha
    return ScaleSearch(alpha=best, scales=awq_scales(magnitude, best), errors=errors)
# [end ch10-awq-search]


def awq_fold(config: ModelConfig, weights: Weights, calibration: Calibration, fmt: str,
             alphas: Sequence[float] = ALPHAS, max_tokens: int = 256) -> tuple:
    """The weights with AWQ's scales folded in (the same function as before, up to float32
    rounding): the layer matrices and norms as float32 values, the token embedding and
    classifier as they were stored; and each layer's searches {"wo": ScaleSearch, ...}. Each layer's
    consumer is scaled before its producer (w2 before w1/w3, wo before wq/wk/wv), so a
    search sees the rows the previous fold left. The error is measured on the first
    max_tokens calibration tokens; the magnitudes on all of them."""
    w = dataclasses.replace(weights.float32())
    arrays = {name: getattr(w, name).copy() for name in LAYER_MATRICES + ("attn_norm", "ffn_norm")}
    found = []
    for layer in range(config.n_layers):
        a = {name: array[layer] for name, array in arrays.items()}     # views: edits land
        searches = {}
        for group, matrices, fold in (("w2", ("w2",), _fold_w2), ("wo", ("wo",), _fold_wo),
                                      ("ffn", ("w1", "w3"), _fold_norm),
                                      ("attn", ("wq", "wk", "wv"), _fold_norm)):
            x = getattr(calibration, group)[layer]
            magnitude = np.abs(x).mean(axis=0)
            if group == "wo":          # heads that share a value channel share its scale
                magnitude = _shared_by_kv_heads(config, magnitude)
            search = awq_search(x[:max_tokens], [a[m] for m in matrices], fmt, alphas,
                                magnitude)
            fold(config, a, matrices, search.scales)
            searches[group] = search
        found.append(searches)
    return dataclasses.replace(weights, **arrays), found


def _shared_by_kv_heads(config: ModelConfig, magnitude: np.ndarray) -> np.ndarray:
    """Per-channel magnitudes of attention's output (q_dim,), averaged over the kv_mul query
    heads that read the same value head, and repeated back to (q_dim,)."""
    per_head = magnitude.reshape(config.n_kv_heads, config.kv_mul, config.head_dim)
    return np.repeat(per_head.mean(axis=1, keepdims=True), config.kv_mul, axis=1).reshape(-1)


def _scale_columns(a: dict, matrices: Sequence[str], s: np.ndarray) -> None:
    for name in matrices:
        a[name] *= s


def _fold_norm(config: ModelConfig, a: dict, matrices: Sequence[str], s: np.ndarray) -> None:
    """The input of wq/wk/wv (or w1/w3) is an RMSNorm's output: its weight takes 1 / s."""
    _scale_columns(a, matrices, s)
    a["attn_norm" if matrices[0] == "wq" else "ffn_norm"] /= s


def _fold_w2(config: ModelConfig, a: dict, matrices: Sequence[str], s: np.ndarray) -> None:
    """w2's input is silu(w1 x) * (w3 x): dividing w3's row j by s_j divides channel j."""
    _scale_columns(a, matrices, s)
    a["w3"] /= s[:, None]


def _fold_wo(config: ModelConfig, a: dict, matrices: Sequence[str], s: np.ndarray) -> None:
    """wo's input mixes value rows with attention weights: dividing wv's rows divides it.
    s is (q_dim,), equal across the query heads of a KV head; wv has one row per KV head
    channel."""
    _scale_columns(a, matrices, s)
    per_kv = s.reshape(config.n_kv_heads, config.kv_mul, config.head_dim)[:, 0]
    a["wv"] /= per_kv.reshape(-1)[:, None]


# ---- GPTQ: error feedback ----------------------------------------------------------------

def hessian(x: np.ndarray, damp: float = 0.01) -> np.ndarray:
    """H = x^T x (in_dim, in_dim) in float64, with damp times its mean diagonal added to
    the diagonal (GPTQ's dampening: calibration text rarely spans every direction). An
    input channel that is always 0 gets a 1 there: its weights never matter."""
    x = x.astype(np.float64)
    h = x.T @ x
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    return h


def gptq_quantize(w: np.ndarray, h: np.ndarray, fmt: str) -> np.ndarray:
    """A matrix (out_dim, in_dim) stored in block format `fmt` by GPTQ's error feedback, as
    the bytes weight_formats.quantize gives (uint8 (out_dim, row_bytes)). h: the damped
    Hessian of its inputs (hessian()). Blocks of 32 columns, one at a time: the block's
    scales from its current weights, then each column rounded, its error divided by the
    Cholesky factor's diagonal and fed to the block's later columns at once, to the later
    blocks after the block (the lazy batch update)."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"GPTQ here fills block formats ({', '.join(BLOCK_FORMATS)}), "
                         f"got {fmt!r}")
    out_dim, in_dim = w.shape
    weight_formats.check_format(fmt, in_dim)
    # the upper Cholesky factor of H^-1: row j holds how column j's error spreads onward
    u = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)
    work = np.array(w.T, dtype=np.float32)        # (in_dim, out_dim): a column is a row here
    n_blocks = in_dim // Q8_0_BLOCK
    d, m = np.empty((out_dim, n_blocks), np.float32), np.empty((out_dim, n_blocks), np.float32)
    codes = np.empty((out_dim, n_blocks, Q8_0_BLOCK), np.int8 if fmt == "q8_0" else np.uint8)
    # [quote ch10-gptq-blocks]
    for b in range(n_blocks):
        first, stop = b * Q8_0_BLOCK, (b + 1) * Q8_0_BLOCK
        block = work[first:stop]                  # (32, out_dim), updated in place below
        d[:, b], m[:, b] = weight_formats.block_scales(block.T, fmt)
        errors = np.empty_like(block)
        for i in range(Q8_0_BLOCK):
            j = first + i
            q = weight_formats.block_codes(block[i], fmt, d[:, b], m[:, b])
            codes[:, b, i] = q
            errors[i] = (block[i] - weight_formats.block_values(fmt, d[:, b], m[:, b], q)) / u[j, j]
            block[i + 1:] -= u[j, j + 1:stop, None] * errors[i]
        work[stop:] -= u[first:stop, stop:].T @ errors
    # [end ch10-gptq-blocks]
    return weight_formats.pack_blocks(fmt, d, m, codes)


# ---- whole models --------------------------------------------------------------------------

def quantize_weights(config: ModelConfig, weights: Weights, fmt: str, method: str = "rtn",
                     calibration: Optional[Calibration] = None, *,
                     embedding_format: Optional[str] = None, alphas: Sequence[float] = ALPHAS,
                     damp: float = 0.01) -> Weights:
    """weights with every layer matrix (wq ... w3) stored in block format `fmt`, chosen by
    `method`: "rtn" (round to nearest), "awq" (scales searched on the grid `alphas`, folded
    in, then round to nearest) or "gptq" (error feedback with dampening `damp`). AWQ and
    GPTQ need a Calibration of these weights. The token embedding and classifier are kept
    as stored, or stored as `embedding_format` by round to nearest."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(BLOCK_FORMATS)}, got {fmt!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "rtn" and calibration is None:
        raise ValueError(f"method {method!r} needs a Calibration (calibrate(config, weights, "
                         "tokens))")
    if calibration is not None and calibration.attn.shape[0] != config.n_layers:
        raise ValueError(f"the calibration has {calibration.attn.shape[0]} layers, the model "
                         f"{config.n_layers}")
    base = weights
    if method == "awq":
        base, _ = awq_fold(config, weights, calibration, fmt, alphas)
    if method == "gptq":
        arrays = _gptq_layers(config, base, calibration, fmt, damp)
    else:
        arrays = {name: weight_formats.stored(weight_formats.values(getattr(base, name)), fmt)
                  for name in LAYER_MATRICES}
    # the embedding and classifier as they were stored (AWQ's fold leaves them alone)
    embedding, classifier = weights.token_embedding, weights.classifier
    if embedding_format is not None:
        embedding = weight_formats.stored(weight_formats.values(embedding), embedding_format)
        classifier = embedding if weights.classifier is weights.token_embedding else \
            weight_formats.stored(weight_formats.values(classifier), embedding_format)
    return dataclasses.replace(base, token_embedding=embedding, classifier=classifier,
                               **arrays)


# the matrices that read the same input, quantized together (GPTQ treats rows alike)
GROUPS = (("wq", "wk", "wv"), ("wo",), ("w1", "w3"), ("w2",))


def _gptq_layers(config: ModelConfig, weights: Weights, calibration: Calibration, fmt: str,
                 damp: float) -> Dict[str, np.ndarray]:
    """Every layer matrix by GPTQ, as typed arrays of `fmt` blocks: one Hessian per layer
    and input, the rows of the matrices that share it stacked into one pass."""
    out = {name: weight_formats.empty(weight_formats.logical_shape(getattr(weights, name)), fmt)
           for name in LAYER_MATRICES}
    for layer in range(config.n_layers):
        for group in GROUPS:
            h = hessian(calibration.inputs(group[0], layer), damp)
            values = [weight_formats.values(getattr(weights, name)[layer]) for name in group]
            packed = gptq_quantize(np.concatenate(values), h, fmt)
            rows = np.cumsum([0] + [len(v) for v in values])
            for name, first, last in zip(group, rows[:-1], rows[1:]):
                out[name][layer] = packed[first:last].view(out[name].dtype)
    return out
