"""kvlab objects a lab lends to the student's code, built inside the worker.

Some labs need a real model in the student's hands (the cache-size lab fills real caches
and measures the process's memory; the own-cache lab runs a model's layers around the
student's cache and attention). The judge asks the worker for one by name
({"op": "handout"}); the worker builds it here and passes the student a handle.

A handed-out object shows only what its lab allows, and where the lab asks for a
measurement it carries something the student's code cannot know in advance: the
cache-size lab's model gives every cache it makes an extra block of memory, of a size the
judge picks at grading time, that is taken when the cache is first filled. Resident memory
measured around real caches includes it; a formula, or a sum of cache.nbytes, does not.
"""
from __future__ import annotations

import functools
import mmap
import time
import types
from typing import Any, Optional

import numpy as np

PAGE = mmap.PAGESIZE


def config_fields(config) -> dict:
    """A model's shape as plain numbers (what the cache-size lab's functions receive)."""
    return {"dim": config.dim, "hidden_dim": config.hidden_dim, "n_layers": config.n_layers,
            "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "kv_dim": config.kv_dim,
            "vocab_size": config.vocab_size, "max_seq_len": config.max_seq_len,
            "n_params": config.n_params()}


class LabCache:
    """A cache the lab's model made: the real KV cache plus the extra block."""

    def __init__(self, cache, extra_bytes: int):
        self._cache = cache
        self._extra = mmap.mmap(-1, max(extra_bytes, PAGE)) if extra_bytes else None
        self._touched = False

    @property
    def length(self) -> int:
        return self._cache.length

    @property
    def capacity(self) -> int:
        return self._cache.capacity

    def _fill_extra(self) -> None:
        if self._extra is not None and not self._touched:
            np.frombuffer(self._extra, dtype=np.uint8)[::PAGE] = 1   # one write a page
            self._touched = True


