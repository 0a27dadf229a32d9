"""The places a student's own code plugs into kvlab.Engine, and the checks that keep the
engine correct whatever that code does.

    engine = kvlab.Engine(model, num_blocks=64,
                          scheduler=MyScheduler(),      # who runs each step, how many tokens
                          drafter=MyDrafter(),          # guesses of the next tokens
                          allocator=MyBlockAllocator)   # lab 5's class: checked block tables
    # or, instead of allocator=, prefix_cache=MyPrefixCache: which prefixes are cached

Every plug-in works on plain data (ints and lists) and is asked, never trusted: the engine
keeps its own queues, pool and tokens, checks each answer before it acts on it, and raises
PluginError, naming the plug-in and the rule broken, before the pool changes. So a plug-in
that returns nonsense stops the run with a clear message; it never corrupts the pool or
changes a token (greedy tokens stay exactly kvlab.generate's). The same calls can cross a
process boundary unchanged (the capstone's grader asks them of a worker process).

scheduler:  plan(view) -> StepPlan, where view is a SchedulerView (the step's budget, the
            free blocks and sequences, the running and waiting requests as RequestState
            records) and StepPlan says which requests run with how many tokens (a waiting
            one named there is admitted) and which running ones are preempted. The engine
            adds speculation's drafts after it, in what the plan left. Only for requests of
            one sample (SamplingParams.n == 1). StepPlan's max_drafts (None: no cap) caps
            the draft tokens added to the step in all, so that a plan can keep the step's
            cost down; drafts never change a token (greedy tokens stay kvlab.generate's).
drafter:    propose(tokens, k, sampling=None) -> at most k token ids likely to follow
            `tokens` (kvlab.speculative.Drafter; the same object as speculate=). Junk (ids
            out of range, not ints) fails the request whose drafts they were, alone, with
            finish_reason "error: ...".
allocator:  a class with lab 5's interface (BlockAllocator(num_blocks, block_size);
            new_sequence, append, fork, free, block_table, length, ref_count,
            num_free_blocks; and truncate(seq, length) where the engine speculates, to cut
            refused drafts off). The engine's pool (with no prefix cache) stays the one that
            holds K and V; the allocator is driven in step with it, every sequence made,
            grown, forked, cut or freed, and after every step its tables and free blocks
            must agree with the pool's.
prefix_cache: a class called with (block_size) whose object keeps which token prefixes
            the pool's prefix cache holds, told and asked on lists of ints:
              insert(tokens)  the cache now finds tokens (a whole number of blocks, its
                              last block new; every shorter such prefix was inserted first)
              remove(tokens)  it no longer finds them (evicted, or cut by a truncate;
                              every longer prefix through them was removed first)
              match(tokens)   -> how many leading tokens of a context being admitted (a
                              prompt, or a preempted request's prompt and tokens so far)
                              the engine reuses from the cache: the longest inserted
                              prefix, whole blocks, at most len(tokens) - 1 (the last
                              token is always run: its logits choose the next)
            The pool's cache (C) stays the one that decides; the plug-in is driven beside
            it (PrefixMirror): before a step's admissions change the pool, it is told what
            the cache gained and lost (pool.prefix_parents, a lookup-only view) and asked
            match() for each admitted context, and an answer that is not the pool's stops
            the step (PluginError) before the pool changes. (With preemption="swap", a
            swap-in in the same step may change what the pool finds after the check.) It
            needs the pool's own cache, so it does not go with allocator= (whose pool
            caches nothing).
Written on plain values (the capstone lab's, or one in another process): PlainScheduler
and PlainDrafter adapt a plan(dict) -> dict and a propose(list, k) to the above.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import arguments
from .blocks import blocks_for
from .scheduler import ScheduledStep, Scheduler


class PluginError(ValueError):
    """A plug-in answered something the engine cannot do (which plug-in, which rule)."""


# ---- the scheduler ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestState:
    """One request as a scheduler plug-in sees it (n == 1: one sequence)."""
    id: int
    arrival_time: float      # on the engine's clock
    prompt_len: int
    max_new_tokens: int
    generated: int           # tokens generated so far (kept through preemptions)
    computed: int            # tokens whose K and V are in the pool (or host memory, swapped)
    pending: int             # tokens still to run through the model (1 when decoding)
    blocks: int              # blocks its K and V hold in the pool now
    preemptions: int
    first_token_time: Optional[float] = None   # on the engine's clock; None before it

    @property
    def decoding(self) -> bool:
        return self.pending == 1 and self.computed >= self.prompt_len


@dataclasses.dataclass(frozen=True)
class SchedulerView:
    """What a scheduler plug-in plans one step from. blocks_needed(r, n): blocks request r
    takes to run n more tokens (new blocks, and a copy where a shared block is written)."""
    step: int
    now: float                   # the engine's clock (seconds; arrival_time is on it too)
    max_batch_tokens: int
    max_batch_seqs: int
    block_size: int
    free_blocks: int             # blocks that can be handed out now (free or cached)
    sequences_left: int          # sequences the pool can still hold
    running: Tuple[RequestState, ...]     # in order of admission
    waiting: Tuple[RequestState, ...]     # in line, the next to be admitted first
    # request id -> blocks it takes beside its new ones (a copy on write; a waiting
    # request's blocks for what it holds in host memory)
    extra: Dict[int, int] = dataclasses.field(default_factory=dict, repr=False)

    def blocks_needed(self, request: RequestState, n_tokens: int) -> int:
        """Blocks `request` takes to run n_tokens (1 .. pending) more tokens."""
        if not 0 < n_tokens <= request.pending:
            raise ValueError(f"n_tokens must be from 1 to request {request.id}'s pending "
                             f"{request.pending}, got {n_tokens}")
        size, done = self.block_size, request.computed
        return blocks_for(done + n_tokens, size) - blocks_for(done, size) + self.extra[request.id]

    def __getitem__(self, key):
        # lab 15's starter writes its scheduler over plain_view's dict; plugged in bare, it
        # indexes this record: say what to do, not only that a record is not a dict
        raise TypeError(f"a SchedulerView is a record (view.{key}), not the plain dict view: "
                        f"a scheduler whose plan() takes the dict view goes in "
                        f"kvlab.plugins.PlainScheduler(yours)")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A scheduler plug-in's plan: run, (request id, n_tokens) in batch order, a waiting
    request named here being admitted; preempt, the ids of running requests to send back to
    the front of the waiting line (their K and V dropped, or swapped out); max_drafts, the
    most draft tokens the engine may add to the step in all (0: none), or None for as many
    as the budget and blocks the plan leaves."""
    run: List[Tuple[int, int]]
    preempt: List[int] = dataclasses.field(default_factory=list)
    max_drafts: Optional[int] = None


