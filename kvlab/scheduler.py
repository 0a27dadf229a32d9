"""The batching scheduler: which requests run in the next step, and with how many tokens.

Plain Python bookkeeping, no tensors: it decides, the engine (kvlab.engine) carries it
out on the paged pool and the C core. It never imports the compiled module, so it can be
read, tested and replayed on its own (tests/test_scheduler.py drives it with a pool made of
Python lists).

A step is planned first, then carried out. Scheduler.plan is a pure function of the queues,
the sequences and the pool's counts (BlockSpace's questions); it changes nothing:
  1. Running requests, oldest admission first, each sequence gets its next tokens: one to
     decode, or the next chunk of a prompt (chunked prefill), within a per-step token
     budget (max_batch_tokens). If the pool cannot hold a sequence's new tokens, the most
     recently admitted running request is to be preempted: its blocks are counted free and
     it will go back to the front of the waiting queue, to be recomputed later (preemption
     by recompute), or, with Scheduler(preemption="swap"), its K and V will be copied to
     host memory first and back into fresh blocks when it is admitted again (preemption by
     swapping: bytes moved instead of tokens run through the model again).
  2. If nothing is to be preempted, waiting requests are admitted in arrival order while
     the budget lasts and the pool has blocks for their first chunk (counted once, as if
     nothing were in the prefix cache).
  3. With speculative decoding, a sequence's draft tokens (guesses of its next tokens,
     Sequence.drafts) ride on the chunk that ends its tokens, as many as the budget and the
     blocks left over allow: guesses come after all certain work and never preempt.
Running requests `leaving` at the end of the step (the engine's: failed while it planned)
are neither scheduled nor preempted.
Scheduler.apply then carries out the plan's preemptions and admissions on the pool (the
engine calls it in the step's run phase). Admission searches the prefix cache: tokens found
there are not computed, and the admitted chunk shrinks by them; if the blocks the search took
out of the cache leave too little room, the admission is undone (the request stays first in
line). apply may be called again after it was interrupted: it goes on from where the queues
and the pool are (a preemption moves the request to the waiting queue before it frees its
sequences; BlockSpace.start gives sequences only to those that have none).
Scheduler.schedule(space) is plan then apply, for a driver of its own (the tests).

A request asks for n samples (SamplingParams.n), each a Sequence. It starts as one
sequence; when its prompt is done, the engine forks it into n, which share the prompt's
blocks (copy on write). A preempted request keeps the tokens it generated; each of its
sequences is recomputed as its own (prompt + outputs) when it is admitted again, or swapped
back in as its own.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Collection, Deque, Dict, List, Optional, Protocol, Tuple


from . import arguments
from .blocks import blocks_for
from .deprecation import renamed, renamed_attribute
from .sampling import MIN_TEMPERATURE, check_sampling_args, check_seed  # noqa: F401 (MIN_TEMPERATURE re-exported)


@dataclasses.dataclass(frozen=True, init=False)
class SamplingParams:
    """How to generate for one request (the same rules and names as kvlab.generate).
    max_new_tokens is the length limit, what vLLM's SamplingParams calls max_tokens: the
    old spelling SamplingParams(max_tokens=...) still works, with a DeprecationWarning."""
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None      # sequence i draws from np.random.default_rng(seed + i)
    n: int = 1                      # samples of one prompt, sharing its blocks
    stop_at_eos: bool = True

    def __init__(self, max_new_tokens: Optional[int] = None, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, n: int = 1, stop_at_eos: bool = True, *,
                 max_tokens: Optional[int] = None):
        if max_tokens is not None:               # the name before the API had one word
            if max_new_tokens is not None:
                raise TypeError("give max_new_tokens only (max_tokens is its old name)")
            renamed("SamplingParams(max_tokens=...)", "SamplingParams(max_new_tokens=...)")
            max_new_tokens = max_tokens
        values = {"max_new_tokens": 16 if max_new_tokens is None else max_new_tokens,
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                  "n": n, "stop_at_eos": stop_at_eos}
        for name in ("max_new_tokens", "n"):
            values[name] = arguments.positive(values[name], name)
        check_sampling_args(temperature, top_k, top_p)   # incl. MIN_TEMPERATURE
        values["seed"] = check_seed(seed)
        values["stop_at_eos"] = arguments.flag(stop_at_eos, "stop_at_eos")
        for name, value in values.items():
            object.__setattr__(self, name, value)   # frozen: set once, here, once checked

    def __setstate__(self, state: dict) -> None:
        """Unpickling, also of a SamplingParams pickled when the length limit was called
        max_tokens (its value is kept, under the new name)."""
        state = dict(state)
        if "max_tokens" in state:
            state.setdefault("max_new_tokens", state.pop("max_tokens"))
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def max_tokens(self) -> int:
        renamed("SamplingParams.max_tokens", "SamplingParams.max_new_tokens")
        return self.max_new_tokens


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class HostCopy(Protocol):
    """A sequence's K and V swapped out to host memory (kvlab.SwappedSequence)."""
    length: int                     # the tokens they hold


