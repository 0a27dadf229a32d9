"""The engine's pool as the scheduler sees it: kvlab.scheduler.BlockSpace over a PagedPool.

Counts the scheduler plans with (available, needed, freed, sequences_left: questions that
change nothing), and the pool operations a plan asks for (start, release, swap_out), each
written so that calling it again after it was interrupted goes on from where the pool is.
Also the swap space: how many bytes the host copies of swapped-out sequences may hold.

It is bookkeeping between the scheduler's Sequences and the pool's handles, no more: what a
step does with them is kvlab.engine's, the pool itself is kvlab.paged's (the CPU pool) or
kvlab.cuda's (the GPU pool, which has no swap_out: the engine refuses preemption="swap" on
it).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import numpy as np

from .scheduler import Request, Sequence, blocks_for


@dataclasses.dataclass
class SwapTraffic:
    """What preemption by swapping moved in one step (StepResult's swapped_* fields)."""
    out_blocks: int = 0
    out_bytes: int = 0
    in_blocks: int = 0
    in_bytes: int = 0


class PoolSpace:
    """BlockSpace over a pool (see the module text). A pool operation that makes a sequence
    (new_sequence, fork, swap_in) is noted first (`making`): if it raises after the pool
    made the sequence (its handle lost on the way), recover() finds it in the pool and
    gives it to the Sequence it was for, so that nothing is made twice or left behind."""

    def __init__(self, pool, swap_space: Optional[int] = None,
                 swapped_bytes: Callable[[], int] = lambda: 0):
        self.pool = pool
        self.swap_space = swap_space         # the most bytes host copies may hold, or None
        self.swapped_bytes = swapped_bytes   # what they hold now
        self.traffic = SwapTraffic()         # this step's (new_step() resets it)
        self.counted: set = set()            # host copies swapped in this step (counted once)
        self.making: Optional[Tuple[Sequence, set]] = None   # (for whom, names before)

    def new_step(self) -> None:
        self.traffic, self.counted = SwapTraffic(), set()

    # ---- questions -------------------------------------------------------------------------
    def available(self) -> int:
        return self.pool.available_blocks

    def sequences_left(self) -> int:
        return self.pool.max_seqs - self.pool.live_sequences

    def needed(self, sample: Sequence, n_tokens: int) -> int:
        if sample.seq is None:
            return blocks_for(sample.computed + n_tokens, self.pool.block_size)
        return self.pool.blocks_needed(sample.seq, n_tokens)

    def freed(self, request: Request) -> int:
        tables = [s.seq.block_table for s in request.samples if s.seq is not None]
        if not tables:
            return 0
        blocks, refs = np.unique(np.concatenate(tables), return_counts=True)
        return int(np.count_nonzero(self.pool.ref_counts[blocks] == refs))

    # ---- operations ------------------------------------------------------------------------
    def start(self, request: Request) -> int:
        hits = 0
        # Swapped samples first: the scheduler counted their blocks before the prefix cache
        # was searched, and a cached block that a prefix hit takes is gone for them.
        for sample in request.active():
            if sample.swapped is not None and sample.seq is None:
                self.make(sample, self.pool.swap_in, sample.swapped)
            if sample.swapped is not None and id(sample.swapped) not in self.counted:
                self.counted.add(id(sample.swapped))
                self.traffic.in_blocks += sample.swapped.n_blocks
                self.traffic.in_bytes += sample.swapped.nbytes
        for sample in request.active():
            if sample.swapped is None:
                if sample.seq is None:
                    self.make(sample, self.pool.new_sequence)
                # at least the last token is fed: its logits choose the next token
                if sample.seq.length == 0 and len(sample.tokens) > 1:
                    self.pool.reuse_prefix(sample.seq, np.asarray(sample.tokens[:-1], np.int32))
                hits += sample.seq.length
            sample.computed = sample.seq.length
        return hits

    def release(self, request: Request) -> None:
        for sample in request.samples:
            self.drop(sample)

    def drop(self, sample: Sequence) -> None:
        """Free one sample's pool sequence, if it has one (a freed handle is not freed twice)."""
        if sample.seq is not None:
            if sample.seq.alive:
                self.pool.free(sample.seq)
            sample.seq = None

    def swap_out(self, request: Request) -> None:
        """Preemption by swapping: each active sample's K and V to host memory
        (sample.swapped), its sequence freed. A sample is swapped only if its rows are
        exactly its computed tokens and one token is still to feed; one whose copy would
        pass swap_space or finds no host memory is left to be recomputed (the pool is
        unchanged then)."""
        for sample in request.active():
            seq = sample.seq
            if seq is None or not seq.alive or not 0 < sample.computed == seq.length < len(sample.tokens):
                continue
            if (self.swap_space is not None and
                    self.swapped_bytes() + self.pool.swap_nbytes(seq) > self.swap_space):
                continue
            try:
                host = self.pool.swap_out(seq)
            except MemoryError:
                continue
            sample.swapped, sample.seq = host, None
            self.traffic.out_blocks += host.n_blocks
            self.traffic.out_bytes += host.nbytes

    def make(self, sample: Sequence, make: Callable, *args) -> None:
        """sample.seq = make(*args), noted so that recover() can finish it (class text)."""
        self.making = (sample, {(s.id, s.serial) for s in self.pool.sequences()})
        sample.seq = make(*args)
        self.making = None

    def recover(self) -> None:
        """After a call raised: a sequence the pool made for `making` is that sample's."""
        if self.making is not None:
            sample, before = self.making
            made = [s for s in self.pool.sequences() if (s.id, s.serial) not in before]
            if made and sample.seq is None:
                sample.seq = made[0]
            self.making = None
