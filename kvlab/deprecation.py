"""Old names that still work for one release, each with a warning naming its replacement.

Issue 19 gave every concept one word in the API (max_new_tokens for the length limit,
dtype for the cache format, forward(tokens, cache) as the one entry ...). Code written
against the old names keeps running, and says where it needs changing: the warning points
at the caller's line (stacklevel), not at kvlab's.
"""
from __future__ import annotations

import warnings


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is now spelled `new` (stacklevel 3: the caller of the function that
    calls this)."""
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def default_changed(what: str, old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that an argument left out now means `new` (it meant `old`); FutureWarning,
    which Python shows by default, because the numbers change, not only the spelling."""
    warnings.warn(f"{what} now defaults to {new} (it was {old}); pass it explicitly to "
                  f"choose, and this warning goes away", FutureWarning, stacklevel=stacklevel)
