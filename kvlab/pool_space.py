"""The engine's pool as the scheduler sees it: kvlab.scheduler.BlockSpace over a PagedPool.

Counts the scheduler plans with (available, needed, freed, sequences_left: questions that
change nothing), and the pool operations a plan asks for (start, release, swap_out), each
written so that calling it again after it was interrupted goes on from where the pool is.
Also the swap space (how many bytes the host copies of swapped-out sequences may hold), and
the checks that a pool given to the engine fits its model, on either device, and that a
request fits both.

It is bookkeeping between the scheduler's Sequences and the pool's handles, no more: what a
step does with them is kvlab.engine's, the pool itself is kvlab.PagedPool (kvlab.paged; a
GPU pool is the same class with its rows in GPU memory, kvlab.cuda).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Tuple

import numpy as np

from . import arguments
from .model import Model
from .paged import PoolViews
from .blocks import blocks_for
from .errors import ContextLengthError
from .scheduler import Request, SamplingParams, Sequence, requests_fit


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

    def needed(self, seq: Sequence, n_tokens: int) -> int:
        if seq.handle is None:
            return blocks_for(seq.computed + n_tokens, self.pool.block_size)
        if n_tokens == 0:
            return 0
        if seq.handle.length > seq.computed:   # rows a step that raised wrote: to be cut back
            # (then its last block may be partly filled and shared: one copy on write)
            size = self.pool.block_size
            return blocks_for(seq.computed + n_tokens, size) - blocks_for(seq.computed, size) + 1
        return self.pool.blocks_needed(seq.handle, n_tokens)

    def freed(self, request: Request) -> int:
        held = collections.Counter()      # block -> how many of the request's tables hold it
        for seq in request.sequences:
            if seq.handle is not None:
                held.update(np.asarray(seq.handle.block_table).tolist())
        refs = self.pool.ref_counts
        return sum(1 for block, n in held.items() if refs[block] == n)   # no one else's

    # ---- operations ------------------------------------------------------------------------
    def start(self, request: Request) -> int:
        hits = 0
        # Swapped sequences first: the scheduler counted their blocks before the prefix cache
        # was searched, and a cached block that a prefix hit takes is gone for them.
        for seq in request.active():
            if seq.swapped is not None and seq.handle is None:
                self.make(seq, self.pool.swap_in, seq.swapped)
            if seq.swapped is not None and id(seq.swapped) not in self.counted:
                self.counted.add(id(seq.swapped))
                self.traffic.in_blocks += seq.swapped.n_blocks
                self.traffic.in_bytes += seq.swapped.nbytes
        for seq in request.active():
            if seq.swapped is None:
                hits += self.renew(seq)
            else:
                seq.computed = seq.handle.length
        return hits

    def renew(self, seq: Sequence) -> int:
        """Give the sequence a new pool sequence if it has none, holding what the prefix
        cache has of its tokens but the last (whose logits choose the next), and count
        those as computed; returns the rows it holds. Also for a running sequence whose
        handle a step that then raised had freed: it is computed again, from the cache."""
        if seq.handle is None:
            seq.computed = 0                    # (its rows are gone, whatever it counted)
            self.make(seq, self.pool.new_sequence)
        if seq.handle.length == 0 and len(seq.tokens) > 1:
            self.pool.reuse_prefix(seq.handle, np.asarray(seq.tokens[:-1], np.int32))
        # at least the last token is fed (a handle left by a step that raised may hold them
        # all: the forward call cuts it back by one)
        seq.computed = min(seq.handle.length, len(seq.tokens) - 1)
        return seq.handle.length

    def release(self, request: Request) -> None:
        for seq in request.sequences:
            self.drop(seq)

    def drop(self, seq: Sequence) -> None:
        """Free one sequence's pool handle, if it has one (a freed handle is not freed twice).
        A handle the pool freed is forgotten even if the call then raised (an allocator
        plug-in's free, after the pool's): a dead one left on the sequence would stop every
        later plan that counts its blocks."""
        handle = seq.handle
        if handle is not None:
            try:
                if handle.alive:
                    self.pool.free(handle)
            finally:
                if not handle.alive:
                    seq.handle = None

    def swap_out(self, request: Request) -> None:
        """Preemption by swapping: each active sequence's K and V to host memory
        (seq.swapped), its sequence freed. A sequence is swapped only if its rows are
        exactly its computed tokens and one token is still to feed; one whose copy would
        pass swap_space or finds no host memory is left to be recomputed (the pool is
        unchanged then)."""
        for seq in request.active():
            handle = seq.handle
            if handle is None or not handle.alive or not 0 < seq.computed == handle.length < len(seq.tokens):
                continue
            if (self.swap_space is not None and
                    self.swapped_bytes() + self.pool.swap_nbytes(handle) > self.swap_space):
                continue
            try:
                host = self.pool.swap_out(handle)
            except MemoryError:
                continue
            except BaseException:
                if not handle.alive:        # freed, and its copy lost with the call that
                    seq.handle = None       # raised after: it is recomputed instead
                raise
            seq.swapped, seq.handle = host, None
            self.traffic.out_blocks += host.n_blocks
            self.traffic.out_bytes += host.nbytes

    def make(self, seq: Sequence, make: Callable, *args) -> None:
        """seq.handle = make(*args), noted so that recover() can finish it (class text)."""
        self.making = (seq, {(s.id, s.serial) for s in self.pool.sequences()})
        seq.handle = make(*args)
        self.making = None

    def recover(self) -> None:
        """After a call raised: a sequence the pool made for `making` is that sequence's."""
        if self.making is not None:
            seq, before = self.making
            made = [s for s in self.pool.sequences() if (s.id, s.serial) not in before]
            if made and seq.handle is None:
                seq.handle = made[0]
            self.making = None


