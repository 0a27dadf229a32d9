"""What a lab's tests are written with: points, expected exceptions, array checks.

A test file (a lab's public checks in kvlab/labs/<lab>/checks.py, or its hidden grading
tests in instructor/graders/<lab>.py) is a module of functions

    @points(2)
    def test_attend_gqa(sub, rng):
        '''GQA: query head h reads KV head h // kv_mul'''
        got = sub.attend(q, keys, values)          # runs in the worker, returns an array
        check_close(got, want, "GQA, 8 heads on 2 KV heads")

run in order by the judge (kvlab/grading/judge.py) in its own process. `sub` is the
submission (kvlab/grading/remote.py); `rng` a NumPy generator seeded at grading time, so
the hidden cases differ from one grading to the next. A failed `assert` or check fails
the test with its message, which is all the student sees: say what was expected, what came
back and for which input. A test that returns a string passes with it as its output (shown
in the summary and in Gradescope's results): a measured test's margin. Tests run under the judge, never under pytest, so `assert` is
plain Python (the judge refuses to run with -O, which would strip it).
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any, Callable, Optional

import numpy as np

from . import wire
from .handouts import bundled_model, config_fields, mha_model  # noqa: F401  (for the tests)
from .remote import RemoteError, RemoteObject

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")


def points(n: float, visibility: str = "visible", timed: bool = False,
           slow: int = 1) -> Callable:
    """Mark a test and say what passing it is worth (visibility: Gradescope's names).
    timed: whether passing depends on how fast the code runs on the grading machine (the
    kernel lab's bandwidth tests), not only on what it computes. slow: the test may take
    that many times the judge's limit for one test (a test that runs a real model on a busy
    machine)."""
    if visibility not in VISIBILITIES:
        raise ValueError(f"visibility must be one of {VISIBILITIES}")
    if isinstance(slow, bool) or not isinstance(slow, int) or not 1 <= slow <= 4:
        raise ValueError("slow must be a whole number from 1 to 4")

    def mark(function: Callable) -> Callable:
        function.points = float(n)
        function.visibility = visibility
        function.timed = timed
        function.slow = slow
        return function
    return mark


@contextlib.contextmanager
def raises(type_name: str, what: str):
    """The block must make the student's code raise `type_name` (or a subclass of it)."""
    try:
        yield
    except RemoteError as error:
        if error.is_a(type_name):
            return
        if error.is_a("NotImplementedError"):
            raise                       # the judge says "not written yet"
        raise AssertionError(f"{what}: expected {type_name}, but your code raised "
                             f"{error.type_name}: {error.message}"
                             + (f"\n  at {error.where}" if error.where else "")) from None
    raise AssertionError(f"{what}: expected {type_name}, but nothing was raised")


def described(value: Any) -> str:
    """A short, address-free description of what came back."""
    if isinstance(value, RemoteObject):
        return repr(value)
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return f"{int(value):,}"                   # as the expected numbers are written
    if isinstance(value, (float, np.floating)) and np.isfinite(value):
        return f"{float(value):,.0f}" if float(value).is_integer() else f"{float(value):,.6g}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def as_array(got: Any, what: str, shape: Optional[tuple] = None, dtype: Any = None) -> np.ndarray:
    """got as an ndarray of the given shape (and dtype, when given), or a failed test."""
    if isinstance(got, RemoteObject) or got is None or isinstance(got, (str, bytes, dict, set)):
        raise AssertionError(f"{what}: expected an array, got {described(got)}")
    try:
        array = np.asarray(got)
    except (ValueError, TypeError):
        raise AssertionError(f"{what}: expected an array, got {described(got)}") from None
    if array.dtype == object:
        raise AssertionError(f"{what}: expected an array of numbers, got {described(got)}")
    if shape is not None and array.shape != tuple(shape):
        raise AssertionError(f"{what}: expected shape {tuple(shape)}, got {array.shape}")
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise AssertionError(f"{what}: expected dtype {np.dtype(dtype)}, got {array.dtype}")
    return array


def check_close(got: Any, want: np.ndarray, what: str, atol: float = 1e-5,
                rtol: float = 1e-5, hints: tuple = ()) -> None:
    """got must have want's shape, be finite and agree to atol + rtol * |want|.

    hints: (wrong, hint) pairs, each what a known mistake computes and what to say about
    it. A hint is shown only when got fails and agrees with its `wrong` (to the same
    tolerance): a hint about positions is never shown for a wrong scale."""
    want = np.asarray(want, dtype=np.float64)
    got = as_array(got, what, shape=want.shape)
    if not np.issubdtype(got.dtype, np.number):
        raise AssertionError(f"{what}: expected numbers, got dtype {got.dtype}")
    bad = ~np.isfinite(got)
    if np.any(bad):
        raise AssertionError(f"{what}: expected finite numbers, got {int(np.sum(bad))} NaN or "
                             f"infinite values")
    error = np.abs(got.astype(np.float64) - want)
    if np.all(error <= atol + rtol * np.abs(want)):
        return
    worst = np.unravel_index(np.argmax(error - rtol * np.abs(want)), error.shape)
    at = tuple(int(i) for i in worst)
    message = (f"{what}: off by up to {error.max():.3g} (at index {at}: expected "
               f"{want[worst]:.6g}, got {float(got[worst]):.6g})")
    for wrong, hint in hints:
        if matches(got, wrong, atol, rtol):
            message += f": {hint}"
            break
    raise AssertionError(message)


def matches(got: np.ndarray, wrong: Any, atol: float = 1e-5, rtol: float = 1e-5) -> bool:
    """Whether got agrees with `wrong` (what a known mistake computes) to the tolerance."""
    wrong = np.asarray(wrong, dtype=np.float64)
    if wrong.shape != got.shape:
        return False
    return bool(np.all(np.abs(got.astype(np.float64) - wrong) <= atol + rtol * np.abs(wrong)))


def check_tokens(got: Any, want: list, what: str, text: Optional[Callable] = None) -> None:
    """got must be the token ids `want`. A failure names the first token that differs, with
    a few of each from there (and their text, where `text` turns ids into it), not two
    whole lists of numbers."""
    if isinstance(got, np.ndarray) and got.ndim == 1 and got.dtype.kind in "iu":
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{what}: expected a list of {len(want)} token ids, got {described(got)}")
    got = [whole_number(t, f"{what}, item {i}") for i, t in enumerate(got)]
    want = [int(t) for t in want]
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

    def shown(ids):
        if not ids:
            return "nothing"
        words = f"{ids[:8]}" if len(ids) <= 8 else f"[{', '.join(map(str, ids[:8]))}, ...]"
        return words + (f" ({text(ids)!r})" if text is not None else "")
    before = ""
    if first:
        ids = want[max(0, first - 8):first]
        before = (f", after {'[..., ' + str(ids)[1:] if first > 8 else ids}"
                  + (f" ({text(ids)!r})" if text is not None else ""))
    size = "" if len(got) == len(want) else f" ({len(got)} tokens where {len(want)} are expected)"
    raise AssertionError(f"{what}: your tokens differ from token {first} on{size}: expected "
                         f"{shown(want[first:])}, got {shown(got[first:])}{before}")


def whole_number(got: Any, what: str) -> int:
    """got as a Python int when it is an integer (int or NumPy integer), else a failed test."""
    if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
        shown = f"the float {float(got)!r}" if isinstance(got, (float, np.floating)) else described(got)
        raise AssertionError(f"{what}: expected an int, got {shown}")
    return int(got)


def number(got: Any, what: str) -> float:
    """got as a float when it is a real number (int, float or NumPy number), else a failed test."""
    if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
        raise AssertionError(f"{what}: expected a number, got {described(got)}")
    return float(got)


def handout_file(sub, array: np.ndarray) -> str:
    """The path of a new .npy file holding `array`, in a folder of the judge's that the
    worker can read and not write: for data too large to send by value (the kernel lab's
    pool). The student's code reads it (numpy.load); remove it when it has."""
    folder = object.__getattribute__(sub, "_session").handouts
    if folder is None:
        raise RuntimeError("this submission runs without a judge's folder to hand files over")
    path = folder / f"{secrets.token_hex(8)}.npy"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    return str(path)


def config_record(config) -> wire.Record:
    """A kvlab.ModelConfig as the labs' functions receive it: plain numbers, by value."""
    return wire.Record("ModelConfig", config_fields(config))


def c_attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """What the C core computes for one token's q (n_heads, head_dim) over these keys and
    values (length, n_kv_heads, head_dim): cache.attend of a one-layer kvlab cache."""
    import kvlab
    length, n_kv_heads, head_dim = keys.shape
    cache = kvlab.KVCache(1, n_kv_heads, head_dim, length)
    cache.append(np.ascontiguousarray(keys[:, None]), np.ascontiguousarray(values[:, None]))
    return cache.attend(np.ascontiguousarray(q), 0)
