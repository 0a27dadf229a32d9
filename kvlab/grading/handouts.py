"""kvlab objects a lab lends to the student's code, built inside the worker.

Some labs need a real model in the student's hands (the cache-size lab fills real caches
and measures the process's memory). The judge asks the worker for one by name
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
import types
from typing import Any

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
        import kvlab
        if isinstance(extra_bytes, bool) or not isinstance(extra_bytes, int) or extra_bytes < 0:
            raise ValueError("extra_bytes must be a non-negative int")
        self._model = _bundled_model()
        self._extra_bytes = -(-extra_bytes // PAGE) * PAGE
        self.config = types.SimpleNamespace(**config_fields(self._model.config))
        kvlab.measure.release_freed_memory()    # the judge watches the memory from here on

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


@functools.lru_cache(maxsize=None)
def _bundled_model():
    import kvlab
    return kvlab.load()


HANDOUTS = {"lab_model": LabModel}
PRELOADS = {"lab_model": _bundled_model}     # what a handout reads from kvlab's files


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
