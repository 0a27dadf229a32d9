"""Old names that still work for one release, each with a warning naming its replacement.

Issue 19 gave every concept one word in the API (max_new_tokens for the length limit,
dtype for the cache format, forward(tokens, cache) as the one entry ...), and issue 36
spelled a cache's parts as formats too (key_format, not key_dtype). Code written against
the old names keeps running, and says where it needs changing: the warning points at the
caller's line (stacklevel), not at kvlab's.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, TypeVar

T = TypeVar("T")

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is now spelled `new` (stacklevel 3: the caller of the function that
    calls this)."""
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A class attribute `old` that reads and writes `new`, warning as renamed() does:
    `samples = renamed_attribute("Request", "samples", "sequences")` in the class body."""
    def get(self):
        renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    def set(self, value) -> None:
        renamed(f"{owner}.{old}", f"{owner}.{new}")
        setattr(self, new, value)
    return property(get, set, doc=f"Deprecated: {owner}.{new}.")


def default_changed(what: str, old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that an argument left out now means `new` (it meant `old`); FutureWarning,
    which Python shows by default, because the numbers change, not only the spelling."""
    warnings.warn(f"{what} now defaults to {new} (it was {old}); pass it explicitly to "
                  f"choose, and this warning goes away", FutureWarning, stacklevel=stacklevel)


def renamed_argument(what: str, old: str, old_value: Optional[T], new: str,
                     new_value: Optional[T]) -> Optional[T]:
    """The value of the argument now called `new`, given under either name (None: not
    given): warns when the old name was used, and refuses both (TypeError), since the two
    could disagree. `what` says where the argument belongs ("the cache-format argument"),
    as it may pass through several functions (model.new_cache -> cache_format); the warning
    points at the first line outside kvlab, however many of them it passed through."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"give {new} only ({old} is its old name)")
    renamed(f"{what} {old}=...", f"{new}=...", stacklevel=_outside_kvlab())
    return old_value


def format_arguments(key_format: Optional[str], value_format: Optional[str],
                     key_dtype: Optional[str], value_dtype: Optional[str]):
    """(key_format, value_format), each given under its name or its old one (key_dtype,
    value_dtype), wherever a cache format is described: model.cache_format (so new_cache,
    new_paged_pool and generate) and kvlab.measure."""
    return (renamed_argument("the cache-format argument", "key_dtype", key_dtype,
                             "key_format", key_format),
            renamed_argument("the cache-format argument", "value_dtype", value_dtype,
                             "value_format", value_format))


def _outside_kvlab() -> int:
    """The stacklevel, for a warning issued by renamed() called from the caller of this
    function, of the nearest frame whose file is not in the kvlab package (Python 3.12's
    warn(skip_file_prefixes=) does this; kvlab supports older Pythons)."""
    frame, level = sys._getframe(1), 2          # the caller's frame; renamed's is level 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