@dataclasses.dataclass(eq=False)      # compared by identity: two sequences are never "equal"
class Sequence:
    """One generated sequence of a request (one of its n samples): its tokens so far, and
    how many of them have K and V in the pool (`computed`). Its K and V rows live in the
    pool under `handle`, the pool's own object for them (a kvlab.PagedSequence: the pool
    calls it a sequence too, as the C core's kv_pool does). The engine's own state for it
    (random generator, drafter) is kvlab.engine's subclass."""
    index: int
    tokens: List[int]               # prompt, then the generated tokens
    prompt_len: int
    computed: int = 0               # 0 while waiting, unless swapped (below)
    handle: Optional[object] = None  # its K and V rows in the pool (kvlab.PagedSequence);
                                    # None while waiting (and before its request forks)
    finished: bool = False
    finish_reason: str = ""         # "length", "eos", or "error: step N: why"
    drafts: List[int] = dataclasses.field(default_factory=list)   # guesses of the tokens
    drafted_after: int = -1         # after tokens[:drafted_after]: they count while no
                                    # token has been added since (see live_drafts)
    swapped: Optional[HostCopy] = None   # while preempted by swapping: its K and V in host
                                    # memory, which `computed` then counts
    computed_before: int = 0        # the most tokens it had computed before a preemption
                                    # dropped their K and V (stats: computing them again
                                    # is what preemption by recompute costs)

    @property
    def outputs(self) -> List[int]:
        return self.tokens[self.prompt_len:]

    @property
    def live_drafts(self) -> List[int]:
        """The drafts proposed after the sequence's current tokens (none once a token has
        been added since they were proposed)."""
        return self.drafts if self.drafted_after == len(self.tokens) else []

    @property
    def pending(self) -> int:
        """Tokens whose K and V are still to be computed (the last one is fed next)."""
        return len(self.tokens) - self.computed

    def forget_handle(self) -> None:
        """Its handle is gone (freed, or swapped out): no K and V in the pool.
        `computed` counts the tokens whose K and V wait in host memory (swapped), which
        come back when it is admitted again; without a host copy, none."""
        self.handle = None
        self.computed = 0 if self.swapped is None else self.swapped.length

    seq = renamed_attribute("Sequence", "seq", "handle")   # its name before issue 36


