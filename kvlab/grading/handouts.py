"""kvlab objects a lab lends to the student's code, built inside the worker.

Some labs need a real model in the student's hands (the cache-size lab fills real caches
and measures the process's memory; the own-cache and GQA labs run a model's layers around
the student's cache and attention, and the GQA lab converts the model's key/value heads). The judge asks the worker for one by name
({"op": "handout"}); the worker builds it here and passes the student a handle.

A handed-out object shows only what its lab allows, and where the lab asks for a
measurement it carries something the student's code cannot know in advance: the
cache-size lab's model gives every cache it makes an extra block of memory, of a size the
judge picks at grading time, that is taken when the cache is first filled. Resident memory
measured around real caches includes it; a formula, or a sum of cache.nbytes, does not.
"""
from __future__ import annotations

import dataclasses
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


CHECKPOINTS = ("default", "mha", "default_as_mha")


class ReferenceModel:
    """A model's weights behind the NumPy reference's building blocks: everything a forward
    pass needs except attention and the KV cache, which the student writes (the own-cache
    and GQA labs). Arrays in and out are float32. The weights are:
      - shape (ModelConfig's fields) given: random weights of that shape drawn from `seed`;
      - else checkpoint "default": the bundled model (GQA, 8 query heads on 2 KV heads);
        "mha": the bundled MHA model (kvlab.MHA_MODEL, 8 KV heads, trained alike);
        "default_as_mha": the bundled model with each KV head repeated for its 4 query heads,
        an MHA model whose grouped heads are equal (mean-pooling it back loses nothing).

    The GQA lab converts a model: key_value_weights(layer) gives a layer's wk and wv, and
    with_key_value_weights(keys, values) a model with fewer KV heads, all else shared.

    It keeps a log the judge reads: for every embed and logits call, (name, rows,
    perf_counter at the call, at its return). A forward pass is one embed and one logits, so
    the log says how many tokens each step really ran through the model, and when: a cached
    decode step embeds one token, and a step's reported time must fit the window between
    them. (perf_counter is the system's monotonic clock: the same in every process.)"""

    def __init__(self, shape: Optional[dict] = None, seed: int = 0, checkpoint: str = "default"):
        kvlab = _kvlab()
        if shape is not None:
            config = kvlab.ModelConfig(**shape)
            weights = kvlab.Weights.random(config, seed=seed)
        elif checkpoint == "mha":
            model = _mha_model()
            config, weights = model.config, model.weights
        elif checkpoint in ("default", "default_as_mha"):
            model = _bundled_model()
            config, weights = model.config, model.weights
            if checkpoint == "default_as_mha":
                config, weights = _repeat_kv_heads(config, weights)
        else:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
        self._set_weights(config, weights)

    def _set_weights(self, config, weights) -> None:
        self._c, self._w = config, weights
        reference = _kvlab().reference
        self._rmsnorm, self._rope, self._silu = reference.rmsnorm, reference.rope, reference.silu
        self._inv_freq = self._c.rope_inv_freq()
        self._log = []
        self.config = types.SimpleNamespace(**config_fields(self._c))

    def key_value_weights(self, layer: int) -> tuple:
        """(wk, wv) of a layer, copies, each (n_kv_heads * head_dim, dim): rows
        h * head_dim .. (h + 1) * head_dim - 1 make KV head h."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < self._c.n_layers:
            raise ValueError(f"layer must be an int in [0, {self._c.n_layers}), got {layer!r}")
        return self._w.wk[layer].copy(), self._w.wv[layer].copy()

    def with_key_value_weights(self, keys, values) -> "ReferenceModel":
        """A model with these wk and wv (one (n_kv_heads * head_dim, dim) array per layer
        in each list) and this model's other weights: n_kv_heads follows from their rows."""
        c = self._c
        stacked = []
        for name, arrays in (("keys", keys), ("values", values)):
            if not isinstance(arrays, (list, tuple)) or len(arrays) != c.n_layers:
                raise ValueError(f"{name} must be a list of {c.n_layers} arrays, one per layer")
            arrays = [np.asarray(a) for a in arrays]
            rows = arrays[0].shape[0] if arrays[0].ndim == 2 else -1
            for layer, a in enumerate(arrays):
                if a.ndim != 2 or a.shape != (rows, c.dim) or a.dtype.kind != "f":
                    raise ValueError(f"{name}[{layer}] must be a float array of shape (n_kv_heads * "
                                     f"{c.head_dim}, {c.dim}) like every layer's; got {a.dtype} {a.shape}")
                if not np.isfinite(a).all():
                    raise ValueError(f"{name}[{layer}] holds inf or nan")
            if rows <= 0 or rows % c.head_dim or c.n_heads % (rows // c.head_dim):
                raise ValueError(f"{name} have {rows} rows: n_kv_heads * {c.head_dim} rows are needed, "
                                 f"with n_kv_heads dividing the {c.n_heads} query heads")
            stacked.append(np.stack(arrays).astype(np.float32))
        if stacked[0].shape != stacked[1].shape:
            raise ValueError(f"keys and values give different head counts: {stacked[0].shape[1]} "
                             f"and {stacked[1].shape[1]} rows")
        config = c.replace(n_kv_heads=stacked[0].shape[1] // c.head_dim)
        weights = dataclasses.replace(self._w, wk=stacked[0], wv=stacked[1])
        weights.check(config)
        converted = ReferenceModel.__new__(ReferenceModel)
        converted._set_weights(config, weights)
        return converted

    def encode(self, text: str) -> list:
        """The bundled models' tokens: the text's UTF-8 bytes."""
        if not isinstance(text, str):
            raise TypeError("encode takes a str")
        return list(text.encode("utf-8"))

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
def _mha_model():
    kvlab = _kvlab()
    return kvlab.load(kvlab.MHA_MODEL)


def _preload_reference_models():
    _bundled_model()
    _mha_model()


def _repeat_kv_heads(config, weights):
    """The same model as MHA: each KV head's rows of wk and wv repeated for every query
    head that reads it, so query head h has KV head h and the logits do not change."""
    def repeated(w):           # (n_layers, n_kv_heads * head_dim, dim) -> n_heads heads
        n_layers, _, dim = w.shape
        heads = w.reshape(n_layers, config.n_kv_heads, config.head_dim, dim)
        return np.repeat(heads, config.kv_mul, axis=1).reshape(n_layers, -1, dim)
    mha = config.replace(n_kv_heads=config.n_heads)
    return mha, dataclasses.replace(weights, wk=repeated(weights.wk), wv=repeated(weights.wv))


@functools.lru_cache(maxsize=None)
def _kvlab() -> types.SimpleNamespace:
    """What the handouts use of kvlab, imported once. The worker preloads it while it may
    still read kvlab's files, then becomes the student's user (who may not) and takes kvlab
    out of sys.modules: from then on the handouts reach kvlab only through this."""
    import kvlab
    from kvlab import config, measure, reference, weights
    return types.SimpleNamespace(load=kvlab.load, MHA_MODEL=kvlab.MHA_MODEL,
                                 ModelConfig=config.ModelConfig,
                                 Weights=weights.Weights, reference=reference,
                                 release_freed_memory=measure.release_freed_memory)


HANDOUTS = {"lab_model": LabModel, "reference_model": ReferenceModel}
PRELOADS = {"lab_model": _bundled_model, "reference_model": _preload_reference_models}


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