def scheduler_view(scheduler: Scheduler, space, step: int, leaving,
                   now: float = 0.0) -> SchedulerView:
    """The engine's queues as plain records (requests failing this step left out)."""
    extra, running, waiting = {}, [], []
    for queue, out in ((scheduler.running, running), (scheduler.waiting, waiting)):
        for request in queue:
            if request.id in leaving:
                continue
            (seq,) = request.active()
            size = scheduler.block_size   # what space.needed adds to the new blocks
            extra[request.id] = (space.needed(seq, 1) - blocks_for(seq.computed + 1, size)
                                 + blocks_for(seq.computed, size))
            out.append(RequestState(
                id=request.id, arrival_time=request.arrived, prompt_len=seq.prompt_len,
                max_new_tokens=request.params.max_new_tokens, generated=len(seq.outputs),
                computed=seq.computed, pending=seq.pending,
                blocks=0 if seq.handle is None else len(seq.handle.block_table),
                preemptions=request.preemptions, first_token_time=request.first_token_at))
    return SchedulerView(step, now, scheduler.max_batch_tokens, scheduler.max_batch_seqs,
                         scheduler.block_size, space.available(), space.sequences_left(),
                         tuple(running), tuple(waiting), extra)


def checked_plan(policy, scheduler: Scheduler, space, step: int, leaving,
                 now: float = 0.0) -> ScheduledStep:
    """Ask the scheduler plug-in for a plan, check it, and turn it into the engine's
    ScheduledStep (drafts added after it, as the engine's own scheduler adds them).
    Raises PluginError before anything changes if the plan breaks a rule."""
    view = scheduler_view(scheduler, space, step, leaving, now)
    answer = _ask("scheduler", "plan()", policy.plan, view)
    run, preempt, max_drafts = _plan_lists(answer)
    requests = {r.id: r for r in list(scheduler.running) + list(scheduler.waiting)
                if r.id not in leaving}
    running = {r.id for r in view.running}
    states = {r.id: r for r in view.running + view.waiting}
    out = ScheduledStep(items=[])
    for rid in preempt:
        if rid not in running:
            raise PluginError(f"the scheduler preempted request {rid}, which is not running")
        if requests[rid] in out.preempted:
            raise PluginError(f"the scheduler preempted request {rid} twice")
        out.preempted.append(requests[rid])
    seen, tokens, blocks = set(), 0, 0
    for rid, n in run:
        if rid not in states:
            raise PluginError(f"the scheduler ran request {rid}, which is neither running "
                              f"nor waiting")
        if rid in seen or rid in preempt:
            raise PluginError(f"the scheduler ran request {rid} twice, or ran it and "
                              f"preempted it")
        state = states[rid]
        if not 1 <= n <= state.pending:
            raise PluginError(f"the scheduler gave request {rid} {n} tokens: it has "
                              f"{state.pending} to run, so 1 to {state.pending}")
        seen.add(rid)
        tokens += n
        blocks += view.blocks_needed(state, n)
        request = requests[rid]
        out.items.append((request, request.active()[0], n))
        if rid not in running:
            out.admitted.append(request)
    _check_room(view, out, space, tokens, blocks)
    budget = view.max_batch_tokens - tokens
    scheduler._add_drafts(space, out, budget if max_drafts is None else min(budget, max_drafts),
                          view.free_blocks + sum(space.freed(r) for r in out.preempted) - blocks)
    return out


