"""time_limit(seconds): fail the test, rather than hang it, when a block runs too long (a
loop over a count a corrupt header chose, a FIFO opened for reading that waits for a
writer). pytest.fail raises a BaseException, so code under test that catches `Exception`
cannot turn the hang into a tidy error. Where there is no SIGALRM (Windows), no limit."""
import contextlib
import signal

import pytest


@contextlib.contextmanager
def time_limit(seconds: int):
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        pytest.fail(f"took more than {seconds} s: a hang?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
