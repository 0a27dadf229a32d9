"""The reference forward pass: a Llama-family decoder in plain NumPy, written to be read.

This is the kit's specification of the math: what each layer computes. The C core
(csrc/model.c) is tested against it to within float32 rounding, and the chapters quote it.
(The bits are specified elsewhere: csrc/plain.c fixes the order of every sum, and the fast
kernels match it bit for bit; kvlab/quant.py fixes the cache formats' codes.) It is slow on purpose: no threads, no tricks,
float32 like the C core. It handles both RoPE layouts, GQA/MQA and tied classifiers.
It is not used for generation speed; see kvlab.model for that.

    cache = ReferenceCache(config, max_seq_len=64)
    logits = forward(config, weights, tokens, cache)      # cached: appends K, V
    logits = forward(config, weights, tokens)             # uncached: from position 0

A cache may store K and V in fewer bits (kvlab.quant): then attention reads what the
codes stand for, except the residual window's rows, which it reads as computed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import quant
from .config import ModelConfig
from .weights import Weights


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Scale each row to unit root-mean-square, then by a learned per-channel weight."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(mean_square + np.float32(eps))) * weight


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
         interleaved: bool) -> np.ndarray:
    """Rotate each head's pairs of coordinates by position * inv_freq.

    x: (n_tokens, n_heads, head_dim). Interleaved pairs are (x[2i], x[2i+1]) (llama2.c,
    Meta); otherwise (x[i], x[i + head_dim/2]) (Hugging Face's rotate_half layout).
    """
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]   # (n_tokens, half)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    half = x.shape[-1] // 2
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    rotated_a = a * cos - b * sin
    rotated_b = b * cos + a * sin
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = rotated_a, rotated_b
    else:
        out[..., :half], out[..., half:] = rotated_a, rotated_b
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class ReferenceCache:
    """K and V for every layer, (n_layers, max_seq_len, n_kv_heads, head_dim), like the C
    cache. `key`/`value` hold them as computed; `stored_key`/`stored_value` hold what a
    cache of the given format keeps: the values its codes stand for."""

    def __init__(self, config: ModelConfig, max_seq_len: Optional[int] = None,
                 cache_format: Optional[quant.CacheFormat] = None):
        capacity = max_seq_len or config.max_seq_len
        shape = (config.n_layers, capacity, config.n_kv_heads, config.head_dim)
        self.format = cache_format or quant.CacheFormat()
        self.key = np.zeros(shape, dtype=np.float32)
        self.value = np.zeros(shape, dtype=np.float32)
        self.stored_key = np.zeros(shape, dtype=np.float32)
        self.stored_value = np.zeros(shape, dtype=np.float32)
        self.length = 0

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Keep new rows k, v (n, n_kv_heads, head_dim) at positions start.."""
        f = self.format
        self.key[layer, start:start + len(k)] = k
        self.value[layer, start:start + len(v)] = v
        self.stored_key[layer, start:start + len(k)] = quant.dequantize(
            quant.quantize(k, f.key, f.key_group or None))
        self.stored_value[layer, start:start + len(v)] = quant.dequantize(
            quant.quantize(v, f.value, f.value_group or None))

    def visible(self, layer: int, position: int) -> tuple:
        """The keys and values a query at `position` reads: positions 0..position, the
        most recent `window` of them as computed, the rest as stored."""
        first_exact = max(0, position + 1 - self.format.window)
        keys = np.concatenate([self.stored_key[layer, :first_exact],
                               self.key[layer, first_exact:position + 1]])
        values = np.concatenate([self.stored_value[layer, :first_exact],
                                 self.value[layer, first_exact:position + 1]])
        return keys, values

    @property
    def keys(self) -> np.ndarray:
        return self.key[:, :self.length]

    @property
    def values(self) -> np.ndarray:
        return self.value[:, :self.length]


# [quote ch01-attention]
def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
              positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention.

    q: (n_tokens, n_heads, head_dim) queries of the new tokens at `positions`;
    keys, values: (n_positions, n_kv_heads, head_dim), everything cached so far including
    the new tokens. Query head h reads KV head h // (n_heads // n_kv_heads).
    """
    n_heads, head_dim = q.shape[1], q.shape[2]
    kv_mul = n_heads // keys.shape[1]
    keys = np.repeat(keys, kv_mul, axis=1)        # (n_positions, n_heads, head_dim)
    values = np.repeat(values, kv_mul, axis=1)
    scores = np.einsum("thd,phd->htp", q, keys) / np.float32(np.sqrt(head_dim))
    # the causal mask: a token at position p sees positions 0..p only
    future = np.arange(keys.shape[0])[None, :] > positions[:, None]     # (n_tokens, n_positions)
    scores = np.where(future[None], np.float32(-np.inf), scores)
    weights = softmax(scores).astype(np.float32)
    return np.einsum("htp,phd->thd", weights, values)
# [end ch01-attention]


def forward(config: ModelConfig, weights: Weights, tokens: Sequence[int],
            cache: Optional[ReferenceCache] = None) -> np.ndarray:
    """Logits (n_tokens, vocab_size) for new tokens.

    With a cache, the tokens continue the cached sequence and their K and V are
    appended. Without one, they are the whole sequence from position 0, and every K and
    V is computed afresh: the no-cache path.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"tokens must be a non-empty 1-D sequence of ids in [0, {config.vocab_size})")
    # [quote ch01-forward-k-and-v]
    if cache is None:
        cache = ReferenceCache(config, max_seq_len=len(tokens))
    start = cache.length
    if start + len(tokens) > cache.key.shape[1]:
        raise ValueError("reference cache is full")
    positions = np.arange(start, start + len(tokens))
    inv_freq = config.rope_inv_freq()
    n, H, KVH, hd = len(tokens), config.n_heads, config.n_kv_heads, config.head_dim
    w = weights.float32()          # matrices stored in fewer bytes: their float32 values

    x = w.token_embedding[tokens].astype(np.float32)             # (n, dim)
    for layer in range(config.n_layers):
        # attention sublayer
        h = rmsnorm(x, w.attn_norm[layer], config.norm_eps)
        q = (h @ w.wq[layer].T).reshape(n, H, hd)
        k = (h @ w.wk[layer].T).reshape(n, KVH, hd)
        v = (h @ w.wv[layer].T).reshape(n, KVH, hd)
        q = rope(q, positions, inv_freq, config.rope_interleaved)
        k = rope(k, positions, inv_freq, config.rope_interleaved)
        cache.write(layer, start, k, v)                            # computed once, kept
        if cache.format == quant.CacheFormat():                    # fp32: all queries at once
            seen = slice(0, start + n)
            out = attention(q, cache.key[layer, seen], cache.value[layer, seen], positions)
        else:   # each query reads its own mix of stored and exact rows (the window)
            out = np.concatenate([attention(q[t:t + 1], *cache.visible(layer, int(p)), positions[t:t + 1])
                                  for t, p in enumerate(positions)])
        x = x + out.reshape(n, H * hd) @ w.wo[layer].T
    # [end ch01-forward-k-and-v]
        # MLP sublayer (SwiGLU)
        h = rmsnorm(x, w.ffn_norm[layer], config.norm_eps)
        x = x + (silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T
    cache.length = start + n
    return rmsnorm(x, w.final_norm, config.norm_eps) @ w.classifier.T


def probabilities(logits: np.ndarray, temperature: float, top_k: Optional[int],
                  top_p: Optional[float]) -> np.ndarray:
    """The distribution sampling draws the next token from (temperature > 0): softmax of
    logits / temperature over the top_k most likely tokens, then the smallest set of most
    likely tokens whose probability reaches top_p, renormalized. float64, sums to 1."""
    scaled = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < scaled.size:
        kth_largest = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled < kth_largest, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p is not None and top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p) + 1)]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return probs


def sample(logits: np.ndarray, temperature: float, top_k: Optional[int], top_p: Optional[float],
           u: float) -> int:
    """The next token, chosen as the C core chooses it (csrc/sampling.c), with u, a number
    in [0, 1), as the random draw. Greedy (temperature 0) takes the arg-max."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    probs = probabilities(logits, temperature, top_k, top_p)
    # inverse transform sampling: the first token whose cumulative probability exceeds u
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf / cdf[-1], u, side="right"))