def _plan_lists(answer) -> Tuple[List[Tuple[int, int]], List[int], Optional[int]]:
    """The plug-in's answer as (run, preempt) lists of plain ints and its max_drafts (None,
    or an int from 0), or PluginError."""
    if not isinstance(answer, StepPlan):
        raise PluginError(f"the scheduler's plan() must return a kvlab.plugins.StepPlan, got "
                          f"{arguments.shown(answer)}")
    try:
        run = [(arguments.integer(rid, "a request id"), arguments.integer(n, "n_tokens"))
               for rid, n in answer.run]
        preempt = [arguments.integer(rid, "a request id") for rid in answer.preempt]
    except (TypeError, ValueError) as error:
        raise PluginError(f"the scheduler's StepPlan must hold run = [(request id, "
                          f"n_tokens), ...] and preempt = [request id, ...] of ints: "
                          f"{error}") from None
    return run, preempt, _max_drafts(answer.max_drafts)


def _max_drafts(value) -> Optional[int]:
    if value is None:
        return None
    try:
        return arguments.integer(value, "max_drafts", 0)
    except (TypeError, ValueError) as error:
        raise PluginError(f"the scheduler's max_drafts (the draft tokens a step may add, "
                          f"None for no cap): {error}") from None


def _check_room(view: SchedulerView, out: ScheduledStep, space, tokens: int,
                blocks: int) -> None:
    """The plan fits the step: its token budget, its batch size, the pool's sequences and
    blocks (those its preemptions free counted), and it does something while work waits."""
    if tokens > view.max_batch_tokens:
        raise PluginError(f"the scheduler planned {tokens} tokens, past max_batch_tokens="
                          f"{view.max_batch_tokens}")
    if len(out.items) > view.max_batch_seqs:
        raise PluginError(f"the scheduler planned {len(out.items)} sequences, past "
                          f"max_batch_seqs={view.max_batch_seqs}")
    if len(out.admitted) > view.sequences_left + len(out.preempted):
        raise PluginError(f"the scheduler admitted {len(out.admitted)} requests; the pool "
                          f"holds {view.sequences_left} more sequences")
    room = view.free_blocks + sum(space.freed(r) for r in out.preempted)
    if blocks > room:
        raise PluginError(f"the scheduler's plan needs {blocks} blocks; {room} are free "
                          f"(its preemptions counted)")
    if not out.items and not out.preempted and (view.running or view.waiting):
        raise PluginError(f"the scheduler planned nothing while {len(view.running)} "
                          f"requests run and {len(view.waiting)} wait: the engine would "
                          f"never finish")


