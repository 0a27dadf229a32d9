"""kvlab.Engine: continuous batching on the paged KV cache.

"Every active conversation carries its own cache." The engine serves many requests at
once from one paged pool: each step, the scheduler (kvlab.scheduler) picks which
sequences run and with how many tokens, and the engine runs them all in ONE batched
forward call (Model.forward_batch: every weight matrix streamed once per 48 tokens),
then samples each sequence's next token. Requests join and leave between steps:
continuous batching.

    engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=256, block_size=16))
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_new_tokens=40))
    while engine.has_work:
        print(engine.step())              # what happened: batch, tokens, blocks, preemptions
    engine.outputs                        # every request's generated tokens and text

Greedy outputs are identical, token for token, to kvlab.generate on each prompt alone,
whatever else is in the batch, however often a request was preempted, and however often
a step was interrupted (KeyboardInterrupt, an error) before run() was called again: the
core's results for a sequence do not depend on the batch around it (fp32 and every cache
format), and a step commits its bookkeeping as soon as the pool has changed (see Engine).
A request whose next token cannot be chosen fails alone, with finish_reason "error: ...".
This file is bookkeeping; no tensor is touched here.

Preemption (Engine(..., preemption=)): when the pool runs out of blocks, the most recently
admitted request gives its blocks back. "recompute" (the default) drops its K and V: when
it is admitted again, its prompt and the tokens it generated are run through the model
again (less what the prefix cache still holds). "swap" copies its K and V to host memory
first (pool.swap_out) and, on admission, into fresh blocks (pool.swap_in): bytes moved
instead of a prefill. The tokens are the same either way; each StepResult counts what a
step recomputed (recomputed_tokens) and swapped (swapped_out_blocks ... swapped_in_bytes).

Speculative decoding (Engine(..., speculate=PromptLookup(), draft_tokens=4)): before each
step, every sample about to decode asks the drafter for up to draft_tokens guesses of its
next tokens; the scheduler lets them ride on the sample's chunk (its newest token) in what
certain work leaves of the token budget and the free blocks; the one forward call returns
every token's logits; each sample keeps its drafts up to the first the model refuses, plus
one token of the model's own (kvlab.speculative: the same functions as kvlab.generate), and
the refused drafts' K and V are cut off again (pool.truncate), so that every sequence holds
what plain decoding would hold. Greedy outputs are the same, token for token, as without
speculation; sampled ones have the same distribution (seeded: exactly
generate(speculate=...)'s tokens while every pass has room for all its drafts). (With
draft_tokens >= block_size, a block filled by refused drafts alone goes to the prefix cache
when the cut releases it, as a freed sequence's full blocks do: unreferenced, evictable,
and exact for those tokens.)
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import arguments
from .deprecation import renamed
from .errors import ContextLengthError
from .model import Model, as_token_array
from .paged import PagedPool, PoolViews
from .quant import CacheFormat
from .sampling import sample as sample_token
from .scheduler import Request, Sample, SamplingParams, Scheduler, State, requests_fit
from .speculative import (Drafter, SpeculationStats, check_drafter, keep_until_stop,
                          propose_drafts, verify_drafts)


@dataclasses.dataclass
class StepResult:
    """What one engine step did."""
    step: int
    batch_size: int              # sequences in the forward call
    prefill_tokens: int          # prompt (or recomputed) tokens run
    decode_tokens: int           # sequences that fed one generated token (and its drafts)
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    preemptions: int             # requests preempted this step
    prefix_hit_tokens: int       # prompt tokens found in the prefix cache at admission
    admitted: List[int]          # request ids
    finished: List[int]
    new_tokens: Dict[int, List[int]]   # request id -> the tokens chosen, sample by sample
                                       # (one each; with speculation, maybe several)
    seconds: float
    failed: Dict[int, str] = dataclasses.field(default_factory=dict)   # id -> why (also finished)
    drafted: int = 0             # speculation: draft tokens run in the forward call
    accepted: int = 0            # drafts the model agreed with (checked this step)
    recomputed_tokens: int = 0   # prefill tokens computed once already, before a preemption
                                 # dropped their K and V (preemption by recompute's cost)
    swapped_out_blocks: int = 0  # preemption by swapping: blocks of K and V copied to host
    swapped_out_bytes: int = 0   # memory (pool.swap_out) and their bytes,
    swapped_in_blocks: int = 0   # and blocks copied back into the pool (pool.swap_in)
    swapped_in_bytes: int = 0

    @property
    def idle(self) -> bool:
        """Nothing happened: no tokens run or chosen, no request admitted, preempted or done."""
        return not (self.batch_size or self.new_tokens or self.finished or self.admitted
                    or self.preemptions)

    def __str__(self) -> str:
        return (f"step {self.step}: {self.batch_size} seqs, {self.prefill_tokens} prefill + "
                f"{self.decode_tokens} decode tokens"
                + (f" + {self.drafted} drafts ({self.accepted} kept)" if self.drafted else "")
                + f", blocks {self.blocks_used} used / "
                f"{self.blocks_free} free / {self.blocks_cached} cached"
                + (f", {self.preemptions} preempted" if self.preemptions else "")
                + (f", {self.recomputed_tokens} tokens recomputed"
                   if self.recomputed_tokens else "")
                + (f", {self.swapped_out_blocks} blocks swapped out "
                   f"({self.swapped_out_bytes:,} bytes)" if self.swapped_out_blocks else "")
                + (f", {self.swapped_in_blocks} blocks swapped in "
                   f"({self.swapped_in_bytes:,} bytes)" if self.swapped_in_blocks else "")
                + (f", {self.prefix_hit_tokens} prefix-hit tokens" if self.prefix_hit_tokens else "")
                + (f", finished {self.finished}" if self.finished else "")
                + (f", failed {sorted(self.failed)}" if self.failed else ""))


@dataclasses.dataclass(eq=False)
class CompletionOutput:
    """One sample of a finished request: vLLM's CompletionOutput, in kvlab.Generation's
    words (vLLM's token_ids and text are tokens and completion here)."""
    index: int                   # which sample of the request (0 .. n - 1)
    tokens: List[int]            # the generated ids, in order
    completion: str              # the generated text alone ("" without a tokenizer)
    finish_reason: str           # "length", "eos", or "error: step N: why" when its next
                                 # token could not be chosen (the request failed)
    speculation: Optional[SpeculationStats] = None   # with speculate=: as Generation's

    def __eq__(self, other) -> bool:
        if isinstance(other, list):                   # outputs[i] == [ids], the old shape
            return list(self._old_shape()) == other
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return ((self.index, self.tokens, self.completion, self.finish_reason)
                == (other.index, other.tokens, other.completion, other.finish_reason))

    # Before issue 19, RequestOutput.outputs[i] was sample i's token list: reading it as a
    # list still works for a release, and says what to write instead.
    def _old_shape(self) -> List[int]:
        renamed("RequestOutput.outputs[i] as a token list", "RequestOutput.outputs[i].tokens",
                stacklevel=4)
        return self.tokens

    def __iter__(self):
        return iter(self._old_shape())

    def __len__(self) -> int:
        return len(self._old_shape())

    def __getitem__(self, item):
        return self._old_shape()[item]


@dataclasses.dataclass
class RequestMetrics:
    """How long a request took, in the units a user feels (seconds on the engine's clock):
    time to first token (from arrival: queueing and prefill), time per output token after
    it (decode, shared with the batch), and end to end."""
    arrival_time: float
    first_token_time: Optional[float]   # None if it failed before choosing one
    finished_time: float
    output_tokens: int                  # of its longest sample

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival until the first generated token was chosen."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival until the last token."""
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first (vLLM's TPOT): (e2e - ttft) / (tokens - 1);
        None for fewer than two tokens."""
        if self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.output_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its prompt ids and one CompletionOutput per sample (n of them),
    the shape of vLLM's RequestOutput."""
    id: int
    prompt: List[int]
    outputs: List[CompletionOutput]
    preemptions: int
    # with speculate=: the samples' counts added up (SpeculationStats.total)
    speculation: Optional[SpeculationStats] = dataclasses.field(default=None, compare=False)
    # when it arrived, got its first token and finished (engine clock): TTFT, TPOT, e2e
    metrics: Optional[RequestMetrics] = dataclasses.field(default=None, compare=False)

    @property
    def texts(self) -> List[str]:
        renamed("RequestOutput.texts", "[o.completion for o in RequestOutput.outputs]")
        return [o.completion for o in self.outputs]

    @property
    def finish_reasons(self) -> List[str]:
        renamed("RequestOutput.finish_reasons",
                "[o.finish_reason for o in RequestOutput.outputs]")
        return [o.finish_reason for o in self.outputs]


@dataclasses.dataclass
class _Speculation:
    """One sample's speculative decoding: its counters, its drafter (made at its first
    proposal: its own where the engine's drafter can spawn one, since a DraftModel's cache
    holds one context) and q, the distributions its drafts were drawn from (None: certain)."""
    stats: SpeculationStats
    drafter: Any = None
    q: Optional[list] = None


@dataclasses.dataclass
class _SwapTraffic:
    """What preemption by swapping moved in one step (StepResult's swapped_* fields)."""
    out_blocks: int = 0
    out_bytes: int = 0
    in_blocks: int = 0
    in_bytes: int = 0


class _FinishedOutputs(dict):
    """Engine.outputs: a dict of the finished requests' outputs whose missing keys say
    why (a request still waiting or running, or no such request)."""

    def __init__(self, states: Dict[int, State]):
        super().__init__()
        self._states = states

    def __missing__(self, rid):
        state = self._states.get(rid)
        if state is None:
            raise KeyError(f"no request {rid!r} was added to this engine")
        raise KeyError(f"request {rid} is not finished yet ({state.value}): step() "
                       f"until it is, or run() to finish every request")


class _PoolSpace:
    """The scheduler's view of the pool (kvlab.scheduler.BlockSpace). Every call may be
    repeated after an interruption: a sample's handle is dropped only once its sequence is
    freed, and a freed handle (seq.alive False) is never freed twice. A host copy
    (sample.swapped) is valid for good: it holds the K and V of the sample's first
    copy.length tokens, which never change, so one that outlived an interruption is still
    right to swap in."""

    def __init__(self, pool: PagedPool, swap_space: Optional[int] = None,
                 swapped_bytes: Callable[[], int] = lambda: 0):
        self.pool = pool
        self.swap_space = swap_space         # the most bytes host copies may hold, or None
        self.swapped_bytes = swapped_bytes   # what they hold now
        self.swapped = _SwapTraffic()        # this step's; the engine resets it per step
        # the names of the pool's live sequences before the step's first new_sequence/fork:
        # a sequence made by a call that was then interrupted (before its handle was stored)
        # is one that is live, not named here, and held by no sample
        self.before_making: Optional[set] = None

    def available(self) -> int:
        return self.pool.available_blocks

    def sequences_left(self) -> int:
        return self.pool.max_seqs - self.pool.live_sequences

    def needed(self, sample: Sample, n_tokens: int) -> int:
        if sample.seq is None:
            return -(-n_tokens // self.pool.block_size)
        return self.pool.blocks_needed(sample.seq, n_tokens)

    def start(self, request: Request) -> int:
        self.release(request)                 # what an interrupted start or release left
        self.about_to_make()
        hits = 0
        # Swapped samples first: the scheduler counted their blocks before the prefix cache
        # was searched, and a cached block that a prefix hit takes is gone for them.
        for sample in request.active():
            if sample.swapped is not None:
                sample.seq = self.pool.swap_in(sample.swapped)
                sample.computed = sample.swapped.length
                self.swapped.in_blocks += sample.swapped.n_blocks
                self.swapped.in_bytes += sample.swapped.nbytes
        for sample in request.active():
            if sample.swapped is not None:
                continue
            sample.seq = self.pool.new_sequence()
            # at least the last token is computed: its logits choose the next token
            reusable = np.asarray(sample.tokens[:-1], dtype=np.int32)
            sample.computed = self.pool.reuse_prefix(sample.seq, reusable) if len(reusable) else 0
            hits += sample.computed
        return hits

    def release(self, request: Request) -> None:
        for sample in request.samples:
            self.drop(sample)

    def drop(self, sample: Sample) -> None:
        """Free one sample's sequence, if it has one: no K and V in the pool, nothing to
        choose from. A host copy stays while the sample still generates."""
        if sample.seq is not None:
            if sample.seq.alive:
                self.pool.free(sample.seq)
            sample.seq = None
        if sample.finished:
            sample.swapped = None
        sample.forget_sequence()

    def swap_out(self, request: Request) -> None:
        """Preemption by swapping: each active sample's K and V to host memory
        (sample.swapped), its sequence freed. A sample is swapped only if its rows are
        exactly its computed tokens and one token is still to feed (its logits choose the
        next): one whose logits an interrupted step lost is left to be recomputed, and so
        is one whose copy would pass swap_space or finds no host memory (the pool is
        unchanged then)."""
        for sample in request.active():
            seq = sample.seq
            if seq is None or not seq.alive:
                continue
            if not 0 < sample.computed == seq.length < len(sample.tokens):
                continue
            if (self.swap_space is not None and
                    self.swapped_bytes() + self.pool.swap_nbytes(seq) > self.swap_space):
                continue
            try:
                host = self.pool.swap_out(seq)
            except MemoryError:
                continue
            sample.swapped = host
            self.swapped.out_blocks += host.n_blocks
            self.swapped.out_bytes += host.nbytes

    def about_to_make(self) -> None:
        if self.before_making is None:
            self.before_making = _names(self.pool.sequences())


def _names(seqs) -> set:
    # (id, serial) names a sequence for good: a freed slot's id is reused
    return {(seq.id, seq.serial) for seq in seqs}


class _BlockTracer:
    """Block events for a notebook to replay, as the pool's block manager records them
    (pool.record_events, pool.take_events; csrc/blocks.c), each tagged with the step and
    the phase of the step it happened in:
      allocated  a free block (or an evicted cached one) starts holding a sequence's rows
      shared     one more sequence uses a block: a fork, a prefix-cache hit ("prefix_hit"),
                 or a block the pool found it had computed twice ("replaces": the duplicate,
                 released or freed next)
      copied     copy-on-write: "from" a shared, partly filled block to a new one
      released   one sequence fewer uses a block that others still use ("refs" left)
      freed      no sequence uses a block any more ("to": the prefix cache, or the free list)
      evicted    a cached block dropped from the prefix cache to be reused.
    "refs" is the block's reference count after the event; "seq" and "index" say which
    sequence's block table and entry, where one does. The pool records only while a step
    runs (what is done to the pool by hand between steps is not the engine's), so an
    engine dropped without close() leaves no recording on; what a step that raised did,
    and the repair after it, comes with phase "repair"."""

    def __init__(self, pool: PagedPool, sink):
        self.pool, self.sink = pool, sink
        self.undelivered: List[dict] = []   # events whose sink call raised, oldest first

    def start(self) -> None:
        self.pool.record_events = False     # anything recorded before is not this engine's
        self.pool.record_events = True

    def record(self, step: int, phase: str) -> None:
        """Moves the pool's new events, tagged, to the queue (an event leaves the pool's log
        once it is in the queue)."""
        self.undelivered.extend({"step": step, "phase": phase, **event}
                                for event in self.pool.take_events())

    def deliver(self) -> None:
        """Sends the queue, oldest first; an event leaves it only once the sink returned, so
        a sink that raises loses nothing and gets again only the event it raised on."""
        while self.undelivered:
            self.sink(self.undelivered[0])
            del self.undelivered[0]

    def stop(self, step: int) -> None:
        """Takes what the pool recorded since the last phase (nothing, unless the step
        raised), then stops the recording."""
        try:
            self.record(step, "repair")
        finally:
            self.pool.record_events = False


class Engine:
    """Continuous batching of many requests over one paged pool (see the module text).

    Failures. A request whose next token cannot be chosen (the sampler raises, or the
    logits hold NaN) fails alone: its samples finish with finish_reason "error: step N:
    why", its blocks are freed, and the other requests go on. Anything else that raises
    in step() (KeyboardInterrupt, a forward call's error, a trace sink's, a bug) leaves the
    engine and its pool consistent and resumable: calling step() or run() again gives every
    request exactly the tokens an uninterrupted run gives. How: a step commits as it goes.
    Once forward_batch returns, each sequence's `computed` count (and the logits row it
    will choose from) is recorded before anything else runs, so K and V in the pool and the
    bookkeeping never disagree for long; a token is committed by appending it, and a
    sampler interrupted before that puts its random generator back. If the exception came
    between a pool call and its bookkeeping, the engine repairs the difference before it
    re-raises: a sequence made but never stored is freed, a sample whose K and V went in
    but whose logits were lost is recomputed from its tokens (like a preemption, not counted
    as one), and the queues are put right. Trace events are sent in order at the end of a step,
    each until the sink returns: one a sink raised on is sent again first on the next step,
    before any new work (has_work stays True until then). Sequences made on the pool by hand are left alone; if they
    hold what waiting requests need, step() and run() raise RuntimeError, never loop.

    Speculation (speculate=) keeps these promises: drafts wait on their sample until they
    are checked (a step that raised before checking them checks them later; the random
    generator is put back if a proposal or a check is interrupted), the K and V of drafts
    whose logits were lost are cut off, and a token is never reported (new_tokens) and then
    taken back: drafts become tokens only once checked. A drafter that raises or proposes
    junk fails its request alone, as a sampler does."""

    def __init__(self, model: Model, pool: Optional[PagedPool] = None,
                 max_batch_tokens: int = 256, max_batch_seqs: Optional[int] = None,
                 trace: Union[None, str, Path, list] = None, *,
                 num_blocks: Optional[int] = None, block_size: Optional[int] = None,
                 dtype: Union[None, str, CacheFormat] = None,
                 speculate: Optional[Drafter] = None, draft_tokens: int = 4,
                 clock: Callable[[], float] = time.perf_counter,
                 preemption: str = "recompute", swap_space: Optional[int] = None):
        """Serve `model` from `pool`, or from a pool of its own made here with
        model.new_paged_pool(num_blocks, block_size (16), dtype ("fp32")). max_batch_tokens
        bounds the tokens of one forward call (drafts included), max_batch_seqs its
        sequences (default: all the pool allows); trace: a file path or a list that
        receives the block events. speculate: a drafter (kvlab.speculative.PromptLookup(),
        DraftModel(...)) that proposes up to draft_tokens tokens per sample and pass, as
        in kvlab.generate (see the module text); it needs a pool without a residual window.
        clock: the seconds each request's arrival, first token and end are read from
        (RequestOutput.metrics). preemption: what a request preempted for lack of blocks
        does with its K and V, "recompute" (drop them; prefill again on readmission) or
        "swap" (copy them to host memory and back; see the module text). swap_space: with
        "swap", the most bytes the host copies may hold at once (None: no limit, as vLLM's
        swap_space caps them); a request whose copy would not fit is recomputed instead."""
        if speculate is not None:
            draft_tokens = arguments.positive(draft_tokens, "draft_tokens")
            check_drafter(model, speculate, draft_tokens)
        if pool is None:
            if num_blocks is None:
                raise TypeError("Engine needs a pool, or num_blocks (with block_size and "
                                "dtype if not 16 and fp32) to make one")
            pool = model.new_paged_pool(num_blocks, 16 if block_size is None else block_size,
                                        "fp32" if dtype is None else dtype)
        elif (num_blocks, block_size, dtype) != (None, None, None):
            raise TypeError("the pool given fixes num_blocks, block_size and dtype: pass "
                            "either a pool or those, not both")
        _check_pool_fits(model, pool)
        if speculate is not None and getattr(pool, "window", 0):
            raise ValueError("speculation rolls rejected drafts back with pool.truncate: it "
                             "needs a pool without a residual window")
        max_batch_tokens = arguments.positive(max_batch_tokens, "max_batch_tokens")
        if max_batch_seqs is not None:
            max_batch_seqs = arguments.positive(max_batch_seqs, "max_batch_seqs")
        if trace is not None and not isinstance(trace, (list, str, os.PathLike)):
            raise TypeError(f"trace must be a file path, a list or None, got {type(trace).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, got {type(clock).__name__}")
        if preemption == "swap" and not callable(getattr(pool, "swap_out", None)):
            raise ValueError(f"preemption='swap' copies K and V to host memory with "
                             f"pool.swap_out, which {type(pool).__name__} does not have: use "
                             f"preemption='recompute'")
        self.model, self.pool = model, pool
        self._clock = clock
        self.speculate = speculate
        self.draft_tokens = int(draft_tokens) if speculate is not None else None
        self.scheduler = Scheduler(pool.block_size, max_batch_tokens,
                                   min(max_batch_seqs or pool.max_seqs, pool.max_seqs),
                                   preemption)    # checks preemption's value
        self.preemption = preemption
        if swap_space is not None:
            if preemption != "swap":
                raise ValueError("swap_space caps the host copies of preemption='swap'; "
                                 f"this engine preempts by {preemption}")
            swap_space = arguments.positive(swap_space, "swap_space", high=arguments.INT64_MAX)
        self.swap_space = swap_space
        self.space = _PoolSpace(pool, swap_space, self._swapped_bytes)
        self.requests: Dict[int, Request] = {}
        self.metrics: List[StepResult] = []
        self._next_id = 0
        # One step at a time: calls from several threads are serialized, not interleaved
        # (the queues and the pool change together within a step).
        self._lock = threading.RLock()
        self._eos = getattr(model.tokenizer, "eos_id", None)
        self._interrupted = False      # a step raised: samples may hold logits to choose from
        self._unrepaired = False       # ... and repairing after it was interrupted too
        self._trace_file = None
        self._tracer = None
        if trace is not None:
            if isinstance(trace, list):
                sink = trace.append
            else:
                self._trace_file = open(trace, "w")
                sink = lambda event: self._trace_file.write(json.dumps(event) + "\n")  # noqa: E731
            self._tracer = _BlockTracer(pool, sink)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> int:
        """Queue a request; returns its id. Raises ValueError at once if it could never
        fit the pool, even running alone. arrival_time: when it arrived on the engine's
        clock, if earlier than now (a load generator adding the requests that arrived
        during a step); its latencies count from then."""
        with self._lock:
            return self._add_request(prompt, params, arrival_time)

    def _add_request(self, prompt, params, arrival_time=None) -> int:
        if arrival_time is not None:        # a finite number (not NaN, not -inf, not a bool)
            arrival_time = arguments.real(arrival_time, "arrival_time")
        now = self._clock()
        if arrival_time is not None and not arrival_time <= now:
            raise ValueError(f"arrival_time must be a time on the engine's clock no later "
                             f"than now ({now}), got {arrival_time!r}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a kvlab.SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            ids = self.model.encode(prompt)
            if not ids:
                raise ValueError("the prompt has no tokens")
        else:
            ids = as_token_array(prompt, self.model.config.vocab_size).tolist()  # checks ids
        context = self.model.config.max_seq_len
        if len(ids) + params.max_new_tokens > context:
            raise ContextLengthError(f"request rejected: prompt ({len(ids)} tokens) + "
                                     f"max_new_tokens ({params.max_new_tokens}) exceeds the "
                                     f"model's context of {context} tokens")
        window = self.model.config.sliding_window
        if window is not None and len(ids) + params.max_new_tokens - 1 > window:
            raise ContextLengthError(f"request rejected: this model attends to its last {window} "
                                     f"positions (config.sliding_window) and the Engine keeps "
                                     f"every row of a sequence: prompt ({len(ids)} tokens) + "
                                     f"max_new_tokens ({params.max_new_tokens}) would pass it; "
                                     f"kvlab.generate runs such a model with a SlidingWindow cache")
        why = requests_fit(len(ids), params, self.pool.block_size, self.pool.num_blocks,
                           self.pool.max_blocks_per_seq)
        if why is not None:
            raise ValueError(f"request rejected: {why}")
        if params.n > self.pool.max_seqs:
            raise ValueError(f"request rejected: n={params.n} samples need as many sequences; "
                             f"the pool allows max_seqs={self.pool.max_seqs}")
        request = Request(id=self._next_id, prompt=list(ids), params=params, arrival=self._next_id,
                          arrived=now if arrival_time is None else float(arrival_time))
        for i in range(params.n):
            rng = np.random.default_rng(None if params.seed is None else params.seed + i)
            speculation = (_Speculation(SpeculationStats(self.draft_tokens))
                           if self.speculate is not None else None)
            request.samples.append(Sample(index=i, tokens=list(ids), prompt_len=len(ids), rng=rng,
                                          speculation=speculation))
        self._next_id += 1             # first: an interruption may skip an id, never reuse one
        try:
            self.requests[request.id] = request
            self.scheduler.add(request)
        except BaseException:          # known but not queued: the next step queues it
            self._unrepaired = True
            raise
        return request.id

    @property
    def has_work(self) -> bool:
        """Requests to run, or trace events a raising sink has not taken yet: step() again."""
        return (self._unrepaired or self.scheduler.has_work
                or bool(self._tracer is not None and self._tracer.undelivered))

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run one batched forward call, sample; returns what happened. Steps
        asked for by several threads at once run one after the other. If it raises, the
        engine is left resumable (see the class text). Raises RuntimeError rather than
        return a step that did nothing while requests wait (for blocks or sequences held
        outside the engine): stepping again would do nothing either."""
        with self._lock:
            # Trace events go to the sink between steps, never in the middle of one: a sink
            # that raises stops the engine before new work (so it cannot make new events
            # faster than they are sent), and never leaves a step half done.
            if self._tracer is not None:
                self._tracer.deliver()
                self._tracer.start()
            if not self._unrepaired:
                self.space.before_making = None
            try:
                result = self._step()
            except BaseException:
                self._interrupted = self._unrepaired = True
                try:
                    self._repair()
                    self._unrepaired = False
                except BaseException:      # interrupted again: the next step repairs
                    pass
                raise
            finally:
                if self._tracer is not None:
                    self._tracer.stop(self.scheduler.step_count)
            if self._tracer is not None:
                self._tracer.deliver()         # if it raises, the step is done all the same
            if result.idle and self.has_work:  # the next step would do nothing either
                raise RuntimeError(self._why_stuck())
            return result

    # [quote ch05-engine-step-runs]
    def _step(self) -> StepResult:
        start = time.perf_counter()
        step_number = self.scheduler.step_count
        new_tokens: Dict[int, List[int]] = {}
        finished: List[int] = []
        failed: Dict[int, str] = {}
        self.space.swapped = _SwapTraffic()
        if self._unrepaired:
            self._repair()
            self._unrepaired = False
        accepted = 0
        if self._interrupted:
            # tokens whose K and V went in during a step that then raised: choose them now
            accepted += self._choose(list(self.scheduler.running), step_number, new_tokens,
                                     failed)
            self._retire(finished)
            self._interrupted = False
        if self.speculate is not None:
            self._propose(step_number, failed)        # drafts, for the scheduler to fit in
            self._retire(finished)
        decision = self.scheduler.schedule(self.space)
        self._trace(step_number, "admit")
        prefill = decode = drafted = recomputed = 0
        if decision.items:
            chunks = [_chunk(sample, n) for _, sample, n in decision.items]  # (own, drafts)
            for (_, sample, _), (own, drafts) in zip(decision.items, chunks):
                if sample.pending == 1 and sample.computed >= sample.prompt_len:
                    decode += 1
                else:
                    prefill += len(own)
                drafted += len(drafts)
                recomputed += max(0, min(sample.computed + len(own), sample.computed_before)
                                  - sample.computed)
            seqs = [sample.seq for _, sample, _ in decision.items]
            fed = [own + drafts for own, drafts in chunks]
            if drafted:     # every token's logits: the drafts' rows check them
                logits = self.model.forward_batch(seqs, fed, all_logits=True)
            else:
                logits = self.model.forward_batch(seqs, fed)
            # Commit at once: these tokens' K and V are in the pool now. A sample whose
            # tokens are all computed keeps its logits row until its next token is chosen
            # (with drafts: that row and the drafts' rows, until they are checked).
            end = 0
            for i, ((_, sample, _), (own, drafts)) in enumerate(zip(decision.items, chunks)):
                end += len(own) + len(drafts)
                sample.computed += len(own)
                if sample.computed < len(sample.tokens):
                    continue
                if not drafted:                        # one row per sequence
                    sample.logits = logits[i]
                else:                                  # one per token: its last, its drafts
                    sample.logits = logits[end - 1 - len(drafts):end] if drafts else logits[end - 1]
            self._trace(step_number, "forward")
            batch = list({r.id: r for r, _, _ in decision.items}.values())
            accepted += self._choose(batch, step_number, new_tokens, failed)
        self._retire(finished)
        self._trace(step_number, "sample")
        stats, swapped = self.pool.stats(), self.space.swapped
        result = StepResult(step=step_number, batch_size=len(decision.items),
                            prefill_tokens=prefill, decode_tokens=decode,
                            blocks_used=stats.blocks_used, blocks_free=stats.blocks_free,
                            blocks_cached=stats.blocks_cached,
                            preemptions=len(decision.preempted),
                            prefix_hit_tokens=decision.prefix_hit_tokens,
                            admitted=[r.id for r in decision.admitted], finished=finished,
                            new_tokens=new_tokens, seconds=time.perf_counter() - start,
                            failed=failed, drafted=drafted, accepted=accepted,
                            recomputed_tokens=recomputed,
                            swapped_out_blocks=swapped.out_blocks,
                            swapped_out_bytes=swapped.out_bytes,
                            swapped_in_blocks=swapped.in_blocks,
                            swapped_in_bytes=swapped.in_bytes)
        self.metrics.append(result)
        return result
    # [end ch05-engine-step-runs]

    def _choose(self, requests: List[Request], step: int, new_tokens: Dict[int, List[int]],
                failed: Dict[int, str]) -> int:
        """Choose the next token of every sample of `requests` that has all its tokens
        computed (with drafts: check them). At the end of a prompt with n > 1, first fork
        it into the request's other samples, each choosing from the same logits. A request
        whose token cannot be chosen fails; the others go on. Returns the drafts kept."""
        accepted = 0
        for request in requests:
            if request.state is not State.RUNNING or request.finished:
                continue
            if not request.forked and request.params.n > 1 and _ready(request.samples[0]):
                self._fork(request)
            for sample in request.samples:
                if not _ready(sample):
                    continue
                try:
                    if sample.logits.ndim == 2:         # the newest token's row and drafts'
                        tokens, kept = self._check_drafts(request, sample)
                        accepted += kept
                    else:
                        tokens = self._choose_one(request, sample)
                except Exception as error:         # this request alone fails
                    self._fail(request, step, error, failed)
                    break
                if tokens:
                    new_tokens.setdefault(request.id, []).extend(tokens)
                    if request.first_token_at is None:
                        request.first_token_at = self._clock()
        return accepted

    @staticmethod
    def _fail(request: Request, step: int, error: Exception, failed: Dict[int, str]) -> None:
        why = f"error: step {step}: {type(error).__name__}: {error}"
        for s in request.samples:
            if not s.finished:
                s.finished, s.finish_reason = True, why
        failed[request.id] = why

    def _fork(self, request: Request) -> None:
        """The prompt is done: the other samples share its blocks (copy on write later).
        Samples already forked by an interrupted call keep their sequence."""
        lead = request.samples[0]
        self.space.about_to_make()
        for other in request.samples[1:]:
            if other.seq is None and not other.finished:
                other.seq = self.pool.fork(lead.seq)
                other.computed, other.logits = lead.computed, lead.logits
        request.forked = True

    def _choose_one(self, request: Request, sample: Sample) -> List[int]:
        """Sample's next token from its logits, committed ([]: it chose end of sequence).
        Raises, changing nothing, if no token can be chosen; an interrupted choice puts the
        random generator back, so that choosing again draws the same number."""
        p, row = request.params, sample.logits
        if np.isnan(row).any():
            raise ValueError("the logits hold NaN: no token can be chosen")
        state = sample.rng.bit_generator.state if p.temperature > 0.0 else None
        length = len(sample.tokens)
        try:
            token = sample_token(row, p.temperature, p.top_k, p.top_p, sample.rng)
            if not 0 <= token < self.model.config.vocab_size:
                raise ValueError(f"the sampler chose token {token}, outside [0, "
                                 f"{self.model.config.vocab_size})")
            if p.stop_at_eos and self._eos is not None and token == self._eos:
                sample.finished, sample.finish_reason = True, "eos"
                token = None
            else:
                sample.tokens.append(token)            # the commit
        except BaseException:
            if state is not None and len(sample.tokens) == length and not sample.finished:
                sample.rng.bit_generator.state = state
            raise
        sample.logits = None
        if len(sample.outputs) >= p.max_new_tokens:
            sample.finished, sample.finish_reason = True, "length"
        if sample.speculation is not None:             # a pass with no drafts to check
            stats = sample.speculation.stats
            stats.verify_passes += stats.tokens > 0    # (the first token is the prompt's)
            stats.tokens += 1
        if sample.finished:
            self.space.drop(sample)                    # its blocks are free now
        return [] if token is None else [token]

    # ---- speculative decoding -----------------------------------------------------------
    def _propose(self, step: int, failed: Dict[int, str]) -> None:
        """Drafts for every running sample about to decode (its newest token is the only
        one to feed) that has none for its current tokens yet. Drafts wait on the sample
        until they are checked, through a preemption or an interrupted step. A drafter
        that raises or proposes junk fails that request alone."""
        for request in self.scheduler.running:
            if request.finished:
                continue
            for sample in request.active():
                if (sample.seq is None or sample.pending != 1 or not sample.outputs
                        or sample.drafted_after == len(sample.tokens)):
                    continue
                try:
                    self._propose_one(request, sample)
                except Exception as error:
                    self._fail(request, step, error, failed)
                    break

    def _propose_one(self, request: Request, sample: Sample) -> None:
        """Ask the sample's drafter for drafts after its tokens (kvlab.speculative's rules:
        at most draft_tokens, none that could not be kept before max_new_tokens). An
        interrupted proposal puts the random generator back (a DraftModel samples its
        drafts from it when the request samples)."""
        p, spec = request.params, sample.speculation
        if spec.drafter is None:
            spawn = getattr(self.speculate, "spawn", None)
            spec.drafter = spawn() if callable(spawn) else self.speculate
        sampling = (p.temperature, p.top_k, p.top_p, sample.rng)
        state = sample.rng.bit_generator.state if p.temperature > 0.0 else None
        passes = getattr(spec.drafter, "passes", 0)
        try:
            drafts, q = propose_drafts(spec.drafter, sample.tokens, self.draft_tokens,
                                       p.max_new_tokens - len(sample.outputs), sampling,
                                       self.model.config.vocab_size)
        except BaseException:
            if state is not None:
                sample.rng.bit_generator.state = state
            raise
        finally:
            spec.stats.draft_passes += getattr(spec.drafter, "passes", 0) - passes
        sample.drafts, spec.q = drafts, q
        sample.drafted_after = len(sample.tokens)      # last: now they count

    def _check_drafts(self, request: Request, sample: Sample) -> Tuple[List[int], int]:
        """Check the drafts that ran after the sample's newest token, as kvlab.generate
        does: the tokens plain decoding would have chosen, committed, and how many drafts
        were kept. The pool is left holding what plain decoding holds (one row per token
        fed: every token but the last chosen); the refused drafts' rows are cut off. Raises
        before the commit if no token can be chosen; an interrupted check puts the random
        generator back, so that checking again (cutting nothing more) gives the same tokens."""
        p, rows, spec = request.params, sample.logits, sample.speculation
        drafts = sample.drafts[:len(rows) - 1]
        q = None if spec.q is None else spec.q[:len(drafts)]
        state = sample.rng.bit_generator.state if p.temperature > 0.0 else None
        fed = len(sample.tokens) - 1                   # tokens fed before the newest
        try:
            accepted, token = verify_drafts(rows, drafts, q,
                                            (p.temperature, p.top_k, p.top_p, sample.rng))
            eos = self._eos if p.stop_at_eos else None
            kept, stop = keep_until_stop(drafts[:accepted] + [token], eos,
                                         p.max_new_tokens - len(sample.outputs))
            chosen = len(kept) + (stop == "eos")       # an EOS token is chosen, not kept
            # first the cut (repeating it cuts nothing more), then the commit below
            self.pool.truncate(sample.seq, fed + chosen)
        except BaseException:
            if state is not None:
                sample.rng.bit_generator.state = state
            raise
        # the commit: no call between these lines, so an exception cannot split it
        sample.tokens.extend(kept)
        sample.computed, sample.logits = fed + chosen, None
        if stop is not None:
            sample.finished, sample.finish_reason = True, stop
        spec.stats.count_pass(len(drafts), accepted)
        spec.stats.tokens += chosen
        if sample.finished:
            self.space.drop(sample)                    # its blocks are free now
        return kept, accepted

    def _retire(self, finished: List[int]) -> None:
        """Every running request whose samples are all done leaves, its blocks freed."""
        for request in list(self.scheduler.running):
            if request.finished:
                request.finished_at = self._clock()
                self.space.release(request)
                self.scheduler.finish(request)
                finished.append(request.id)
                _drop_drafters(request)

    def _repair(self) -> None:
        """After a step raised: make the queues, the samples and the pool agree again, so
        that the next step goes on as if nothing had happened (see the class text)."""
        scheduler, space = self.scheduler, self.space
        held = set()
        for request in self.requests.values():
            running, waiting = request in scheduler.running, request in scheduler.waiting
            if request.state is State.FINISHED:
                if request.finished_at is None:
                    request.finished_at = self._clock()
                if running or waiting:
                    scheduler.finish(request)
                if any(s.seq is not None for s in request.samples):
                    space.release(request)
                _drop_drafters(request)
                continue
            if running and waiting:
                scheduler.running.remove(request)
                running = False
            elif not running and not waiting:         # lost between the queues
                scheduler.waiting.appendleft(request)
                waiting = True
            request.state = State.RUNNING if running else State.WAITING
            if waiting:
                if any(s.seq is not None for s in request.samples):
                    space.release(request)             # recomputed when admitted
                continue
            for sample in request.samples:
                if not sample.finished and len(sample.outputs) >= request.params.max_new_tokens:
                    sample.finished, sample.finish_reason = True, "length"
                if sample.finished and sample.seq is not None:
                    space.drop(sample)
            if not self._samples_agree_with_pool(request):
                scheduler.preempt(request, space, count=False)
                continue
            held |= _names(s.seq for s in request.samples if s.seq is not None)
        if space.before_making is not None:            # sequences made, then lost
            for seq in self.pool.sequences():
                name = (seq.id, seq.serial)
                if name not in held and name not in space.before_making:
                    self.pool.free(seq)
            space.before_making = None

    def _samples_agree_with_pool(self, request: Request) -> bool:
        """Whether a running request's samples can go on from what the pool holds. Tokens
        a forward call computed before it raised count as computed; a sample whose tokens
        are all computed but whose logits were lost cannot choose: it must be recomputed.
        A sample holding its drafts' logits checks them next step; the K and V of drafts
        whose logits were lost are cut off (the drafts are checked after the recompute)."""
        lead = request.samples[0]
        for sample in request.samples:
            seq = sample.seq
            if sample.finished or (seq is None and not request.forked and sample is not lead):
                continue                               # not forked yet
            if seq is None or not seq.alive:
                return False
            if sample.logits is not None and sample.logits.ndim == 2:     # drafts to check
                n_drafts = len(sample.logits) - 1      # (their rows may be cut already)
                if not sample.computed == len(sample.tokens) <= seq.length \
                        <= sample.computed + n_drafts:
                    return False
                continue
            if seq.length > len(sample.tokens):        # drafts' rows, their logits lost
                self.pool.truncate(seq, len(sample.tokens))
            if not sample.computed <= seq.length <= len(sample.tokens):
                return False
            if seq.length > sample.computed:
                sample.computed, sample.logits = seq.length, None
            if sample.computed == len(sample.tokens) and sample.logits is None:
                return False
        return True

    def _trace(self, step: int, phase: str) -> None:
        if self._tracer is not None:
            self._tracer.record(step, phase)

    # ---- all of it --------------------------------------------------------------------
    def run(self, progress: bool = True) -> Dict[int, RequestOutput]:
        """Step until every request is finished; returns their outputs by request id.
        Never loops without progress: see step()."""
        bar = None
        if progress:
            from tqdm.auto import tqdm
            total = sum(r.params.max_new_tokens * r.params.n for r in self.requests.values()
                        if r.state is not State.FINISHED)
            bar = tqdm(total=total, desc="engine", unit="tok")
        try:
            while self.has_work:
                result = self.step()
                if bar is not None:
                    bar.update(sum(len(t) for t in result.new_tokens.values()))
                    bar.set_postfix(batch=result.batch_size, blocks=result.blocks_used,
                                    refresh=False)
        finally:
            if bar is not None:
                bar.close()
            if self._trace_file is not None:
                self._trace_file.flush()
        return self.outputs

    def _why_stuck(self) -> str:
        stats = self.pool.stats()
        return (f"the engine cannot make progress: {len(self.scheduler.waiting)} requests "
                f"wait and none runs, but the pool has only {self.pool.available_blocks} "
                f"blocks to give and {self.pool.max_seqs - self.pool.live_sequences} sequences "
                f"left ({stats.n_sequences} sequences made outside the engine hold "
                f"{stats.blocks_used} blocks); free them, or give the engine a pool of its own")

    def _swapped_bytes(self) -> int:
        """Host memory the samples' swapped-out K and V hold now (only waiting requests
        hold copies: admission and the end drop them)."""
        return sum(s.swapped.nbytes for r in self.scheduler.waiting for s in r.samples
                   if s.swapped is not None)

    @property
    def outputs(self) -> Dict[int, RequestOutput]:
        """Every finished request's output, by id (failed ones too: see each sample's
        finish_reason). Asking for one not finished yet raises a KeyError that says so."""
        done = _FinishedOutputs({rid: r.state for rid, r in self.requests.items()})
        for request in self.requests.values():
            if request.state is not State.FINISHED:
                continue
            outputs = [CompletionOutput(s.index, list(s.outputs),
                                        (self.model.decode_text(s.outputs)
                                         if self.model.tokenizer is not None else ""),
                                        s.finish_reason,
                                        s.speculation.stats if s.speculation else None)
                       for s in request.samples]
            total = (SpeculationStats.total([o.speculation for o in outputs], self.draft_tokens)
                     if self.speculate is not None else None)
            finished_at = request.arrived if request.finished_at is None else request.finished_at
            metrics = RequestMetrics(request.arrived, request.first_token_at, finished_at,
                                     max(len(o.tokens) for o in outputs))
            done[request.id] = RequestOutput(request.id, request.prompt, outputs,
                                             request.preemptions, total, metrics)
        return done

    @property
    def speculation(self) -> Optional[SpeculationStats]:
        """With speculate=: what speculation did so far, every request's samples added up
        (finished or not); None without."""
        if self.speculate is None:
            return None
        return SpeculationStats.total([s.speculation.stats for r in self.requests.values()
                                       for s in r.samples], self.draft_tokens)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the trace file, if trace= named one (also done by `with Engine(...)`)."""
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None


def _drop_drafters(request: Request) -> None:
    """A finished request's drafters (a DraftModel's cache each) are no longer needed."""
    for sample in request.samples:
        if sample.speculation is not None:
            sample.speculation.drafter = None


def _chunk(sample: Sample, n: int) -> Tuple[List[int], List[int]]:
    """What a scheduled item of n tokens feeds: the sample's next own tokens, and when
    they are all it has left, its drafts after them (speculation: n - own of them). The
    drafts that fit (maybe none) are checked after this chunk, the others never, so they
    are kept as the sample's drafts: a retry of a step that raised runs the same."""
    own = sample.tokens[sample.computed:sample.computed + n]
    if len(own) < sample.pending or not sample.live_drafts:
        return own, []
    sample.drafts = sample.drafts[:n - len(own)]
    return own, sample.drafts


def _ready(sample: Sample) -> bool:
    """Every token of the sample is computed and its next one is still to choose."""
    return (not sample.finished and sample.seq is not None and sample.logits is not None
            and sample.computed == len(sample.tokens))


def _check_pool_fits(model: Model, pool: PagedPool) -> None:
    """Refuse a pool this model cannot run on (every step would raise)."""
    if not isinstance(pool, PoolViews):
        raise TypeError(f"pool must be a kvlab.PagedPool (model.new_paged_pool(...)), got "
                        f"{type(pool).__name__}")
    where = getattr(pool, "device", "cpu")
    if where != model.device:
        raise ValueError(f"this pool keeps its K and V on {where!r} but the model runs on "
                         f"{model.device!r}: make the pool with model.new_paged_pool")
    if hasattr(pool, "n_layers"):                      # a GPU pool says so itself
        shape = (pool.n_layers, pool.n_kv_heads, pool.head_dim)
    else:                                              # (num_blocks, n_layers, block_size,
        codes = pool.key_codes                         #  n_kv_heads, per head)
        per_head = codes.shape[4] * (2 if pool.key_format == "int4" else 1)
        shape = (codes.shape[1], codes.shape[3], per_head)
    c = model.config
    if shape != (c.n_layers, c.n_kv_heads, c.head_dim):
        raise ValueError(f"this pool holds {shape[0]} layers x {shape[1]} KV heads x {shape[2]}, "
                         f"but the model needs {c.n_layers} x {c.n_kv_heads} x {c.head_dim}: "
                         f"make the pool with model.new_paged_pool")
