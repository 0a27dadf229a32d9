"""kvlab.Engine: continuous batching on the paged pool.

"Every active conversation carries its own cache." The engine serves many requests at
once from one paged pool: each step, the scheduler (kvlab.scheduler) picks which
sequences run and with how many tokens, and the engine runs them all in ONE batched
forward call (Model.forward_batch: every weight matrix streamed once per KV_TOKEN_CHUNK
tokens), then samples each sequence's next token. Requests join and leave between steps:
continuous batching.

    engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=256, block_size=16))
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_new_tokens=40))
    while engine.has_work:
        print(engine.step())              # what happened: batch, tokens, blocks, preemptions
    engine.outputs                        # every request's generated tokens and text

A step has three phases, as nano-vllm's schedule, run and postprocess:
  plan    drafts for the sequences about to decode (speculation), then the scheduler's
          plan: who runs, with how many tokens and drafts, who is preempted or admitted. It
          changes nothing in the pool (Scheduler.plan is a pure function of the queues).
  run     the pool operations the plan asks for (preemptions, admissions), the one
          forward_batch, then each finished chunk's next token, chosen from a copy of its
          random generator, the refused drafts' rows cut off and the finished sequences
          freed. Every call here goes on from where the pool is, so that making it again
          after it raised (a KeyboardInterrupt) does what is left, nothing twice.
  commit  plain assignments: tokens, counts, the random generators' new states, queues.
Ctrl-C is held from the start of a step to its end, and looked at in two places: between
the forward calls of a long step, and inside a call of more than measure.CHUNK_FLOPS. A
step whose forward is more than about measure.CHUNK_FLOPS of work (a long prefill) makes it
in several calls of about that much (each row bit for bit what one call gives: a prefill
in parts equals one prefill), so that a Ctrl-C stops it within one call's time (tenths of a
second; measured by benchmarks/interrupt_latency.py). A call is never cut below CHUNK_MIN
tokens, and at a long context those are more work (a second of two threads' on a 110M
model at 8,000 positions): during such a call a Ctrl-C is let through to the C core, which
stops the call between two layers, changing nothing (Model.forward_batch). Either way the
step stops there unfinished: step() raises
KeyboardInterrupt with the plan carried out and the rows computed so far in the pool, and
nothing of the step in the queues' tokens, the outputs or engine.metrics (`unfinished`
says so); the next step() or run() first finishes that step, from where the pool is, and
returns it. Anywhere else, the step finishes and the KeyboardInterrupt is raised at its
end, the step done (in engine.metrics); one raised inside the plan (by a drafter) stops the
step before the pool changed. So a step happens whole, as it would have uninterrupted,
or not at all, or waits half done for the next call to finish it, and a run resumed with
step() or run() gives every request exactly the uninterrupted run's tokens (sampled,
speculative, preempted or not).
A request whose next token cannot be chosen (the sampler or a drafter raises, the logits
hold NaN) fails alone, finish_reason "error: step N: why"; the others go on.

Greedy outputs are identical, token for token, to kvlab.generate on each prompt alone,
whatever else is in the batch and however often a request was preempted: the core's
results for a sequence do not depend on the batch around it (fp32 and every cache format).
This file is bookkeeping: the pool and the C core hold and compute the K and V.

Preemption (Engine(..., preemption=)): when the pool runs out of blocks, the most recently
admitted request gives its blocks back. "recompute" (the default) drops its K and V: when
it is admitted again, its prompt and the tokens it generated are run through the model
again (less what the prefix cache still holds). "swap" copies its K and V to host memory
first (pool.swap_out) and, on admission, into fresh blocks (pool.swap_in): bytes moved
instead of a prefill. The tokens are the same either way; each StepResult counts what a
step recomputed (recomputed_tokens) and swapped (swapped_out_blocks ... swapped_in_bytes).

Speculative decoding (Engine(..., speculate=PromptLookup(), draft_tokens=4)): each step,
every sequence about to decode asks the drafter for up to draft_tokens guesses of its next
tokens; the scheduler lets them ride on the sequence's chunk (its newest token) in what
certain work leaves of the token budget and the free blocks; the one forward call returns
every token's logits; each sequence keeps its drafts up to the first the model refuses,
plus one token of the model's own (kvlab.speculative: the same functions as kvlab.generate),
and the refused drafts' K and V are cut off again (pool.truncate), so that every sequence
holds what plain decoding would hold. Greedy outputs are the same, token for token, as
without speculation; sampled ones have the same distribution (seeded: exactly
generate(speculate=...)'s tokens while every pass has room for all its drafts). (With
draft_tokens >= block_size, a block filled by refused drafts alone goes to the prefix cache
when the cut releases it, as a freed sequence's full blocks do: unreferenced, evictable,
and exact for those tokens.)
"""
from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from . import arguments
from .block_events import BlockTracer
from .engine_outputs import (CompletionOutput, FinishedOutputs, RequestMetrics,  # noqa: F401
                             RequestOutput, StepResult, request_output)