def check_scheduler(policy) -> None:
    if isinstance(policy, type) or not callable(getattr(policy, "plan", None)):
        raise TypeError(f"scheduler takes an object with plan(view) -> StepPlan (see "
                        f"kvlab.plugins), got {_what(policy)}")


def _what(value) -> str:
    return f"the class {value.__name__}" if isinstance(value, type) else type(value).__name__


# ---- the block allocator: lab 5's class, driven in step with the pool -----------------------
ALLOCATOR_METHODS = ("new_sequence", "append", "fork", "free", "block_table", "length",
                     "ref_count", "num_free_blocks")


def make_allocator(cls, num_blocks: int, block_size: int):
    """An allocator plug-in: lab 5's class (or a function) called with (num_blocks,
    block_size); its object must have every method of ALLOCATOR_METHODS."""
    if not callable(cls):
        raise TypeError(f"allocator takes a class with lab 5's interface, called as "
                        f"cls(num_blocks, block_size), got {_what(cls)}")
    allocator = _ask("allocator", "constructor", cls, num_blocks, block_size)
    missing = [m for m in ALLOCATOR_METHODS if not callable(getattr(allocator, m, None))]
    if missing:
        raise TypeError(f"the allocator plug-in has no {', '.join(missing)} (lab 5's "
                        f"interface: {', '.join(ALLOCATOR_METHODS)})")
    return allocator


def _ask(plugin: str, what: str, call, *args):
    """call(*args), a plug-in's code: whatever it raises becomes a PluginError naming it."""
    try:
        return call(*args)
    except Exception as error:
        raise PluginError(f"the {plugin} plug-in's {what} raised {type(error).__name__}: "
                          f"{error}") from error


class MirroredPool:
    """The engine's pool, its every operation that makes, grows, forks, cuts or frees a
    sequence also done on an allocator plug-in (AllocatorMirror). Everything else is the
    pool's own (attribute access goes through). The pool stays the one that holds K and V
    and decides; the plug-in follows, and is checked after every step.

    Each operation happens in both or in neither: a plug-in call that raises is taken to
    have changed nothing in the plug-in (a method that refuses should raise before it
    acts), so the pool is left as before the operation too. An operation that frees or
    cuts asks the plug-in first (a freed row cannot come back); one that makes a sequence
    asks the pool first and frees the new sequence again if the plug-in refuses it. (Rows
    a forward call writes reach the plug-in later, as appends: AllocatorMirror.sync.)"""

    def __init__(self, pool, mirror: "AllocatorMirror"):
        self._pool, self._mirror = pool, mirror

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def _made(self, handle, follow, *args):
        """follow(*args), the plug-in told of a sequence the pool just made; if it raises,
        the pool's sequence is freed again. Returns the handle."""
        try:
            follow(*args)
        except BaseException:
            self._pool.free(handle)
            raise
        return handle

    def new_sequence(self):
        handle = self._pool.new_sequence()
        return self._made(handle, self._mirror.made, handle)

    def fork(self, parent):
        self._mirror.sync(parent)              # the child shares the parent's rows as now
        child = self._pool.fork(parent)
        return self._made(child, self._mirror.forked, parent, child)

    def free(self, handle):
        self._mirror.freed(handle)
        self._pool.free(handle)

    def truncate(self, handle, length):
        self._mirror.sync(handle)
        self._mirror.cut(handle, length)
        self._pool.truncate(handle, length)

    def swap_out(self, handle):
        self._mirror.freed(handle)
        try:
            return self._pool.swap_out(handle)     # frees the handle's blocks
        except BaseException:     # refused (no host memory): the plug-in freed it already,
            self._pool.free(handle)     # so the pool does too; it is recomputed instead
            raise

    def swap_in(self, host):
        handle = self._pool.swap_in(host)
        self._made(handle, self._mirror.made, handle)
        self._mirror.sync(handle)       # if its append raises, a later sync tells it again
        return handle


