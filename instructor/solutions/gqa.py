"""Lab 4 reference solution (instructors only: never hand this to students)."""
import math

import numpy as np

from kvlab.accuracy import kl_divergence, perplexity


def attend(q, keys, values):
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    out = np.empty((n_heads, head_dim), dtype=np.float32)
    for h in range(n_heads):
        kv = h // kv_mul                                   # consecutive query heads share a KV head
        scores = keys[:, kv] @ q[h] / math.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ values[:, kv]
    return out


def causal_attention(q, k, v):
    T, n_heads, head_dim = q.shape
    kv_mul = n_heads // k.shape[1]
    k, v = np.repeat(k, kv_mul, axis=1), np.repeat(v, kv_mul, axis=1)   # a KV head per query head
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
    scores[:, np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf        # nothing later
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, v).astype(np.float32)


def mean_pool_heads(w, n_kv_heads, head_dim):
    rows, dim = w.shape
    n_heads = rows // head_dim
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_kv_heads} KV heads do not divide {n_heads} heads")
    groups = w.reshape(n_kv_heads, n_heads // n_kv_heads, head_dim, dim)
    return groups.mean(axis=1).reshape(n_kv_heads * head_dim, dim).astype(np.float32)


def convert(model, n_kv_heads):
    keys, values = [], []
    for layer in range(model.config.n_layers):
        wk, wv = model.key_value_weights(layer)
        keys.append(mean_pool_heads(wk, n_kv_heads, model.config.head_dim))
        values.append(mean_pool_heads(wv, n_kv_heads, model.config.head_dim))
    return model.with_key_value_weights(keys, values)


def forward(model, tokens):
    x = model.embed(tokens)
    positions = np.arange(len(tokens))
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, positions)
        x = model.attention_output(layer, x, causal_attention(q, k, v))
        x = model.mlp(layer, x)
    return model.logits(x)


def conversion_table(model, tokens, kv_head_counts):
    c = model.config
    original = forward(model, tokens)
    rows = []
    for n_kv_heads in kv_head_counts:
        logits = forward(convert(model, n_kv_heads), tokens)
        rows.append({"n_kv_heads": n_kv_heads,
                     "cache_bytes_per_token": 2 * c.n_layers * n_kv_heads * c.head_dim * 4,
                     "perplexity": perplexity(logits, tokens),
                     "kl": kl_divergence(original, logits)})
    return rows
