"""Lab 2 reference solution (instructors only: never hand this to students)."""
import math
import time

import numpy as np


class KVCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers                     # per layer: (positions, n_kv_heads, head_dim)
        self.v = [None] * n_layers

    def append(self, layer, k, v):
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k.copy(), v.copy()
        else:                                           # grows: a new array each time (simple,
            self.k[layer] = np.concatenate([self.k[layer], k])   # not fast; see chapter 2)
            self.v[layer] = np.concatenate([self.v[layer], v])

    def keys(self, layer):
        return self.k[layer]

    def values(self, layer):
        return self.v[layer]

    @property
    def length(self):
        last = self.k[-1]
        return 0 if last is None else len(last)

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.k + self.v if a is not None)


def attention(q, keys, values, positions):
    n, n_heads, head_dim = q.shape
    out = np.empty((n, n_heads, head_dim), dtype=np.float32)
    for t, p in enumerate(positions):
        for h in range(n_heads):                        # MHA: query head h has KV head h
            kk = keys[:p + 1, h]                        # the causal mask: positions 0..p
            vv = values[:p + 1, h]
            scores = kk @ q[t, h] / math.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            out[t, h] = (weights / weights.sum()) @ vv
    return out


def forward(model, tokens, cache=None):
    start = 0 if cache is None else cache.length
    positions = np.arange(start, start + len(tokens))
    x = model.embed(tokens)
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, positions)
        if cache is None:                               # everything from position 0, kept nowhere
            keys, values = k, v
        else:
            cache.append(layer, k, v)
            keys, values = cache.keys(layer), cache.values(layer)
        x = model.attention_output(layer, x, attention(q, keys, values, positions))
        x = model.mlp(layer, x)
    return model.logits(x)


def generate(model, prompt, n_new, use_cache=True):
    tokens, steps = list(prompt), []
    cache = KVCache(model.config.n_layers) if use_cache else None
    for i in range(n_new):
        if cache is None:
            logits = forward(model, tokens)[-1]         # the whole sequence, every step
        elif i == 0:
            logits = forward(model, tokens, cache)[-1]  # prefill
        else:
            logits = forward(model, tokens[-1:], cache)[-1]   # decode: one token
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):], np.array(steps)


def step_seconds(model, prompt, n_new, use_cache):
    tokens, seconds = list(prompt), []
    cache = KVCache(model.config.n_layers) if use_cache else None
    for i in range(n_new):
        started = time.perf_counter()
        if cache is None:
            logits = forward(model, tokens)[-1]
        else:
            logits = forward(model, tokens if i == 0 else tokens[-1:], cache)[-1]
        seconds.append(time.perf_counter() - started)
        tokens.append(int(np.argmax(logits)))
    return seconds


def fit_line(positions, seconds):
    p, t = np.asarray(positions, np.float64), np.asarray(seconds, np.float64)
    b = np.sum((p - p.mean()) * (t - t.mean())) / np.sum((p - p.mean()) ** 2)
    return float(t.mean() - b * p.mean()), float(b)


def predicted_speedup(cached, uncached, prompt_len, n_new=48):
    positions = prompt_len - 1 + np.arange(n_new)
    total = lambda fit: np.sum(fit[0] + fit[1] * positions)    # noqa: E731
    return float(total(uncached) / total(cached))


def share_saved(cached, uncached, position):
    return 1.0 - (cached[0] + cached[1] * position) / (uncached[0] + uncached[1] * position)
