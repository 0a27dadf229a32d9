"""The engine's block trace (Engine(..., trace=)): the pool's block events, tagged with the
step and the phase of the step they happened in, sent to a list or written to a file as
JSON lines, for a notebook to replay (tests/support/block_trace.py replays them).

The events are the pool's own (pool.record_events, pool.take_events; csrc/blocks.c):
  allocated  a free block (or an evicted cached one) starts holding a sequence's rows
  shared     one more sequence uses a block: a fork, a prefix-cache hit ("prefix_hit"),
             a block the pool found it had computed twice ("replaces": the duplicate,
             released or freed next), or a shared block taken back after its copy-on-write
             failed (a GPU store's error; "replaces": the copy, freed next)
  copied     copy-on-write: "from" a shared, partly filled block to a new one
  released   one sequence fewer uses a block that others still use ("refs" left)
  freed      no sequence uses a block any more ("to": the prefix cache, or the free list)
  evicted    a cached block dropped from the prefix cache to be reused.
"refs" is the block's reference count after the event; "seq" and "index" say which
sequence's block table and entry, where one does. The phases are the engine's: "admit"
(preemptions and admissions), "forward" (the forward call's new blocks and copies) and
"sample" (forks, rows of refused drafts cut off, finished sequences freed).

This file records and delivers; it decides nothing about a step.
"""
from __future__ import annotations

import collections
import json
import os
from typing import Deque, Union


class BlockTracer:
    """Records the pool's events while a step runs (what is done to the pool by hand
    between steps is not the engine's), and delivers them between steps, oldest first,
    each until the sink returns: a sink that raises loses nothing and gets again only the
    event it raised on."""

    def __init__(self, pool, trace: Union[list, str, os.PathLike]):
        self.pool = pool
        self.undelivered: Deque[dict] = collections.deque()   # events whose sink call
                                                              # raised, oldest first
        self.file = None
        if isinstance(trace, list):
            self.sink = trace.append
        else:
            self.file = open(trace, "w")
            self.sink = lambda event: self.file.write(json.dumps(event) + "\n")

    def start(self) -> None:
        self.pool.record_events = False     # anything recorded before is not this engine's
        self.pool.record_events = True

    def record(self, step: int, phase: str) -> None:
        """Moves the pool's new events, tagged, to the queue (an event leaves the pool's log
        once it is in the queue)."""
        self.undelivered.extend({"step": step, "phase": phase, **event}
                                for event in self.pool.take_events())

    def stop(self, step: int, phase: str) -> None:
        """Takes what the pool recorded since the last phase (nothing, unless the step
        raised in `phase`), then stops the recording."""
        try:
            self.record(step, phase)
        finally:
            self.pool.record_events = False

    def deliver(self) -> None:
        while self.undelivered:
            self.sink(self.undelivered[0])
            self.undelivered.popleft()

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