class AllocatorMirror:
    """Lab 5's allocator driven as the pool is (through MirroredPool), and checked: after
    each step, every live sequence's length, table length and its blocks' ref counts, and
    the free blocks, must be the pool's (block ids are the allocator's own choice)."""

    def __init__(self, allocator, pool):
        self.allocator, self.pool = allocator, pool
        self.ids: Dict[int, Tuple[object, object, int]] = {}   # id(handle) -> (handle, its
                                                               # id in the allocator, length)

    def made(self, handle) -> None:
        sid = _ask("allocator", "new_sequence()", self.allocator.new_sequence)
        self._track(handle, sid, 0)

    def _track(self, handle, sid, length: int) -> None:
        try:
            hash(sid)
        except TypeError:
            raise PluginError(f"the allocator plug-in's sequence id {arguments.shown(sid)} "
                              f"is not hashable") from None
        if any(known == sid for _, known, _ in self.ids.values()):
            raise PluginError(f"the allocator plug-in gave the id {sid!r} of a live "
                              f"sequence to a new one")
        self.ids[id(handle)] = (handle, sid, length)

    def sync(self, handle) -> None:
        """The rows the pool wrote for `handle` since the last sync, appended."""
        entry = self.ids.get(id(handle))
        if entry is None or not handle.alive:
            return
        _, sid, length = entry
        if handle.length > length:
            _ask("allocator", f"append(seq, {handle.length - length})", self.allocator.append,
                 sid, handle.length - length)
            self.ids[id(handle)] = (handle, sid, handle.length)

    def forked(self, parent, child) -> None:
        _, sid, length = self.ids[id(parent)]
        self._track(child, _ask("allocator", "fork()", self.allocator.fork, sid), length)

    def freed(self, handle) -> None:
        entry = self.ids.get(id(handle))
        if entry is not None:                  # forgotten once the plug-in has freed it
            _ask("allocator", "free()", self.allocator.free, entry[1])
            del self.ids[id(handle)]

    def cut(self, handle, length: int) -> None:
        _, sid, old = self.ids[id(handle)]
        if length == old:
            return
        truncate = getattr(self.allocator, "truncate", None)
        if not callable(truncate):
            raise PluginError("the engine cut a sequence back (speculation's refused drafts, "
                              "or a step run again) and the allocator plug-in has no "
                              "truncate(seq, length)")
        _ask("allocator", "truncate()", truncate, sid, length)
        self.ids[id(handle)] = (handle, sid, length)

    def step_done(self) -> None:
        """Sync every sequence, then check the allocator against the pool."""
        for handle, _, _ in list(self.ids.values()):
            self.sync(handle)
        refs = self.pool.ref_counts
        for handle, sid, length in self.ids.values():
            mine = _ask("allocator", "block_table()", self.allocator.block_table, sid)
            theirs = [int(b) for b in handle.block_table]
            got = _ask("allocator", "length()", self.allocator.length, sid)
            if got != handle.length or len(mine) != len(theirs):
                raise PluginError(f"the allocator plug-in holds {got!r} tokens in "
                                  f"{len(mine)} blocks for a sequence the pool holds in "
                                  f"{handle.length} tokens, {len(theirs)} blocks")
            counts = [_ask("allocator", "ref_count()", self.allocator.ref_count, b) for b in mine]
            if counts != [int(refs[b]) for b in theirs]:
                raise PluginError(f"the allocator plug-in's ref counts of a sequence's blocks "
                                  f"are {counts}; the pool's {[int(refs[b]) for b in theirs]}")
        free = _ask("allocator", "num_free_blocks()", self.allocator.num_free_blocks)
        if free != self.pool.available_blocks:
            raise PluginError(f"the allocator plug-in has {free!r} free blocks; the pool "
                              f"{self.pool.available_blocks}")


