"""What a cache that keeps fewer positions must give, in NumPy (kvlab.reference): every
query attends only to the positions a mask leaves it. Shared by tests/test_cache_policy.py
and tests/test_cache_policy_ring.py."""
import numpy as np

from kvlab import reference


def masked_forward(model, ids, visible):
    """Every position's logits, in NumPy, when the query at position p attends only to
    the positions where visible(p) (a bool array over 0..p) is true, every K and V
    computed at its own position: what a cache that keeps those positions must give."""
    c, w = model.config, model.weights
    n, H, KVH, hd = len(ids), c.n_heads, c.n_kv_heads, c.head_dim
    positions = np.arange(n)
    x = w.token_embedding[np.asarray(ids)].astype(np.float32)
    for layer in range(c.n_layers):
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q = reference.rope((h @ w.wq[layer].T).reshape(n, H, hd), positions, c.rope_inv_freq(),
                           c.rope_interleaved)
        k = reference.rope((h @ w.wk[layer].T).reshape(n, KVH, hd), positions, c.rope_inv_freq(),
                           c.rope_interleaved)
        v = (h @ w.wv[layer].T).reshape(n, KVH, hd)
        out = np.empty_like(q)
        for p in range(n):
            seen = np.flatnonzero(visible(p))
            out[p] = reference.attention(q[p:p + 1], k[seen], v[seen], np.array([seen[-1]]))[0]
        x = x + out.reshape(n, H * hd) @ w.wo[layer].T
        h = reference.rmsnorm(x, w.ffn_norm[layer], c.norm_eps)
        x = x + (reference.silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T
    return reference.rmsnorm(x, w.final_norm, c.norm_eps) @ w.classifier.T


def window_mask(window, sinks=0):
    def visible(p):
        j = np.arange(p + 1)
        return (j > p - window) | (j < sinks)
    return visible
