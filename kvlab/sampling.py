"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Shared by kvlab.generate and the batching engine. Greedy (temperature 0) takes the
arg-max, so it is deterministic; sampling takes its random number from a numpy Generator
the caller owns, so a seed reproduces a run. The arithmetic is the C core's (the
generation loop in C makes the same choice); kvlab.reference.sample is the same in NumPy.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import arguments


# The smallest temperature above 0 accepted: the smallest normal float32. Logits are
# float32, so dividing them by anything at least this large stays finite in the sampler's
# double arithmetic; a smaller (denormal) temperature overflows them to infinity.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """temperature a finite number >= 0 (0: greedy; else at least MIN_TEMPERATURE), top_k
    None or an integer from 1 to a C int, top_p None or a number in (0, 1]: a bool, a
    string, NaN or an infinity is refused (kvlab.arguments), naming the argument."""
    temperature = arguments.real(temperature, "temperature", low=0.0)
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g} "
                         f"(smaller ones overflow the logits), got {temperature!r}")
    if top_k is not None:
        arguments.positive(top_k, "top_k")
    if top_p is not None:
        arguments.real(top_p, "top_p", above=0.0, high=1.0)


def check_seed(seed, name: str = "seed") -> Optional[int]:
    """A seed for np.random.default_rng: None or an integer >= 0 (not a bool, not 2.0)."""
    return None if seed is None else arguments.integer(seed, name, 0, None)


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, rng: Optional[np.random.Generator] = None) -> int:
    """Next token id from a (vocab_size,) row of logits (taken as float32, as the model
    computes them; float64 is rounded to float32 first).

    The choice is made by the C core (csrc/sampling.c), the same function the generation
    loop in C calls between tokens, so a token drawn here and one drawn there agree. Its
    NumPy twin, to read, is kvlab.reference.sample. Sampling takes one number from rng
    (rng.random()), the point where the cumulative probability is cut."""
    check_sampling_args(temperature, top_k, top_p)
    if rng is not None and not callable(getattr(rng, "random", None)):
        raise arguments.ArgumentTypeError(f"rng must be a numpy.random.Generator (or have its random()) or None, "
                                          f"got {type(rng).__name__}")
    if temperature == 0.0:
        logits = np.asarray(logits)
        token = int(logits.argmax())    # the first NaN's index, if there is one: then
        if logits[token] != logits[token]:  # every step would pick it again
            raise ValueError("the logits hold NaN: no token can be chosen")
        return token
    rng = rng if rng is not None else np.random.default_rng()
    return _core().sample(logits, temperature, top_k or 0, 1.0 if top_p is None else top_p,
                          rng.random())


def _core():
    """The compiled core, imported at the first sampled token: the scheduler uses this
    module's argument checks and runs (and is tested) without it."""
    global _CORE
    if _CORE is None:
        from ._core import core
        _CORE = core
    return _CORE


_CORE = None