def __getattr__(name: str):
    if name == "Sample":            # the name before issue 36 (beside the verb "sample")
        renamed("kvlab.scheduler.Sample", "kvlab.scheduler.Sequence")
        return Sequence
    if name == "positive_int":      # issue 35 moved the checks to kvlab.arguments
        renamed("kvlab.scheduler.positive_int(name, value)",
                "kvlab.arguments.positive(value, name)")
        return lambda name, value: arguments.positive(value, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    prompt: List[int]
    params: SamplingParams
    arrival: int                    # order of add_request
    sequences: List[Sequence] = dataclasses.field(default_factory=list)   # its n of them
    state: State = State.WAITING
    preemptions: int = 0
    forked: bool = False            # n > 1 and its n sequences are apart in the pool
    # when, on the engine's clock (seconds): it arrived, its first token was chosen, it left
    arrived: float = 0.0
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None

    def active(self) -> List[Sequence]:
        """Sequences that still generate and have (or will get) a handle of their own."""
        return [s for s in self.sequences if not s.finished and (self.forked or s.index == 0)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    samples = renamed_attribute("Request", "samples", "sequences")   # before issue 36


class BlockSpace(Protocol):
    """What the scheduler needs from a paged pool (kvlab.engine wires it to the real one).
    The first four only ask; start, release and swap_out change the pool (Scheduler.apply)."""

    def available(self) -> int:
        """Blocks that can be handed out now: free, or cached and evictable."""

    def needed(self, seq: Sequence, n_tokens: int) -> int:
        """Blocks the sequence takes to grow by n_tokens (copy-on-write included); without a
        handle, the blocks of its first `computed` + n_tokens tokens."""

    def freed(self, request: Request) -> int:
        """Blocks that release(request) would make available (those no other sequence uses)."""

    def sequences_left(self) -> int:
        """How many more sequences the pool can hold."""

    def start(self, request: Request) -> int:
        """Give the request's active sequences that have none a handle (a new pool
        sequence, using the prefix cache, or a host copy swapped back in); returns the
        tokens found in the cache, which each then need not compute. Blocks found in the
        cache are taken out of it, so available() may drop."""

    def release(self, request: Request) -> None:
        """Free the handles of the request's sequences (their full blocks stay cached);
        safe to repeat. Host copies of swapped sequences stay."""

    def swap_out(self, request: Request) -> None:
        """Only for Scheduler(preemption="swap"): copy the K and V of each active sequence
        to host memory (seq.swapped) and free its handle. One it cannot resume from a
        copy is left alone (release() frees it; it is recomputed). start() swaps the
        copies back in (and counts them as no prefix hits)."""


@dataclasses.dataclass
class ScheduledStep:
    """The scheduler's plan for one step (and, once applied, what it did)."""
    items: List[Tuple[Request, Sequence, int]]   # (request, sequence, n_tokens) to run, in
                                                 # batch order (n_tokens: its drafts included)
    admitted: List[Request] = dataclasses.field(default_factory=list)
    preempted: List[Request] = dataclasses.field(default_factory=list)
    hits: Dict[int, int] = dataclasses.field(default_factory=dict)   # request id -> tokens
                                                 # its admission found in the prefix cache
    put_back: List[Request] = dataclasses.field(default_factory=list)   # admissions undone

    @property
    def n_tokens(self) -> int:
        return sum(n for _, _, n in self.items)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(self.hits.get(r.id, 0) for r in self.admitted)


PREEMPTION_MODES = ("recompute", "swap")   # what a preempted request's K and V become


class Scheduler:
    """Waiting and running queues, a token budget per step, admission by free blocks,
    chunked prefill and preemption by recompute or by swapping (see the module text)."""

    def __init__(self, block_size: int, max_batch_tokens: int = 256, max_batch_seqs: int = 64,
                 preemption: str = "recompute"):
        self.block_size = arguments.positive(block_size, "block_size")
        self.max_batch_tokens = arguments.positive(max_batch_tokens, "max_batch_tokens")
        self.max_batch_seqs = arguments.positive(max_batch_seqs, "max_batch_seqs")
        if preemption not in PREEMPTION_MODES:
            choices = " or ".join(repr(mode) for mode in PREEMPTION_MODES)
            raise ValueError(f"preemption must be {choices}, got {preemption!r}")
        self.preemption = preemption
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []        # in order of admission
        self.step_count = 0
        # waiting requests that may hold pool sequences: apply() preempts or admits them
        # until the pool calls are done (an error may stop it half way)
        self.holding: Dict[int, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """The request is done (finished or failed): it leaves whichever queue holds it."""
        request.state = State.FINISHED
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, space: BlockSpace) -> ScheduledStep:
        """Plan one step and carry out its preemptions and admissions (plan, then apply)."""
        step = self.plan(space)
        self.apply(step, space)
        self.step_count += 1
        return step

    # [quote ch05-scheduler-schedule]
    def plan(self, space: BlockSpace, leaving: Collection[int] = ()) -> ScheduledStep:
        step = ScheduledStep(items=[])
        budget, room = self.max_batch_tokens, space.available()   # room: blocks not promised
        reserved: Dict[int, int] = {}    # blocks each request's scheduled items will take
        for request in self.running:
            if request in step.preempted or request.id in leaving:   # (by this loop, or failed)
                continue
            for seq in request.active():
                take = min(seq.pending, budget)
                if take == 0 or len(step.items) >= self.max_batch_seqs:
                    continue                          # no room this step; it waits its turn
                need = space.needed(seq, take)
                while need > room:
                    victim = [r for r in self.running                             # the newest
                              if r not in step.preempted and r.id not in leaving][-1]
                    step.preempted.append(victim)
                    room += space.freed(victim) + reserved.pop(victim.id, 0)
                    budget += sum(n for r, _, n in step.items if r is victim)
                    step.items = [item for item in step.items if item[0] is not victim]
                    if victim is request:
                        break
                if request in step.preempted:
                    break
                step.items.append((request, seq, take))
                reserved[request.id] = reserved.get(request.id, 0) + need
                room -= need
                budget -= take
        if not step.preempted:
            budget, room = self._admit(space, step, budget, room)
        self._add_drafts(space, step, budget, room)
        return step
    # [end ch05-scheduler-schedule]

    def _add_drafts(self, space: BlockSpace, step: ScheduledStep, budget: int,
                    room: int) -> None:
        """Lengthen each scheduled chunk that ends its sequence's tokens by its drafts, as
        many as the budget and the blocks still unreserved (`room`) allow, in batch order.
        Drafts are guesses: they take what is left, and a sequence with none (or no room
        for them) runs as it would without speculation."""
        for i, (request, seq, take) in enumerate(step.items):
            drafts = seq.live_drafts
            if not drafts or take != seq.pending or budget == 0:
                continue
            base = space.needed(seq, take)
            extra = min(len(drafts), budget)
            while extra > 0:
                more = space.needed(seq, take + extra) - base
                if more <= room:
                    break
                extra -= 1
            if extra > 0:
                step.items[i] = (request, seq, take + extra)
                room -= more
                budget -= extra

    def _admit(self, space: BlockSpace, step: ScheduledStep, budget: int,
               room: int) -> Tuple[int, int]:
        """Plans the admission of waiting requests (see the module text); returns the
        budget and the blocks left after them."""
        if not self.waiting:
            return budget, room
        # every sample will be a sequence of its own (a fresh request forks into n), and
        # running requests that have not forked yet will need their slots too
        slots = space.sequences_left() - sum(r.params.n - 1 for r in self.running
                                             if not r.forked)
        for request in self.waiting:
            seqs = request.active()
            # a request with more sequences than a batch holds (forked, then preempted) is
            # admitted into an empty batch; its sequences then take turns, as running ones do
            if budget == 0 or (step.items and len(step.items) + len(seqs) > self.max_batch_seqs):
                break
            needs = len(seqs) if request.forked else request.params.n
            if slots < needs:
                break
            items, need, left = [], 0, budget
            for seq in seqs:
                take = min(seq.pending, left)
                if take > 0 and len(step.items) + len(items) < self.max_batch_seqs:
                    items.append((request, seq, take))
                    left -= take
                else:                 # no chunk this step, but a swapped-out one comes back
                    take = 0          # into blocks of its own all the same
                need += space.needed(seq, take)    # the blocks, counted once
            if need > room:
                break
            step.admitted.append(request)
            step.items.extend(items)
            slots, room, budget = slots - needs, room - need, left
        return budget, room

    # ---- carrying a plan out --------------------------------------------------------------
    def apply(self, step: ScheduledStep, space: BlockSpace) -> None:
        """Carry out the plan's preemptions, then its admissions. Called again after an
        interruption, it goes on from where the queues and the pool are. A waiting request
        that an error left holding pool sequences (a step that raised during its preemption
        or admission) gives them back first, unless this plan admits it."""
        for request in list(self.holding.values()):
            if request not in step.admitted and request not in step.preempted:
                self._put_back(request, space)
        for victim in step.preempted:
            self.holding[victim.id] = victim
            self.preempt(victim, space)
            del self.holding[victim.id]
        for i, request in enumerate(step.admitted):
            if request.state is State.RUNNING:       # admitted before an interruption
                continue
            self.holding[request.id] = request
            if not self._start(request, step, space):
                step.put_back = step.admitted[i:]     # they stay first in line, in order
                step.items = [item for item in step.items if item[0] not in step.put_back]
                del step.admitted[i:]
                break
            for seq in request.sequences:            # back in the pool: copies not needed
                seq.swapped = None
            self.waiting.remove(request)
            request.state = State.RUNNING
            self.running.append(request)
            del self.holding[request.id]
        for request in step.put_back:
            self._put_back(request, space)

    def _put_back(self, request: Request, space: BlockSpace) -> None:
        """A waiting request gives back the pool sequences it holds (host copies stay, for
        next time)."""
        space.release(request)
        for seq in request.sequences:
            seq.forget_handle()
        self.holding.pop(request.id, None)

    def _start(self, request: Request, step: ScheduledStep, space: BlockSpace) -> bool:
        """Admit one planned request into the pool: its chunks shrink by what the prefix
        cache held. False if its chunks no longer fit beside those of the requests running
        (the plan counted its blocks before the cache search, which may have taken cached
        blocks out of the available ones)."""
        step.hits[request.id] = space.start(request)
        for i, (r, seq, n) in enumerate(step.items):
            if r is request:                           # its tokens (then its drafts), as planned
                own = min(n, len(seq.tokens) - (seq.swapped.length if seq.swapped else 0))
                step.items[i] = (r, seq, min(own, seq.pending) + n - own)
        mine = sum(space.needed(s, n) for r, s, n in step.items if r is request)
        running = sum(space.needed(s, n) for r, s, n in step.items if r.state is State.RUNNING)
        return mine <= space.available() - running

    # [quote ch05-scheduler-preempt]
    def preempt(self, request: Request, space: BlockSpace) -> None:
        """Send a running request back to the front of the waiting queue, its sequences
        freed, to be recomputed (prompt + what it generated) when admitted again; with
        preemption="swap", each sequence's K and V go to host memory first and come back
        on admission. The queues change first; called again after an interruption, it
        frees what is left."""
        if request in self.running:
            self.running.remove(request)
            request.state = State.WAITING
            self.waiting.appendleft(request)
            request.preemptions += 1
            request.forked = request.forked or any(s.outputs for s in request.sequences)
        if self.preemption == "swap":
            space.swap_out(request)
        for seq in request.sequences:
            if seq.swapped is None:                # its K and V are about to be dropped
                seq.computed_before = max(seq.computed_before, seq.computed)
        space.release(request)
        for seq in request.sequences:
            seq.forget_handle()
    # [end ch05-scheduler-preempt]



def requests_fit(prompt_len: int, params: SamplingParams, block_size: int, num_blocks: int,
                 max_blocks_per_seq: int) -> Optional[str]:
    """Why a request could never run in this pool even alone, or None if it can. Its
    longest sequence holds prompt + max_new_tokens - 1 tokens (the last sampled token is
    never fed back), and after a preemption each seq is recomputed separately."""
    longest = blocks_for(prompt_len + params.max_new_tokens - 1, block_size)
    if longest > max_blocks_per_seq:
        return (f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                f"{longest} blocks of {block_size}, more than a sequence may hold "
                f"(max_blocks_per_seq={max_blocks_per_seq})")
    if params.n * longest > num_blocks:
        return (f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) for n={params.n} "
                f"samples needs up to {params.n * longest} blocks of {block_size}; the pool "
                f"has {num_blocks}")
    return None
