"""Holding Ctrl-C: a SIGINT that arrives inside a `with HeldCtrlC():` block is kept until
the block ends, then given to the handler that was installed (Python's own raises
KeyboardInterrupt there). kvlab.Engine holds it over each step, so that a step is never cut
in the middle of its bookkeeping: it stops only where it chooses to look (take(), between
the forward calls of a long step) or at the block's end.

Only the main thread receives signals in Python, so elsewhere (and where the handler is not
a Python function: SIG_IGN, SIG_DFL) the block holds nothing. The C core's long calls check
for signals between chunks; held, they find none to raise and run to their end. Inside
raising(error), a SIGINT raises `error` at once instead: a long C call that runs Python's
handlers between its layers stops there (the engine's forward calls, which change nothing
when stopped so).
"""
from __future__ import annotations

import contextlib
import signal
import threading

import _signal          # signal's own functions, without its enum conversions (17 us a step)


class HeldCtrlC:
    """Holds a SIGINT that arrives inside the with block until the block's end, then
    gives it to the handler there was (Python's raises KeyboardInterrupt). Only
    in the main thread, where Python runs signal handlers, and over a Python handler."""

    def __enter__(self) -> "HeldCtrlC":
        self.pending, self.handler, self.raise_as = False, None, None
        if threading.current_thread() is threading.main_thread():
            handler = _signal.getsignal(signal.SIGINT)
            if callable(handler):
                self.handler = handler
                _signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self.raise_as is not None:     # once: a second SIGINT is held, as outside
            error, self.raise_as = self.raise_as, None
            raise error()
        self.pending = True

    @contextlib.contextmanager
    def raising(self, error: type):
        """Inside, a SIGINT that arrives raises error() at once rather than wait (one held
        already stays held): wherever Python runs its handlers, between bytecodes or from
        inside a C call that looks for signals. For code that may stop anywhere."""
        self.raise_as = error
        try:
            yield
        finally:
            self.raise_as = None

    def take(self) -> bool:
        """Whether a SIGINT is held, taken: the block's end no longer gives it (the caller
        stops at a point of its own choosing and raises KeyboardInterrupt itself)."""
        pending, self.pending = self.pending, False
        return pending

    def __exit__(self, *exc_info) -> None:
        if self.handler is not None:
            _signal.signal(signal.SIGINT, self.handler)
            if self.pending:
                self.handler(signal.SIGINT, None)
