"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Plain NumPy, shared by kvlab.generate and the batching engine. Greedy (temperature 0)
takes the arg-max, so it is deterministic; sampling draws from a numpy Generator the
caller owns, so a seed reproduces a run.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, rng: Optional[np.random.Generator] = None) -> int:
    """Next token id from a (vocab_size,) row of logits."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    rng = rng if rng is not None else np.random.default_rng()
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
    return int(rng.choice(probs.size, p=probs))
