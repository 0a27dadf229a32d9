"""Matplotlib figures for timing and memory runs (imported only when a plot is asked for).

These draw what kvlab.generate and kvlab.measure computed; they compute nothing new.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .generate import Generation
from .measure import kv_cache_bytes, scratch_bytes


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg") if matplotlib.get_backend().lower() == "agg" else None
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install matplotlib") from error
    return plt


def cached_vs_uncached(model, cached: Generation, uncached: Generation, n_threads: int = 1,
                       path: Optional[str] = None):
    """Left: seconds per step against position. Right: bytes held against sequence
    length: the KV cache grows by a fixed amount per token, while the no-cache path's
    scratch (activations plus the K and V it rebuilds) grows with the whole sequence."""
    plt = _pyplot()
    config = model.config
    prompt = len(cached.prompt_tokens)
    positions = prompt + np.arange(len(cached.tokens))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.plot(positions, 1e3 * uncached.step_seconds[:len(positions)], label="without a cache")
    left.plot(positions, 1e3 * cached.step_seconds, label="with the KV cache")
    left.set_xlabel("position of the generated token")
    left.set_ylabel("ms per step")
    left.set_title("latency per step")
    left.legend()

    lengths = prompt + np.arange(len(cached.tokens))
    cache_bytes = [kv_cache_bytes(config, int(n), dtype="fp32") for n in lengths]
    cached_scratch = [scratch_bytes(config, 1, n_threads)] * len(lengths)   # the same at any length
    uncached_scratch = [scratch_bytes(config, int(n), n_threads, cached=False) for n in lengths]
    right.plot(lengths, np.array(uncached_scratch) / 1024, label="no cache: scratch of one step")
    right.plot(lengths, np.array(cache_bytes) / 1024, label="KV cache contents")
    right.plot(lengths, np.array(cached_scratch) / 1024, label="with cache: scratch of one step")
    right.set_xlabel("sequence length (tokens)")
    right.set_ylabel("KiB")
    right.set_title("memory against length")
    right.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