from .held_interrupt import HeldCtrlC
from .model import Model, as_token_array
from .paged import PagedPool, PoolStats
from .pool_space import PoolSpace, check_request_fits, check_swap, pool_for
from .quant import CacheFormat
from .sampling import sample as sample_token
from .plugins import (AllocatorMirror, MirroredPool, PluginError,  # noqa: F401 (re-exported)
                      PrefixMirror, check_scheduler, checked_plan, make_allocator,
                      make_prefix_cache)
from . import measure
from .measure import CHUNK_FLOPS, CHUNK_MIN, work_rates
from .slo import StepWork
from .scheduler import Request, SamplingParams, ScheduledStep, Scheduler, Sequence, State
from .speculative import (Drafter, SpeculationStats, check_drafter, keep_until_stop,
                          propose_drafts, verify_drafts)


@dataclasses.dataclass(eq=False)
class EngineSequence(Sequence):
    """A Sequence as the engine runs it: beside what the scheduler knows of it, what it
    needs to choose its tokens."""
    rng_state: Optional[dict] = None          # its random generator, a numpy PCG64's state:
                                              # the run draws from a copy, the commit keeps it
    stats: Optional[SpeculationStats] = None  # with speculation: its counters, its drafter
    drafter: Optional[Drafter] = None         # (its own where the engine's can spawn one: a
                                              # DraftModel's cache holds one context), and the
    q: Optional[list] = None                  # distributions its drafts came from (None: certain)


@dataclasses.dataclass
class _Choice:
    """What run chose for one sequence, for commit to assign."""
    request: Request
    kept: List[int]              # the tokens it keeps (drafts accepted, then the model's)
    stop: Optional[str]          # "eos", "length", or None: it goes on
    rng_state: Optional[dict]    # its generator after the draws (None: it drew nothing)
    checked: Optional[int]       # drafts checked (a speculative pass), or None
    accepted: int = 0


@dataclasses.dataclass
class _Outcome:
    """What one step's run did, for commit to assign. Kept across the run's attempts."""
    # per item of the plan: (its own tokens, its drafts), and the logits it chooses from
    chunks: List[Tuple[int, List[int]]] = dataclasses.field(default_factory=list)
    rows: Dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    computed: Dict[Sequence, int] = dataclasses.field(default_factory=dict)   # rows it holds
    chosen: Dict[Sequence, _Choice] = dataclasses.field(default_factory=dict)
    forked: Set[Request] = dataclasses.field(default_factory=set)
    failed: Dict[int, str] = dataclasses.field(default_factory=dict)      # id -> why
    interrupt: Optional[KeyboardInterrupt] = None    # raised by a call: raised at the end
    stats: Optional[PoolStats] = None                # the pool, and the clock, at its end
    now: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)   # StepResult's token counts
    kv_rows_read: int = 0                            # by the forward calls made


@dataclasses.dataclass
class _Unfinished:
    """A step a Ctrl-C stopped between its forward calls: what the next step() finishes."""
    plan: ScheduledStep
    number: int
    failed: Dict[int, str]
    outcome: _Outcome
    seconds: float                  # the time it ran before it stopped


class _Stopped(Exception):
    """A held Ctrl-C, taken between two forward calls of a step, or one let through during a
    long call (which then changed nothing): the step stops there."""