# ---- the prefix cache: told what the pool's cache finds, asked what it would reuse -----------
PREFIX_CACHE_METHODS = ("insert", "remove", "match")


def make_prefix_cache(cls, block_size: int):
    """A prefix cache plug-in: a class (or a function) called with (block_size); its object
    must have every method of PREFIX_CACHE_METHODS."""
    if not callable(cls):
        raise TypeError(f"prefix_cache takes a class called as cls(block_size), with "
                        f"{', '.join(PREFIX_CACHE_METHODS)}, got {_what(cls)}")
    cache = _ask("prefix cache", "constructor", cls, block_size)
    missing = [m for m in PREFIX_CACHE_METHODS if not callable(getattr(cache, m, None))]
    if missing:
        raise TypeError(f"the prefix cache plug-in has no {', '.join(missing)} (the "
                        f"interface: {', '.join(PREFIX_CACHE_METHODS)}; see kvlab.plugins)")
    return cache


def findable_prefixes(pool) -> Dict[Tuple[int, ...], int]:
    """Every token prefix the pool's prefix cache finds now, each a whole number of blocks,
    with the block that ends it: the chains of pool.prefix_parents, each block's tokens
    after its parent's."""
    parents, tokens = pool.prefix_parents, pool.block_tokens
    prefix_of: Dict[int, Tuple[int, ...]] = {-1: ()}
    for block in np.flatnonzero(parents >= -1).tolist():
        chain = []
        while block not in prefix_of:          # up to a block done already, or the root
            chain.append(block)
            block = int(parents[block])
        for b in reversed(chain):
            prefix_of[b] = prefix_of[block] + tuple(tokens[b].tolist())
            block = b
    del prefix_of[-1]
    return {prefix: block for block, prefix in prefix_of.items()}


class PrefixMirror:
    """A prefix cache plug-in driven beside the pool's own (the module text): told what the
    pool's cache gained and lost, then asked match() for each context a step admits, before
    the pool changes; an answer that is not the pool's raises PluginError."""

    def __init__(self, cache, pool):
        self.cache, self.pool = cache, pool
        self.known: set = set()    # the prefixes the plug-in was told the cache finds
        self.asked = self.matched = 0      # match() calls, and the tokens they found

    def sync(self) -> None:
        """remove() what the cache lost since the last sync, longest first, then insert()
        what it gained, shortest first (each noted as told once its call returned)."""
        now = findable_prefixes(self.pool)
        for prefix in sorted(self.known - now.keys(), key=len, reverse=True):
            _ask("prefix cache", "remove()", self.cache.remove, list(prefix))
            self.known.discard(prefix)
        for prefix in sorted(now.keys() - self.known, key=len):
            _ask("prefix cache", "insert()", self.cache.insert, list(prefix))
            self.known.add(prefix)

    def expected(self, tokens) -> int:
        """What pool.reuse_prefix(seq, tokens[:-1]) finds: the longest known prefix of whole
        blocks short of the last token."""
        size, n = self.pool.block_size, 0
        while n + size < len(tokens) and tuple(tokens[:n + size]) in self.known:
            n += size
        return n

    def check_admissions(self, plan: ScheduledStep) -> None:
        """match() for every sequence the plan admits that will look its tokens up (not
        one coming back from host memory), checked against the pool's cache as it is now."""
        for request in plan.admitted:
            for seq in request.active():
                if seq.handle is None and seq.swapped is None:
                    self.check(seq.tokens)

    def check(self, tokens) -> int:
        self.sync()
        answer = _ask("prefix cache", "match()", self.cache.match, [int(t) for t in tokens])
        if isinstance(answer, bool) or not isinstance(answer, (int, np.integer)):
            raise PluginError(f"the prefix cache plug-in's match() must return an int (the "
                              f"tokens cached), got {arguments.shown(answer)}")
        want = self.expected(tokens)
        if answer != want:
            raise PluginError(f"the prefix cache plug-in's match() of a context of "
                              f"{len(tokens)} tokens says {answer} are cached; the pool's "
                              f"cache holds {want}: "
                              f"{_match_rule(int(answer), want, len(tokens), self.pool.block_size)}")
        self.asked, self.matched = self.asked + 1, self.matched + want
        return want