class LabModel:
    """The bundled model, lent to a submission: config (plain numbers), new_cache, prefill,
    forward and encode. extra_bytes: the block each cache takes when first filled."""

    def __init__(self, extra_bytes: int = 0):
        if isinstance(extra_bytes, bool) or not isinstance(extra_bytes, int) or extra_bytes < 0:
            raise ValueError("extra_bytes must be a non-negative int")
        self._model = _bundled_model()
        self._extra_bytes = -(-extra_bytes // PAGE) * PAGE
        self.config = types.SimpleNamespace(**config_fields(self._model.config))
        _kvlab().release_freed_memory()         # the judge watches the memory from here on

    def new_cache(self, max_seq_len: int, dtype: str = "fp32") -> LabCache:
        return LabCache(self._model.new_cache(max_seq_len, dtype), self._extra_bytes)

    def prefill(self, tokens, cache: LabCache):
        if not isinstance(cache, LabCache):
            raise TypeError("prefill needs a cache made by this model's new_cache")
        logits = self._model.prefill(tokens, cache._cache)
        cache._fill_extra()
        return logits

    def forward(self, tokens, cache: Any = None):
        if cache is not None:
            return self.prefill(tokens, cache)
        return self._model.forward(tokens)

    def encode(self, text: str):
        return self._model.encode(text)


class ReferenceModel:
    """A model's weights behind the NumPy reference's building blocks: everything a forward
    pass needs except attention and the KV cache, which the student writes (the own-cache
    lab). shape: a model shape (ModelConfig's fields) for random weights drawn from `seed`;
    None for the bundled model. Arrays in and out are float32.

    It keeps a log the judge reads: for every embed and logits call, (name, rows,
    perf_counter at the call, at its return). A forward pass is one embed and one logits, so
    the log says how many tokens each step really ran through the model, and when: a cached
    decode step embeds one token, and a step's reported time must fit the window between
    them. (perf_counter is the system's monotonic clock: the same in every process.)"""

    def __init__(self, shape: Optional[dict] = None, seed: int = 0):
        kvlab = _kvlab()
        if shape is None:
            model = _bundled_model()
            self._c, self._w = model.config, model.weights
        else:
            self._c = kvlab.ModelConfig(**shape)
            self._w = kvlab.Weights.random(self._c, seed=seed)
        reference = kvlab.reference
        self._rmsnorm, self._rope, self._silu = reference.rmsnorm, reference.rope, reference.silu
        self._inv_freq = self._c.rope_inv_freq()
        self._log = []
        self.config = types.SimpleNamespace(**config_fields(self._c))

    def embed(self, tokens) -> np.ndarray:
        """(n, dim): the token embeddings."""
        started = time.perf_counter()
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.min() < 0 or tokens.max() >= self._c.vocab_size:
            raise ValueError(f"tokens must be a non-empty list of ids in [0, {self._c.vocab_size})")
        out = self._w.token_embedding[tokens].astype(np.float32)
        self._log.append(("embed", len(tokens), started, time.perf_counter()))
        return out

    def qkv(self, layer: int, x: np.ndarray, positions) -> tuple:
        """q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim) of the residual
        stream x (n, dim) at `positions` (n,): RMSNorm, the projections, RoPE on q and k."""
        c, w, n = self._c, self._w, len(x)
        positions = np.asarray(positions)
        h = self._rmsnorm(np.asarray(x, np.float32), w.attn_norm[layer], c.norm_eps)
        q = (h @ w.wq[layer].T).reshape(n, c.n_heads, c.head_dim)
        k = (h @ w.wk[layer].T).reshape(n, c.n_kv_heads, c.head_dim)
        v = (h @ w.wv[layer].T).reshape(n, c.n_kv_heads, c.head_dim)
        return (self._rope(q, positions, self._inv_freq, c.rope_interleaved),
                self._rope(k, positions, self._inv_freq, c.rope_interleaved), v)

    def attention_output(self, layer: int, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x + attention's output (n, n_heads, head_dim) projected back to (n, dim)."""
        out = np.asarray(out, np.float32)
        return np.asarray(x, np.float32) + out.reshape(len(out), -1) @ self._w.wo[layer].T

    def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        """x + the SwiGLU MLP of RMSNorm(x)."""
        w = self._w
        h = self._rmsnorm(np.asarray(x, np.float32), w.ffn_norm[layer], self._c.norm_eps)
        return x + (self._silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T

    def logits(self, x: np.ndarray) -> np.ndarray:
        """(n, vocab_size): the final RMSNorm and the classifier."""
        started = time.perf_counter()
        h = self._rmsnorm(np.asarray(x, np.float32), self._w.final_norm, self._c.norm_eps)
        out = h @ self._w.classifier.T
        self._log.append(("logits", len(out), started, time.perf_counter()))
        return out


@functools.lru_cache(maxsize=None)
def _bundled_model():
    return _kvlab().load()


@functools.lru_cache(maxsize=None)
def _kvlab() -> types.SimpleNamespace:
    """What the handouts use of kvlab, imported once. The worker preloads it while it may
    still read kvlab's files, then becomes the student's user (who may not) and takes kvlab
    out of sys.modules: from then on the handouts reach kvlab only through this."""
    import kvlab
    from kvlab import config, measure, reference, weights
    return types.SimpleNamespace(load=kvlab.load, ModelConfig=config.ModelConfig,
                                 Weights=weights.Weights, reference=reference,
                                 release_freed_memory=measure.release_freed_memory)


HANDOUTS = {"lab_model": LabModel, "reference_model": ReferenceModel}
PRELOADS = {"lab_model": _bundled_model, "reference_model": _bundled_model}


def preload(name: str) -> None:
    """Read now what handout `name` needs from kvlab's files (before the worker gives up
    the right to read them)."""
    if name not in PRELOADS:
        raise LookupError(f"no handout named {name!r}")
    PRELOADS[name]()


def make(name: str, **kwargs):
    if name not in HANDOUTS:
        raise LookupError(f"no handout named {name!r}")
    return HANDOUTS[name](**kwargs)