class Engine:
    """Continuous batching of many requests over one paged pool (see the module text:
    a step in three phases, what an interrupt and an error do).

    Whatever raises out of step() leaves the engine and its pool consistent and resumable:
    a held Ctrl-C or a KeyboardInterrupt a call raised during the run, after the step was
    done; a Ctrl-C between the forward calls of a long step (or inside a long call), with
    the step unfinished (`unfinished`), which the next step finishes; an error in a call on
    no one request's behalf (the forward call itself, the pool, the trace sink, an
    allocator plug-in: kvlab.plugins.MirroredPool), with the step's queues and pool as far
    as it went, which the next step plans from. Trace events are sent in order between
    steps, each until the sink returns: one a sink raised on is sent again first on the
    next step, before any new work (has_work stays True until then). Sequences made on the
    pool by hand are left alone; if they hold what waiting requests need, step() and run()
    raise RuntimeError, never loop."""

    def __init__(self, model: Model, pool: Optional[PagedPool] = None,
                 max_batch_tokens: int = 256, max_batch_seqs: Optional[int] = None,
                 trace: Union[None, str, Path, list] = None, *,
                 num_blocks: Optional[int] = None, block_size: Optional[int] = None,
                 dtype: Union[None, str, CacheFormat] = None,
                 speculate: Optional[Drafter] = None, draft_tokens: int = 4,
                 clock: Callable[[], float] = time.perf_counter,
                 preemption: str = "recompute", swap_space: Optional[int] = None,
                 scheduler=None, drafter: Optional[Drafter] = None, allocator=None,
                 prefix_cache=None):
        """Serve `model` from `pool`, or from a pool of its own made here with
        model.new_paged_pool(num_blocks, block_size (16), dtype ("fp32")). max_batch_tokens
        bounds the tokens of one forward call (drafts included), max_batch_seqs its
        sequences (default: all the pool allows); trace: a file path or a list that
        receives the block events (kvlab.block_events). speculate: a drafter
        (kvlab.speculative.PromptLookup(), DraftModel(...)) that proposes up to
        draft_tokens tokens per sequence and pass, as in kvlab.generate (see the module
        text); it needs a pool without a residual window. clock: the seconds each
        request's arrival, first token and end are read from (RequestOutput.metrics).
        preemption: what a request preempted for lack of blocks does with its K and V,
        "recompute" (drop them; prefill again on readmission) or "swap" (copy them to host
        memory and back; see the module text). swap_space: with "swap", the most bytes
        the host copies may hold at once (None: no limit, as vLLM's swap_space caps them);
        a request whose copy would not fit is recomputed instead.

        Plug-ins (kvlab.plugins: what each is asked, and the checks on its answers):
        scheduler, an object whose plan(view) says who runs each step (requests of one
        sample only); drafter, the same as speculate (give one of the two); allocator, a
        class with lab 5's interface, made here with (num_blocks, block_size) and driven in
        step with the engine's pool (made here, with no prefix cache), checked each step;
        prefix_cache, a class made here with (block_size), told which prefixes the pool's
        cache finds and asked what each admission reuses, checked before the pool changes."""
        speculate, self.policy = _plugins(speculate, drafter, scheduler)
        if speculate is not None:
            draft_tokens = arguments.positive(draft_tokens, "draft_tokens")
            check_drafter(model, speculate, draft_tokens)
        if allocator is not None and pool is not None:
            raise TypeError("allocator= follows a pool the engine makes itself (with no "
                            "prefix cache): pass num_blocks (block_size, dtype), not a pool")
        if allocator is not None and prefix_cache is not None:
            raise TypeError("allocator= follows a pool with no prefix cache, which a "
                            "prefix_cache= plug-in would mirror: give one of the two")
        pool = pool_for(model, pool, num_blocks, block_size, dtype,
                        prefix_cache=allocator is None)
        if speculate is not None and pool.window:
            raise ValueError("speculation rolls rejected drafts back with pool.truncate: it "
                             "needs a pool without a residual window")
        max_batch_tokens = arguments.positive(max_batch_tokens, "max_batch_tokens")
        if max_batch_seqs is not None:
            max_batch_seqs = arguments.positive(max_batch_seqs, "max_batch_seqs")
        if trace is not None and not isinstance(trace, (list, str, os.PathLike)):
            raise TypeError(f"trace must be a file path, a list or None, got {type(trace).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, got {type(clock).__name__}")
        self.model, self.pool, self._clock = model, pool, clock
        self.speculate = speculate
        self.draft_tokens = int(draft_tokens) if speculate is not None else None
        self.scheduler = Scheduler(pool.block_size, max_batch_tokens,
                                   min(max_batch_seqs or pool.max_seqs, pool.max_seqs),
                                   preemption)    # checks preemption's value
        self.preemption = preemption
        self.swap_space = check_swap(pool, preemption, swap_space)
        self._mirror = None
        if allocator is not None:        # every pool operation also done on the plug-in
            self._mirror = AllocatorMirror(make_allocator(allocator, pool.num_blocks,
                                                          pool.block_size), pool)
            self.pool = pool = MirroredPool(pool, self._mirror)
        self._prefix = None              # asked at admission, beside the pool's cache
        if prefix_cache is not None:
            self._prefix = PrefixMirror(make_prefix_cache(prefix_cache, pool.block_size), pool)
        self.space = PoolSpace(pool, self.swap_space, self._swapped_bytes)
        self.requests: Dict[int, Request] = {}
        self.metrics: List[StepResult] = []
        self._next_id = 0
        # One step at a time: calls from several threads are serialized, not interleaved
        # (the queues and the pool change together within a step).
        self._lock = threading.RLock()
        self._eos = getattr(model.tokenizer, "eos_id", None)
        self._vocab_size = model.config.vocab_size
        self._rng = np.random.Generator(np.random.PCG64())   # draws on a sequence's state
        self._phase = "admit"
        self._tracer = BlockTracer(pool, trace) if trace is not None else None
        self._unfinished: Optional[_Unfinished] = None   # a step a Ctrl-C stopped
        self._rates = work_rates(model.config)           # FLOPs per token, per position

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, prompt: Union[str, collections.abc.Sequence],
                    params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> int:
        """Queue a request; returns its id. Raises ValueError at once if it could never
        fit the pool, even running alone. arrival_time: when it arrived on the engine's
        clock, if earlier than now (a load generator adding the requests that arrived
        during a step); its latencies count from then."""
        with self._lock:
            request = self._new_request(prompt, params, arrival_time)
            with HeldCtrlC():         # known and queued, or neither
                self._next_id += 1
                self.requests[request.id] = request
                self.scheduler.add(request)
            return request.id

    def _new_request(self, prompt, params, arrival_time) -> Request:
        if self.policy is not None and params is not None and getattr(params, "n", 1) != 1:
            raise ValueError("a scheduler plug-in plans requests of one sample: this engine "
                             "takes SamplingParams(n=1) only")
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
        check_request_fits(self.model, self.pool, len(ids), params)
        request = Request(id=self._next_id, prompt=list(ids), params=params, arrival=self._next_id,
                          arrived=now if arrival_time is None else float(arrival_time))
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            request.sequences.append(EngineSequence(
                index=i, tokens=list(ids), prompt_len=len(ids),
                rng_state=np.random.default_rng(seed).bit_generator.state,
                stats=SpeculationStats(self.draft_tokens) if self.speculate else None))
        return request

    @property
    def has_work(self) -> bool:
        """Requests to run, or trace events a raising sink has not taken yet: step() again."""
        return (self.scheduler.has_work or self._unfinished is not None
                or bool(self._tracer is not None and self._tracer.undelivered))

    # ---- one step ---------------------------------------------------------------------
    # [quote ch05-engine-step-runs]
    def step(self) -> StepResult:
        """Plan, run, commit (see the module text); returns what happened. Steps asked
        for by several threads at once run one after the other. Raises RuntimeError rather
        than return a step that did nothing while requests wait (for blocks or sequences
        held outside the engine): stepping again would do nothing either."""
        with self._lock:
            if self._tracer is not None:
                self._tracer.deliver()        # between steps: a sink that raises stops here
            with HeldCtrlC() as held:             # a Ctrl-C waits for the end, or a look
                step = self._unfinished
                if step is None:                  # plan: drafts, then who runs
                    started, number = time.perf_counter(), self.scheduler.step_count
                    failed = self._propose(number)
                    step = _Unfinished(self._plan(number, failed), number, failed,
                                       _Outcome(failed=failed), 0.0)
                    self.space.new_step()
                else:                             # finish the step a Ctrl-C stopped
                    started = time.perf_counter() - step.seconds
                outcome = self._run_or_stop(step, held, started)
                if outcome is None:               # stopped between two forward calls
                    raise KeyboardInterrupt("the step stopped unfinished (Engine.unfinished): "
                                            "step() or run() finishes it")
                result = self._commit(step.plan, outcome, step.number, started)
            if self._tracer is not None:
                self._tracer.deliver()         # if it raises, the step is done all the same
            if outcome.interrupt is not None:
                raise outcome.interrupt
            if result.idle and self.has_work:  # the next step would do nothing either
                raise RuntimeError(self._why_stuck())
            return result
    # [end ch05-engine-step-runs]

    @property
    def unfinished(self) -> Optional[int]:
        """The number of the step a Ctrl-C stopped between its forward calls, which the
        next step() finishes first; None when there is none."""
        return None if self._unfinished is None else self._unfinished.number

    def _run_or_stop(self, step: _Unfinished, held: HeldCtrlC,
                     started: float) -> Optional[_Outcome]:
        """The step's run; None if a Ctrl-C stopped it between two forward calls, or inside
        a long one (kept in self._unfinished for the next step). Any other error ends the
        step for good: the next plans afresh from the queues and the pool as far as it went."""
        self._unfinished = step
        try:
            outcome = self._run(step.plan, step.number, step.outcome, held)
        except _Stopped:
            step.outcome.interrupt = None     # the KeyboardInterrupt raised now stands for it
            step.seconds = time.perf_counter() - started
            return None
        except BaseException:
            self._unfinished = None
            raise
        self._unfinished = None
        return outcome

    def _plan(self, number: int, failed: Dict[int, str]) -> ScheduledStep:
        """The scheduler's plan: the engine's own, or a plug-in's, checked (PluginError);
        with a prefix cache plug-in, its match() of each admission checked too."""
        if self.policy is None:
            plan = self.scheduler.plan(self.space, leaving=failed)
        else:
            plan = checked_plan(self.policy, self.scheduler, self.space, number, failed,
                                self._clock())
        if self._prefix is not None:     # its answers checked before the pool changes
            self._prefix.check_admissions(plan)
        return plan

    def _run(self, plan: ScheduledStep, number: int, outcome: _Outcome,
             held: HeldCtrlC) -> _Outcome:
        """The run phase. A KeyboardInterrupt that one of its calls raises (not Ctrl-C, which
        is held) does not stop it: a sequence the pool made for a call that raised is found
        (PoolSpace.recover), the run starts again and, every call going on from where the
        pool is, does only what is left; the interrupt is raised at the end of the step.
        A held Ctrl-C is taken between the forward calls of a long step, and one during a
        long call stops it (_forward): _Stopped is raised there (the step is finished by
        running this again, the same way)."""
        if self._tracer is not None:
            self._tracer.start()
        try:
            while True:
                try:
                    self._phase = "admit"
                    self.scheduler.apply(plan, self.space)        # preemptions, admissions
                    self._trace(number)
                    self._phase = "forward"
                    self._forward(plan, outcome, held)
                    self._trace(number)
                    self._phase = "sample"
                    self._choose(plan, number, outcome)
                    self._trace(number)
                    if self._mirror is not None:      # the plug-in follows, and is checked
                        self._mirror.step_done()
                    outcome.counts = _counts(plan, outcome.chunks)
                    outcome.stats, outcome.now = self.pool.stats(), self._time_after(outcome)
                    return outcome
                except KeyboardInterrupt as interrupt:
                    outcome.interrupt = interrupt
                    self.space.recover()
                except Exception:     # the step ends: a sequence made by the call that
                    self.space.recover()    # raised is not left behind in the pool
                    raise
        finally:
            if self._tracer is not None:
                self._tracer.stop(number, self._phase)

    def _time_after(self, outcome: _Outcome) -> float:
        """The clock at the end of the step's run. A clock that prices work (one with a
        charge method, as kvlab.slo.VirtualClock) is charged with the step's first."""
        charge = getattr(self._clock, "charge", None)
        if callable(charge):
            traffic = self.space.traffic
            c = outcome.counts
            charge(StepWork(tokens=c["prefill_tokens"] + c["decode_tokens"] + c["drafted"],
                            sequences=len(outcome.chunks), kv_rows_read=outcome.kv_rows_read,
                            swapped_bytes=traffic.out_bytes + traffic.in_bytes))
        return self._clock()

    def _forward(self, plan: ScheduledStep, outcome: _Outcome, held: HeldCtrlC) -> None:
        """The step's forward: one forward_batch, or for a step of more than about
        CHUNK_FLOPS of work, several calls of about that much each (_next_call), each
        going on from the rows the pool holds. A Ctrl-C held is taken between them, and one
        during a call of more than measure.CHUNK_FLOPS (CHUNK_MIN tokens at a long context)
        stops it (_call): _Stopped, the rest left for the step's next run."""
        if not outcome.chunks:
            outcome.chunks = [_split(seq, n) for _, seq, n in plan.items]
        while True:
            feeds = self._feeds(plan, outcome)
            if not feeds:
                return
            call = _next_call(feeds, self._rates)
            # the C core looks for Ctrl-C between the layers of a call of more than its
            # KV_CHUNK_FLOPS (measure's, not the CHUNK_FLOPS tests may shrink here), and
            # gives back all the call reserved if it stops: let one through then
            long = sum(_work(f, self._rates) for f in call) > measure.CHUNK_FLOPS
            with held.raising(_Stopped) if long else contextlib.nullcontext():
                self._call(call, outcome)
            if sum(len(f.tokens) for f in call) == sum(len(f.tokens) for f in feeds):
                return                        # that was all: the step goes on to its end
            if held.take():
                raise _Stopped()

    def _feeds(self, plan: ScheduledStep, outcome: _Outcome) -> List["_Feed"]:
        """What each item of the plan has still to feed, from the rows its handle holds on:
        all it was planned, or what is left after a call that raised or a call before (a
        chunk that ends the sequence's tokens feeds at least the last, whose logits choose
        the next token; it keeps its last row of logits, with drafts that row, then one per
        draft, to choose from)."""
        feeds = []
        for i, ((request, seq, _), (own, drafts)) in enumerate(zip(plan.items, outcome.chunks)):
            if i in outcome.rows or request.id in outcome.failed:   # (run again: done)
                continue
            if seq.handle is None:            # freed by a step that raised after its choice
                self.space.renew(seq)
            end, length = seq.computed + own, seq.handle.length
            if end < len(seq.tokens):             # part of a prompt: no logits needed
                outcome.computed[seq] = end
                tokens = seq.tokens[length:end]
            else:                                 # its last token's logits choose the next:
                if length >= end:                 # it is fed in this call, whatever a call
                    self.pool.truncate(seq.handle, end - 1)   # that raised had written
                    length = end - 1
                tokens = seq.tokens[length:] + drafts
            if tokens:
                feeds.append(_Feed(i, seq.handle, tokens, length, end == len(seq.tokens),
                                   len(drafts)))
        return feeds

    def _call(self, call: List["_Feed"], outcome: _Outcome) -> None:
        """One forward_batch over the feeds of `call`; the rows that choose kept."""
        drafted = any(feed.drafts for feed in call)
        handles, fed = [feed.handle for feed in call], [feed.tokens for feed in call]
        if drafted:         # every token's logits: the drafts' rows check them
            logits = self.model.forward_batch(handles, fed, all_logits=True)
        else:
            logits = self.model.forward_batch(handles, fed)
        outcome.kv_rows_read += sum(_rows_read(f.length, len(f.tokens)) for f in call)
        # one NaN test for all rows; with drafts, each row read (most of all_logits are not)
        last = 0
        for feed in call:
            last += len(feed.tokens) if drafted else 1
            if feed.chooses:
                n = feed.drafts
                outcome.rows[feed.item] = logits[last - 1 - n:last] if n else logits[last - 1]

    def _choose(self, plan: ScheduledStep, number: int, outcome: _Outcome) -> None:
        """Each chunk that ended its tokens chooses the next (at the end of a prompt with
        n > 1, the request first forks into its other sequences, which choose from the same
        logits); then the pool follows: the refused drafts' rows are cut off and finished
        or failed sequences freed. A request whose token cannot be chosen fails alone."""
        ready: List[Tuple[Request, EngineSequence, np.ndarray, List[int]]] = []
        for i, rows in outcome.rows.items():
            request, lead, _ = plan.items[i]
            ready.append((request, lead, rows, outcome.chunks[i][1]))
            if not request.forked and request.params.n > 1 and lead.index == 0:
                for other in request.sequences[1:]:
                    if other.handle is None:
                        self.space.make(other, self.pool.fork, lead.handle)
                    ready.append((request, other, rows, []))
                outcome.forked.add(request)
        for request, seq, rows, drafts in ready:
            if seq in outcome.chosen or request.id in outcome.failed:
                continue
            try:
                outcome.chosen[seq] = self._choose_one(request, seq, rows, drafts)
            except Exception as error:        # this request alone fails
                outcome.failed[request.id] = _why(number, error)
        self._follow(outcome)

    def _follow(self, outcome: _Outcome) -> None:
        """The pool after the choices: one row per token fed (every token but the newest
        chosen), finished and failed sequences freed."""
        for rid in outcome.failed:                     # failed in the plan or the run
            self.space.release(self.requests[rid])
        for seq, choice in outcome.chosen.items():
            if choice.request.id in outcome.failed:
                continue
            if seq.handle is not None and seq.handle.alive:
                rows = len(seq.tokens) - 1 + len(choice.kept) + (choice.stop == "eos")
                if seq.handle.length > rows:  # first the cut: refused drafts are not cached
                    self.pool.truncate(seq.handle, rows)
                outcome.computed[seq] = rows
            if choice.stop is not None:
                self.space.drop(seq)

    def _choose_one(self, request: Request, seq: EngineSequence, rows: np.ndarray,
                    drafts: List[int]) -> _Choice:
        """The sequence's next token from its logits row, or with drafts the tokens plain
        decoding would have chosen (kvlab.generate's rules), drawn from a copy of its
        random generator. Raises if no token can be chosen (the sampler and verify_drafts
        refuse logits that hold NaN)."""
        p, rng = request.params, None
        if p.temperature > 0.0:
            rng = self._rng
            rng.bit_generator.state = seq.rng_state
        checked = len(drafts) if rows.ndim == 2 else None
        if checked is None:
            accepted, token = 0, sample_token(rows, p.temperature, p.top_k, p.top_p, rng)
        else:
            q = None if seq.q is None else seq.q[:len(drafts)]
            sampling = (p.temperature, p.top_k, p.top_p, rng)
            accepted, token = verify_drafts(rows, drafts, q, sampling)
        if not 0 <= token < self._vocab_size:
            raise ValueError(f"the sampler chose token {token}, outside [0, {self._vocab_size})")
        eos = self._eos if p.stop_at_eos else None
        room = p.max_new_tokens - (len(seq.tokens) - seq.prompt_len)
        if checked is None:                    # one token: keep_until_stop's rule, inline
            kept, stop = ([], "eos") if token == eos else ([token], "length" if room == 1 else None)
        else:
            kept, stop = keep_until_stop(drafts[:accepted] + [token], eos, room)
        return _Choice(request, kept, stop, None if rng is None else rng.bit_generator.state,
                       checked, accepted)

    # ---- speculative decoding: the plan's drafts -----------------------------------------
    def _propose(self, step: int) -> Dict[int, str]:
        """Drafts for every running sequence about to decode (its newest token is the only
        one to feed) that has none for its current tokens yet, proposed first and then kept
        on the sequences, where they wait until checked (through a preemption too). A
        drafter that raises or proposes junk fails its request alone: returns those, for the
        plan to leave out, the run to free and the commit to mark (the step may yet not
        happen)."""
        if self.speculate is None:
            return {}
        proposals, failed = [], {}
        for request in self.scheduler.running:
            for seq in request.active():
                if (seq.handle is None or seq.pending != 1 or not seq.outputs
                        or seq.drafted_after == len(seq.tokens)):
                    continue
                try:
                    proposals.append((seq, *self._propose_one(request, seq)))
                except Exception as error:
                    failed[request.id] = _why(step, error)
                    break
        for seq, drafts, q, rng_state, passes in proposals:
            seq.drafts, seq.q, seq.rng_state = drafts, q, rng_state
            seq.drafted_after = len(seq.tokens)
            seq.stats.draft_passes += passes
        return failed

    def _propose_one(self, request: Request, seq: EngineSequence) -> tuple:
        """kvlab.speculative's rules: at most draft_tokens, none that could not be kept
        before max_new_tokens; a DraftModel samples its drafts from a copy of the sequence's
        generator when the request samples. Returns (drafts, q, new generator state, the
        drafter's forward passes)."""
        p = request.params
        if seq.drafter is None:
            spawn = getattr(self.speculate, "spawn", None)
            seq.drafter = spawn() if callable(spawn) else self.speculate
        self._rng.bit_generator.state = seq.rng_state
        passes = getattr(seq.drafter, "passes", 0)
        context = list(seq.tokens)        # the drafter's own copy, as generate gives it
        drafts, q = propose_drafts(seq.drafter, context, self.draft_tokens,
                                   p.max_new_tokens - len(seq.outputs),
                                   (p.temperature, p.top_k, p.top_p, self._rng), self._vocab_size)
        return (drafts, q, self._rng.bit_generator.state,
                getattr(seq.drafter, "passes", 0) - passes)

    # ---- commit -----------------------------------------------------------------------
    def _commit(self, plan: ScheduledStep, outcome: _Outcome, number: int,
                started: float) -> StepResult:
        """The step's results, assigned: nothing here calls into the pool or out of kvlab."""
        counts = outcome.counts
        new_tokens: Dict[int, List[int]] = {}
        for seq, computed in outcome.computed.items():
            seq.computed = computed
        for request in outcome.forked:
            request.forked = True
        accepted, stopped = 0, set()     # stopped: requests a sequence of which stopped
        for seq, choice in outcome.chosen.items():
            request = choice.request
            if request.id in outcome.failed:
                continue
            seq.tokens.extend(choice.kept)
            new_tokens.setdefault(request.id, []).extend(choice.kept)
            if choice.rng_state is not None:
                seq.rng_state = choice.rng_state
            if choice.stop is not None:
                seq.finished, seq.finish_reason = True, choice.stop
                seq.forget_handle()
                stopped.add(request)
            if seq.stats is not None:
                _count_pass(seq.stats, choice)
            accepted += choice.accepted
            if choice.kept and request.first_token_at is None:
                request.first_token_at = outcome.now
        for rid, why in outcome.failed.items():
            _fail(self.requests[rid], why)
            stopped.add(self.requests[rid])
        finished = self._retire(stopped, outcome.now)
        self.scheduler.step_count += 1
        stats, swapped = outcome.stats, self.space.traffic
        result = StepResult(step=number, batch_size=len(plan.items), **counts,
                            blocks_used=stats.blocks_used, blocks_free=stats.blocks_free,
                            blocks_cached=stats.blocks_cached,
                            preemptions=len(plan.preempted),
                            prefix_hit_tokens=plan.prefix_hit_tokens,
                            admitted=[r.id for r in plan.admitted], finished=finished,
                            new_tokens=new_tokens, seconds=time.perf_counter() - started,
                            failed=dict(outcome.failed), accepted=accepted,
                            swapped_out_blocks=swapped.out_blocks,
                            swapped_out_bytes=swapped.out_bytes,
                            swapped_in_blocks=swapped.in_blocks,
                            swapped_in_bytes=swapped.in_bytes,
                            kv_rows_read=outcome.kv_rows_read)
        self.metrics.append(result)
        return result

    def _retire(self, stopped: Set[Request], now: float) -> List[int]:
        """The requests of `stopped` whose sequences are now all done leave (the run freed
        them); returns their ids, in running order."""
        finished = []
        for request in [r for r in self.scheduler.running if r in stopped]:
            if request.finished:
                request.finished_at = now
                self.scheduler.finish(request)
                finished.append(request.id)
                for seq in request.sequences:     # a DraftModel's cache is not needed now
                    seq.drafter, seq.swapped, seq.handle = None, None, None
        return finished

    def _trace(self, step: int) -> None:
        if self._tracer is not None:
            self._tracer.record(step, self._phase)

    # ---- all of it --------------------------------------------------------------------
    def run(self, progress: bool = True) -> Dict[int, RequestOutput]:
        """Step until every request is finished; returns their outputs by request id.
        Never loops without progress: see step()."""
        bar = None
        if progress:
            from tqdm.auto import tqdm
            # a run resumed after a Ctrl-C starts from the tokens already chosen
            going_on = [r for r in self.requests.values() if r.state is not State.FINISHED]
            bar = tqdm(total=sum(r.params.max_new_tokens * r.params.n for r in going_on),
                       initial=sum(len(s.outputs) for r in going_on for s in r.sequences),
                       desc="engine", unit="tok")
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
            if self._tracer is not None:
                self._tracer.flush()
        return self.outputs

    def _why_stuck(self) -> str:
        stats = self.pool.stats()
        return (f"the engine cannot make progress: {len(self.scheduler.waiting)} requests "
                f"wait and none runs, but the pool has only {self.pool.available_blocks} "
                f"blocks to give and {self.pool.max_seqs - self.pool.live_sequences} sequences "
                f"left ({stats.n_sequences} sequences made outside the engine hold "
                f"{stats.blocks_used} blocks); free them, or give the engine a pool of its own")

    def _swapped_bytes(self) -> int:
        """Host memory the sequences' swapped-out K and V hold now (only waiting requests
        hold copies: admission and the end drop them)."""
        return sum(s.swapped.nbytes for r in self.scheduler.waiting for s in r.sequences
                   if s.swapped is not None)

    @property
    def outputs(self) -> Dict[int, RequestOutput]:
        """Every finished request's output, by id (failed ones too: see each sequence's
        finish_reason). Asking for one not finished yet raises a KeyError that says so."""
        done = FinishedOutputs({rid: r.state for rid, r in self.requests.items()})
        for request in self.requests.values():
            if request.state is State.FINISHED:
                done[request.id] = request_output(request, self.model, self.draft_tokens)
        return done

    @property
    def speculation(self) -> Optional[SpeculationStats]:
        """With speculate=: what speculation did so far, every request's sequences added up
        (finished or not); None without."""
        if self.speculate is None:
            return None
        return SpeculationStats.total([s.stats for r in self.requests.values()
                                       for s in r.sequences], self.draft_tokens)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the trace file, if trace= named one (also done by `with Engine(...)`)."""
        if self._tracer is not None:
            self._tracer.close()


def _plugins(speculate, drafter, scheduler) -> tuple:
    """Engine(drafter=) is speculate= under the plug-in's name; a scheduler plug-in checked
    for its method. Returns (the drafter, the scheduler plug-in)."""
    if drafter is not None:
        if speculate is not None:
            raise TypeError("give a drafter as drafter= or speculate=, not both")
        speculate = drafter
    if scheduler is not None:
        check_scheduler(scheduler)
    return speculate, scheduler


@dataclasses.dataclass
class _Feed:
    """The tokens one item of a step feeds in one forward call, after `length` rows."""
    item: int                # its index in the plan
    handle: object
    tokens: List[int]
    length: int
    chooses: bool            # its last token ends the sequence's (then its drafts follow)
    drafts: int


def _next_call(feeds: List[_Feed], rates: Tuple[float, float]) -> List[_Feed]:
    """The feeds of the next forward call: whole ones, in order, while they fit in about
    CHUNK_FLOPS of work (measure.work_rates), then part of the next one, at least CHUNK_MIN
    tokens in all (a shorter call streams every weight for fewer tokens). A part never
    holds a feed's last own token (nor its drafts): those ride in one call, whose logits
    choose. All of them when they fit: the one call of a short step."""
    per_token, per_position = rates
    call, work, n_call = [], 0.0, 0
    for feed in feeds:
        n = len(feed.tokens)
        cost = _work(feed, rates)
        # a whole feed joins while the call is short of CHUNK_MIN tokens, whatever its
        # work: a decode step's one-token feeds cannot be cut, and a call of fewer tokens
        # streams every weight for fewer (32 sequences of a 135M model made five calls)
        if work + cost <= CHUNK_FLOPS or n_call + n <= CHUNK_MIN:
            call.append(feed)
            work, n_call = work + cost, n_call + n
            continue
        # it does not fit whole: the part that does (each token priced at the last's position)
        fits = int((CHUNK_FLOPS - work) / (per_token + per_position * (feed.length + n)))
        most = n - 1 - feed.drafts if feed.chooses else n
        cut = min(max(fits, CHUNK_MIN - n_call), most)
        if cut > 0:
            whole = cut == n
            call.append(dataclasses.replace(feed, tokens=feed.tokens[:cut], chooses=feed.chooses
                                            and whole, drafts=feed.drafts if whole else 0))
        elif not call:                     # nothing of it may be cut off: it goes whole
            call.append(feed)
        break
    return call


def _work(feed: _Feed, rates: Tuple[float, float]) -> float:
    """A feed's FLOPs by the chunk rule's measure (measure.work_rates), as the C core
    prices a pass: each token at its own position."""
    per_token, per_position = rates
    n = len(feed.tokens)
    return n * per_token + per_position * _rows_read(feed.length, n)


def _split(seq: Sequence, n: int) -> Tuple[int, List[int]]:
    """A scheduled item of n tokens: how many of the sequence's own tokens it feeds, and
    when they are all it has left, the drafts after them (n - own of them)."""
    own = min(n, seq.pending)
    return own, (seq.live_drafts[:n - own] if n > own else [])


def _counts(plan: ScheduledStep, chunks: List[Tuple[int, List[int]]]) -> dict:
    """StepResult's token counts for the plan's items (before the commit moves them on)."""
    prefill = decode = drafted = recomputed = 0
    for (_, seq, _), (own, drafts) in zip(plan.items, chunks):
        if seq.pending == 1 and seq.computed >= seq.prompt_len:
            decode += 1
        else:
            prefill += own
        drafted += len(drafts)
        if seq.computed < seq.computed_before:
            recomputed += min(seq.computed + own, seq.computed_before) - seq.computed
    return dict(prefill_tokens=prefill, decode_tokens=decode, drafted=drafted,
                recomputed_tokens=recomputed)


def _rows_read(length: int, n: int) -> int:
    """K/V rows read by the attention of n tokens fed after `length` rows: the token at
    position p reads p + 1 rows (the Engine rolls no sliding window)."""
    return n * length + n * (n + 1) // 2


def _count_pass(stats: SpeculationStats, choice: _Choice) -> None:
    """A sequence's speculation counters after one of its passes."""
    chosen = len(choice.kept) + (choice.stop == "eos")    # an EOS token is chosen, not kept
    if choice.checked is None:                   # a pass with no drafts to check
        stats.verify_passes += stats.tokens > 0  # (the first token is the prompt's)
    else:
        stats.count_pass(choice.checked, choice.accepted)
    stats.tokens += chosen


def _why(step: int, error: Exception) -> str:
    return f"error: step {step}: {type(error).__name__}: {error}"


def _fail(request: Request, why: str) -> None:
    for s in request.sequences:
        if not s.finished:
            s.finished, s.finish_reason = True, why