def _match_rule(answer: int, want: int, n_tokens: int, size: int) -> str:
    """The rule a wrong match() answer broke, in words."""
    if answer < 0:
        return "a count of tokens, 0 or more"
    if answer % size:
        return f"whole blocks only (a multiple of block_size={size})"
    if answer >= n_tokens:
        return "at most len(tokens) - 1: the last token is always run (its logits choose the next)"
    if answer > want:
        return "it claims blocks the cache does not find (removed, or never inserted)"
    return "it misses inserted blocks (the longest inserted prefix counts)"


# ---- plug-ins written on plain values (the capstone lab's; one in another process) ----------
def plain_view(view: SchedulerView) -> dict:
    """A SchedulerView as plain dicts and lists: each request's record with its
    extra_blocks (blocks_needed(r, n) = blocks_for(computed + n) - blocks_for(computed) +
    extra_blocks)."""
    plain = {name: getattr(view, name) for name in
             ("step", "now", "max_batch_tokens", "max_batch_seqs", "block_size",
              "free_blocks", "sequences_left")}
    for key in ("running", "waiting"):
        plain[key] = [dict(dataclasses.asdict(r), extra_blocks=view.extra[r.id])
                      for r in getattr(view, key)]
    return plain


def plan_from_plain(answer) -> StepPlan:
    """{"run": [[id, n], ...], "preempt": [id, ...], "max_drafts": n} (the last two
    optional) as a StepPlan (PluginError if not)."""
    if not isinstance(answer, dict) or not set(answer) <= {"run", "preempt", "max_drafts"}:
        raise PluginError(f"plan() must return {{'run': [[id, n_tokens], ...], 'preempt': "
                          f"[id, ...]}} (and, if you like, 'max_drafts': n), got "
                          f"{arguments.shown(answer)}")
    try:
        run = [tuple(pair) for pair in answer.get("run", [])]
        if any(len(pair) != 2 for pair in run):
            raise TypeError("a pair that is not two values")
        return StepPlan(run, list(answer.get("preempt", [])), answer.get("max_drafts"))
    except TypeError as error:
        raise PluginError(f"plan()'s run must be a list of [request id, n_tokens] pairs: "
                          f"{error}") from None


class PlainScheduler:
    """A scheduler plug-in over an object whose plan(view) takes plain_view(view) and
    returns a plain plan (plan_from_plain)."""

    def __init__(self, plain):
        if not callable(getattr(plain, "plan", None)):
            raise TypeError(f"PlainScheduler takes an object with plan(view), got {_what(plain)}")
        self.plain = plain

    def plan(self, view: SchedulerView) -> StepPlan:
        return plan_from_plain(self.plain.plan(plain_view(view)))


class PlainDrafter:
    """A drafter plug-in over an object whose propose(tokens, k) takes a list of ints."""

    def __init__(self, plain):
        if not callable(getattr(plain, "propose", None)):
            raise TypeError(f"PlainDrafter takes an object with propose(tokens, k), got "
                            f"{_what(plain)}")
        self.plain = plain

    def propose(self, tokens, k: int, sampling=None) -> list:
        return self.plain.propose([int(t) for t in tokens], int(k))
