"""Interrupting one kvlab.Engine step anywhere (tests/test_engine_interrupts.py's ways, also
used by tests/test_engine_long_steps.py): an Interrupter counts the calls a step makes into
its collaborators (or the lines of kvlab it runs) and sends SIGINT or raises
KeyboardInterrupt at the chosen ones; interrupted_step runs one step so wrapped."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import kvlab
import kvlab.engine

POOL_METHODS = ("new_sequence", "fork", "free", "reuse_prefix", "truncate", "swap_out",
                "swap_in")
SPACE_METHODS = ("start", "release", "swap_out")
ENGINE_FUNCTIONS = ("sample_token", "verify_drafts")
HOW = ("sigint before", "sigint after", "raise before", "raise after", "sigint at line")
KVLAB = str(Path(kvlab.__file__).parent)


class Interrupter:
    """Counts the calls made through wrapped functions and interrupts at the chosen ones."""

    def __init__(self, at, how):
        self.at, self.how, self.calls, self.fired = set(at), how, 0, []

    def wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            due = self.calls in self.at
            if due and self.how == "sigint at line":
                due = False                       # (trace() counts lines instead)
            if due and self.how == "raise after" and name == "pool.swap_out":
                due = False                       # (see the module text)
            if due:
                self.fired.append((self.calls, name))
            if due and self.how == "sigint before":
                os.kill(os.getpid(), signal.SIGINT)
            if due and self.how == "raise before":
                raise KeyboardInterrupt(f"before call {self.calls} ({name})")
            result = fn(*args, **kwargs)
            if due and self.how == "sigint after":
                os.kill(os.getpid(), signal.SIGINT)
            if due and self.how == "raise after":
                raise KeyboardInterrupt(f"after call {self.calls} ({name})")
            return result
        return wrapper

    def trace(self, frame, event, arg):
        """sys.settrace's function: a SIGINT at the chosen lines of kvlab's own code."""
        if not frame.f_code.co_filename.startswith(KVLAB):
            return None
        if event == "line":
            self.lines = getattr(self, "lines", 0) + 1
            if self.lines in self.at:
                self.fired.append((self.lines, f"{frame.f_code.co_name}:{frame.f_lineno}"))
                os.kill(os.getpid(), signal.SIGINT)
        return self.trace


def interrupted_step(engine, interrupter) -> None:
    """One engine.step() with every collaborator wrapped; a KeyboardInterrupt is taken."""
    owners = [(engine.model, ["forward_batch"]), (engine.pool, POOL_METHODS),
              (engine.speculate, ["propose"])]
    space = getattr(engine, "space", None)
    if space is not None:
        owners.append((space, [m for m in SPACE_METHODS if hasattr(space, m)]))
    patched = []
    for owner, names in owners:
        for name in names:
            label = f"{'pool.' if owner is engine.pool else ''}{name}"
            setattr(owner, name, interrupter.wrap(label, getattr(owner, name)))
            patched.append((owner, name))
    saved = {name: getattr(kvlab.engine, name) for name in ENGINE_FUNCTIONS}
    for name, fn in saved.items():
        setattr(kvlab.engine, name, interrupter.wrap(name, fn))
    tracer = sys.gettrace()
    if interrupter.how == "sigint at line":
        sys.settrace(interrupter.trace)
    try:
        try:
            engine.step()
            time.sleep(0)           # a SIGINT still pending lands here, not in the test
        except KeyboardInterrupt:
            pass
        time.sleep(0)
    except KeyboardInterrupt:       # one that landed after the first except (rare)
        pass
    finally:
        sys.settrace(tracer)
        for name, fn in saved.items():
            setattr(kvlab.engine, name, fn)
        for owner, name in patched:
            del owner.__dict__[name]
