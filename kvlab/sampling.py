"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Shared by kvlab.generate and the batching engine. Greedy (temperature 0) takes the
arg-max, so it is deterministic; sampling takes its random number from a numpy Generator
the caller owns, so a seed reproduces a run. The arithmetic is the C core's (the
generation loop in C makes the same choice); kvlab.reference.sample is the same in NumPy.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


# The smallest temperature above 0 accepted: the smallest normal float32. Logits are
# float32, so dividing them by anything at least this large stays finite in the sampler's
# double arithmetic; a smaller (denormal) temperature overflows them to infinity.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g} "
                         f"(smaller ones overflow the logits), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, rng: Optional[np.random.Generator] = None) -> int:
    """Next token id from a (vocab_size,) row of logits (taken as float32, as the model
    computes them; float64 is rounded to float32 first).

    The choice is made by the C core (csrc/sampling.c), the same function the generation
    loop in C calls between tokens, so a token drawn here and one drawn there agree. Its
    NumPy twin, to read, is kvlab.reference.sample. Sampling takes one number from rng
    (rng.random()), the point where the cumulative probability is cut."""
    if temperature == 0.0:
        logits = np.asarray(logits)
        if np.isnan(logits).any():      # argmax would pick the NaN, again and again
            raise ValueError("the logits hold NaN, so no token can be chosen (greedy)")
        return int(np.argmax(logits))
    # imported here: the scheduler uses this module's argument checks and runs (and is
    # tested) without the compiled core
    from ._core import core
    rng = rng if rng is not None else np.random.default_rng()
    return core.sample(logits, temperature, top_k or 0, 1.0 if top_p is None else top_p,
                       rng.random())