def pool_for(model: Model, pool, num_blocks, block_size, dtype, prefix_cache: bool = True):
    """The pool given, checked, or one made with num_blocks, block_size and dtype (and
    no prefix cache where prefix_cache is False)."""
    if pool is None:
        if num_blocks is None:
            raise TypeError("Engine needs a pool, or num_blocks (with block_size and "
                            "dtype if not 16 and fp32) to make one")
        pool = model.new_paged_pool(num_blocks, 16 if block_size is None else block_size,
                                    "fp32" if dtype is None else dtype,
                                    prefix_cache=prefix_cache)
    elif (num_blocks, block_size, dtype) != (None, None, None):
        raise TypeError("the pool given fixes num_blocks, block_size and dtype: pass "
                        "either a pool or those, not both")
    check_pool_fits(model, pool)
    return pool


def check_request_fits(model: Model, pool, prompt_len: int, params: SamplingParams) -> None:
    """Refuse a request that could never run on this model and pool, even alone."""
    context = model.config.max_seq_len
    if prompt_len + params.max_new_tokens > context:
        raise ContextLengthError(f"request rejected: prompt ({prompt_len} tokens) + "
                                 f"max_new_tokens ({params.max_new_tokens}) exceeds the "
                                 f"model's context of {context} tokens")
    window = model.config.sliding_window
    if window is not None and prompt_len + params.max_new_tokens - 1 > window:
        raise ContextLengthError(f"request rejected: this model attends to its last {window} "
                                 f"positions (config.sliding_window) and the Engine keeps "
                                 f"every row of a sequence: prompt ({prompt_len} tokens) + "
                                 f"max_new_tokens ({params.max_new_tokens}) would pass it; "
                                 f"kvlab.generate runs such a model with a SlidingWindow cache")
    why = requests_fit(prompt_len, params, pool.block_size, pool.num_blocks,
                       pool.max_blocks_per_seq)
    if why is not None:
        raise ValueError(f"request rejected: {why}")
    if params.n > pool.max_seqs:
        raise ValueError(f"request rejected: n={params.n} samples need as many sequences; "
                         f"the pool allows max_seqs={pool.max_seqs}")


def check_swap(pool, preemption: str, swap_space: Optional[int]) -> Optional[int]:
    if preemption == "swap" and not callable(getattr(pool, "swap_out", None)):
        raise ValueError(f"preemption='swap' copies K and V to host memory with "
                         f"pool.swap_out, which {type(pool).__name__} does not have: use "
                         f"preemption='recompute'")
    if swap_space is None:
        return None
    if preemption != "swap":
        raise ValueError("swap_space caps the host copies of preemption='swap'; "
                         f"this engine preempts by {preemption}")
    return arguments.positive(swap_space, "swap_space", high=arguments.INT64_MAX)


def check_pool_fits(model: Model, pool) -> None:
    """Refuse a pool this model cannot run on (every step would raise)."""
    if not isinstance(pool, PoolViews):
        raise TypeError(f"pool must be a kvlab.PagedPool (model.new_paged_pool(...)), got "
                        f"{type(pool).__name__}")
    if pool.device != model.device:
        raise ValueError(f"this pool keeps its K and V on {pool.device!r} but the model runs on "
                         f"{model.device!r}: make the pool with model.new_paged_pool")
    shape = (pool.n_layers, pool.n_kv_heads, pool.head_dim)
    c = model.config
    if shape != (c.n_layers, c.n_kv_heads, c.head_dim):
        raise ValueError(f"this pool holds {shape[0]} layers x {shape[1]} KV heads x {shape[2]}, "
                         f"but the model needs {c.n_layers} x {c.n_kv_heads} x {c.head_dim}: "
                         f"make the pool with model.new_paged_pool")
