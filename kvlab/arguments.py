"""The arguments of kvlab's public Python functions, checked in one place and one wording.

Every integer argument is an int or a NumPy integer: a bool (True is not 1 request), a
float (2.5 blocks, or even 2.0) and a string are refused with a TypeError, and a value out
of its range with a ValueError, each naming the argument. Sizes too large for the C core's
types (a C int, an int64) get the same ValueError as any other size out of range, never an
OverflowError in C's words. Every float argument is an int, float or NumPy real, and NaN and
the infinities are refused wherever they make no sense.

The refusal of a wrong type is an ArgumentTypeError, which is both a TypeError and a
ValueError: `except ValueError` around a kvlab call keeps catching every bad argument.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

C_INT_MAX = 2**31 - 1              # the C core's sizes and counts (int)
INT64_MAX = 2**63 - 1              # its positions, lengths and byte counts (int64_t)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a TypeError, and a ValueError like every bad argument)."""


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(value, name: str, low: Optional[int] = None, high: Optional[int] = INT64_MAX) -> int:
    """value as a Python int, if it is an integer (not a bool, not a float) in [low, high]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer, got {shown(value)} "
                                f"({type(value).__name__})")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low:,}, got {value:,}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high:,}, got {value:,}")
    return value


def positive(value, name: str, high: Optional[int] = C_INT_MAX) -> int:
    """A count or size: an integer from 1 to `high` (a C int by default)."""
    return integer(value, name, 1, high)


def count(value, name: str, high: Optional[int] = C_INT_MAX) -> int:
    """A count that may be 0: an integer from 0 to `high`."""
    return integer(value, name, 0, high)


def real(value, name: str, low: Optional[float] = None, high: Optional[float] = None,
         above: Optional[float] = None, finite: bool = True) -> float:
    """value as a Python float, if it is a real number (not a bool): finite unless
    finite=False (NaN is refused always), at least `low`, at most `high`, more than `above`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise ArgumentTypeError(f"{name} must be a number, got {shown(value)} "
                                f"({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be more than {above}, got {value}")
    return value


def flag(value, name: str) -> bool:
    """A truth value: True or False (or a NumPy bool), not 0, 1 or a string."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {shown(value)}")
    return bool(value)
