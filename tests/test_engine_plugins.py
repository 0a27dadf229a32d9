"""kvlab.plugins: a student's scheduler, drafter, block allocator and prefix cache plugged into
kvlab.Engine. Good plug-ins give kvlab.generate's tokens; a plug-in that answers nonsense
gets a PluginError naming the rule, before the pool changes, and never a wrong token."""
import dataclasses

import pytest

import kvlab
from kvlab.plugins import PluginError, SchedulerView, StepPlan
from kvlab.speculative import PromptLookup

PROMPTS = ["ROMEO:", "JULIET: O Romeo", "First Citizen:\nBefore we proceed any further",
           "KING", "MENENIUS:\nWhy, masters"]


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def expected(model):
    return [kvlab.generate(model, p, 20).tokens for p in PROMPTS]


class FirstComeFirstServed:
    """The engine's own rules, written against the plug-in view: running requests first
    (the newest preempted when blocks run out), then waiting ones in line."""

    def plan(self, view: SchedulerView) -> StepPlan:
        run, preempt = [], []
        budget, free = view.max_batch_tokens, view.free_blocks
        running = list(view.running)
        for r in running:
            n = min(r.pending, budget)
            if r.id in preempt or n == 0 or len(run) == view.max_batch_seqs:
                continue
            need = view.blocks_needed(r, n)
            while need > free:
                victim = [x for x in running if x.id not in preempt][-1]
                preempt.append(victim.id)
                free += victim.blocks
                budget += sum(k for rid, k in run if rid == victim.id)
                run = [(rid, k) for rid, k in run if rid != victim.id]
                if victim is r:
                    break
            if r.id not in preempt:
                run.append((r.id, n))
                budget, free = budget - n, free - need
        for r in view.waiting if not preempt else ():
            n = min(r.pending, budget)
            if n == 0 or len(run) == view.max_batch_seqs or view.blocks_needed(r, n) > free:
                break
            run.append((r.id, n))
            budget, free = budget - n, free - view.blocks_needed(r, n)
        return StepPlan(run, preempt)


class ShortestFirst(FirstComeFirstServed):
    """Admits the waiting request with the fewest tokens to compute first."""

    def plan(self, view):
        view = SchedulerView(**{**view.__dict__,
                                "waiting": tuple(sorted(view.waiting, key=lambda r: r.pending))})
        return super().plan(view)


class Allocator:
    """Lab 5's interface (plus truncate), written for these tests."""

    def __init__(self, num_blocks, block_size):
        self.block_size, self.free_ids = block_size, list(range(num_blocks))
        self.refs, self.tables, self.lengths, self.next = [0] * num_blocks, {}, {}, 0

    def _blocks(self, n):
        return -(-n // self.block_size)

    def new_sequence(self):
        self.next += 1
        self.tables[self.next], self.lengths[self.next] = [], 0
        return self.next

    def append(self, seq, n):
        table, length, copies = self.tables[seq], self.lengths[seq], []
        need = self._blocks(length + n) - len(table)
        cow = length % self.block_size != 0 and self.refs[table[-1]] > 1
        if need + cow > len(self.free_ids):
            raise MemoryError("out of blocks")
        if cow:
            dst = self.free_ids.pop()
            self.refs[table[-1]] -= 1
            self.refs[dst] = 1
            copies.append((table[-1], dst))
            table[-1] = dst
        for _ in range(need):
            table.append(self.free_ids.pop())
            self.refs[table[-1]] = 1
        self.lengths[seq] = length + n
        return copies

    def fork(self, seq):
        child = self.new_sequence()
        self.tables[child], self.lengths[child] = list(self.tables[seq]), self.lengths[seq]
        for b in self.tables[seq]:
            self.refs[b] += 1
        return child

    def _drop(self, blocks):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_ids.append(b)

    def free(self, seq):
        self._drop(self.tables.pop(seq))
        del self.lengths[seq]

    def truncate(self, seq, length):
        keep = self._blocks(length)
        self._drop(self.tables[seq][keep:])
        del self.tables[seq][keep:]
        self.lengths[seq] = length

    def block_table(self, seq):
        return list(self.tables[seq])

    def length(self, seq):
        return self.lengths[seq]

    def ref_count(self, block):
        return self.refs[block]

    def num_free_blocks(self):
        return len(self.free_ids)


def serve(model, n_samples=1, **plugins):
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, max_batch_tokens=16, **plugins)
    for p in PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=20))
    if n_samples > 1:
        engine.add_request("KING", kvlab.SamplingParams(max_new_tokens=8, n=n_samples,
                                                        temperature=0.8, seed=3))
    outputs = engine.run(progress=False)
    engine.pool.check()
    return engine, [outputs[i].outputs[0].tokens for i in range(len(PROMPTS))]


@pytest.mark.parametrize("policy", [FirstComeFirstServed, ShortestFirst])
def test_a_scheduler_plug_in_gives_generates_tokens(model, expected, policy):
    engine, tokens = serve(model, scheduler=policy())
    assert tokens == expected
    assert sum(o.preemptions for o in engine.outputs.values()) > 0    # the pool was tight


def test_a_scheduler_that_mirrors_the_engines_own_plans_the_same_steps(model):
    own, _ = serve(model)
    plugged, _ = serve(model, scheduler=FirstComeFirstServed())
    assert [(r.prefill_tokens, r.decode_tokens, r.preemptions) for r in own.metrics] == \
        [(r.prefill_tokens, r.decode_tokens, r.preemptions) for r in plugged.metrics]


class Scripted:
    """Plans as FirstComeFirstServed does, except at step `at`, where it answers `bad`."""

    def __init__(self, at, bad):
        self.at, self.bad, self.good = at, bad, FirstComeFirstServed()

    def plan(self, view):
        if view.step == self.at:
            return self.bad(view)
        return self.good.plan(view)


BAD_PLANS = {
    "not a StepPlan": (lambda v: [(v.running[0].id, 1)], "must return a kvlab.plugins.StepPlan"),
    "unknown id": (lambda v: StepPlan([(999, 1)]), "neither running nor waiting"),
    "zero tokens": (lambda v: StepPlan([(v.running[0].id, 0)]), "1 to"),
    "too many tokens": (lambda v: StepPlan([(v.running[0].id, v.running[0].pending + 1)]),
                        "1 to"),
    "twice": (lambda v: StepPlan([(v.running[0].id, 1)] * 2), "twice"),
    "float tokens": (lambda v: StepPlan([(v.running[0].id, 1.0)]), "of ints"),
    "preempt waiting": (lambda v: StepPlan([], [v.waiting[0].id]), "not running"),
    "run and preempt": (lambda v: StepPlan([(v.running[0].id, 1)], [v.running[0].id]),
                        "preempted it"),
    "nothing": (lambda v: StepPlan([]), "planned nothing"),
    "over budget": (lambda v: StepPlan([(r.id, r.pending) for r in v.running + v.waiting]),
                    "max_batch_tokens|blocks"),
    "negative max_drafts": (lambda v: StepPlan([(v.running[0].id, 1)], max_drafts=-1),
                            "max_drafts"),
    "float max_drafts": (lambda v: StepPlan([(v.running[0].id, 1)], max_drafts=2.0),
                         "max_drafts"),
    "raises": (lambda v: 1 / 0, "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", BAD_PLANS)
def test_a_bad_plan_is_refused_before_the_pool_changes(model, expected, name):
    bad, message = BAD_PLANS[name]
    policy = Scripted(2, bad)
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, max_batch_tokens=16,
                          scheduler=policy)
    for p in PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=20))
    engine.step(), engine.step()
    before = (engine.pool.stats(), [r.id for r in engine.scheduler.running],
              [r.id for r in engine.scheduler.waiting])
    with pytest.raises(PluginError, match=message):
        engine.step()
    assert (engine.pool.stats(), [r.id for r in engine.scheduler.running],
            [r.id for r in engine.scheduler.waiting]) == before
    engine.pool.check()
    policy.at = None                       # a good plan again: the run goes on, exactly
    outputs = engine.run(progress=False)
    assert [outputs[i].outputs[0].tokens for i in range(len(PROMPTS))] == expected


def test_a_plan_that_needs_more_blocks_than_are_free_is_refused(model):
    def everything(view):                  # both prompts whole: 8 blocks of a pool of 6
        return StepPlan([(r.id, r.pending) for r in view.waiting])
    engine = kvlab.Engine(model, num_blocks=6, block_size=4, max_batch_tokens=64,
                          scheduler=Scripted(0, everything))
    for first in (1, 20):
        engine.add_request(list(range(first, first + 13)), kvlab.SamplingParams(max_new_tokens=3))
    with pytest.raises(PluginError, match="needs 8 blocks; 6 are free"):
        engine.step()
    assert engine.pool.stats().n_sequences == 0


class CappedDrafts(FirstComeFirstServed):
    """FirstComeFirstServed's plans, with at most `cap` draft tokens a step."""

    def __init__(self, cap):
        self.cap = cap

    def plan(self, view):
        return dataclasses.replace(super().plan(view), max_drafts=self.cap)


@pytest.mark.parametrize("cap", [0, 1, 3])
def test_a_plan_caps_the_drafts_of_its_step(model, expected, cap):
    free, _ = serve(model, drafter=PromptLookup(), scheduler=FirstComeFirstServed())
    capped, tokens = serve(model, drafter=PromptLookup(), scheduler=CappedDrafts(cap))
    assert tokens == expected
    assert max(r.drafted for r in free.metrics) > cap       # the cap had work to do
    assert max(r.drafted for r in capped.metrics) == cap
    assert capped.speculation.drafted == sum(r.drafted for r in capped.metrics)


def test_plug_ins_are_checked_at_entry(model):
    with pytest.raises(TypeError, match="plan"):
        kvlab.Engine(model, num_blocks=8, scheduler=FirstComeFirstServed)    # the class
    with pytest.raises(TypeError, match="plan"):
        kvlab.Engine(model, num_blocks=8, scheduler=object())
    with pytest.raises(TypeError, match="drafter= or speculate="):
        kvlab.Engine(model, num_blocks=8, drafter=PromptLookup(), speculate=PromptLookup())
    with pytest.raises(TypeError, match="drafter"):
        kvlab.Engine(model, num_blocks=8, drafter=PromptLookup)
    with pytest.raises(TypeError, match="not a pool"):
        kvlab.Engine(model, model.new_paged_pool(8, 4), allocator=Allocator)
    with pytest.raises(TypeError, match="has no new_sequence, append.*lab 5"):
        kvlab.Engine(model, num_blocks=8, allocator=lambda n, size: object())
    with pytest.raises(TypeError, match="lab 5"):
        kvlab.Engine(model, num_blocks=8, allocator=Allocator(8, 16))    # an object
    with pytest.raises(PluginError, match="constructor raised"):
        kvlab.Engine(model, num_blocks=8, allocator=lambda n, size: 1 / 0)
    engine = kvlab.Engine(model, num_blocks=8, scheduler=FirstComeFirstServed())
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request("ROMEO:", kvlab.SamplingParams(n=2, temperature=1.0))


def test_a_drafter_plug_in_is_speculation(model, expected):
    engine, tokens = serve(model, drafter=PromptLookup(), scheduler=FirstComeFirstServed())
    assert tokens == expected and engine.speculation.drafted > 0

    class Junk:
        def propose(self, tokens, k, sampling=None):
            return [10 ** 9]
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, drafter=Junk())
    engine.add_request("ROMEO: ROMEO: ROMEO:", kvlab.SamplingParams(max_new_tokens=5))
    (output,) = engine.run(progress=False).values()
    assert output.outputs[0].finish_reason.startswith("error") and "out of range" in \
        output.outputs[0].finish_reason
    engine.pool.check()


@pytest.mark.parametrize("options", [{}, {"preemption": "swap"},
                                     {"scheduler": FirstComeFirstServed()},
                                     {"drafter": PromptLookup()}])
def test_an_allocator_plug_in_follows_the_pool(model, expected, options):
    engine, tokens = serve(model, n_samples=1 if options else 3, allocator=Allocator,
                           **options)
    assert tokens == expected
    assert engine._mirror.allocator.num_free_blocks() == engine.pool.num_blocks


class ForkForgetsRefs(Allocator):
    def fork(self, seq):
        child = self.new_sequence()
        self.tables[child], self.lengths[child] = list(self.tables[seq]), self.lengths[seq]
        return child


class NeverCopies(Allocator):
    def append(self, seq, n):
        table, length = self.tables[seq], self.lengths[seq]
        for _ in range(self._blocks(length + n) - len(table)):
            table.append(self.free_ids.pop())
            self.refs[table[-1]] = 1
        self.lengths[seq] = length + n
        return []


class NoTruncate(Allocator):
    truncate = None


@pytest.mark.parametrize("allocator, message", [
    (ForkForgetsRefs, "ref counts"), (NeverCopies, "ref counts"),
    (NoTruncate, "no truncate")])
def test_a_wrong_allocator_is_caught_by_the_engine(model, allocator, message):
    options = {"drafter": PromptLookup()} if allocator is NoTruncate else {}
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, allocator=allocator, **options)
    engine.add_request("KING:", kvlab.SamplingParams(max_new_tokens=8, n=3, temperature=0.8,
                                                     seed=3))    # 5 tokens: a shared part block
    engine.add_request("ROMEO: ROMEO: ROMEO: ROMEO:", kvlab.SamplingParams(max_new_tokens=8))
    with pytest.raises(PluginError, match=message):
        engine.run(progress=False)
    engine.pool.check()                    # the pool itself is whole


class PlainFirstCome:
    """FirstComeFirstServed on plain dicts (the capstone lab's interface): it sees the view
    as plain_view gives it and answers {"run": ..., "preempt": ...}."""

    def plan(self, view):
        assert isinstance(view, dict) and isinstance(view["running"], list)
        records = {key: tuple(kvlab.plugins.RequestState(**{k: v for k, v in r.items()
                                                              if k != "extra_blocks"})
                              for r in view[key]) for key in ("running", "waiting")}
        extra = {r["id"]: r["extra_blocks"] for r in view["running"] + view["waiting"]}
        plain = {k: v for k, v in view.items() if k not in ("running", "waiting")}
        plan = FirstComeFirstServed().plan(SchedulerView(**plain, **records, extra=extra))
        return {"run": [list(pair) for pair in plan.run], "preempt": plan.preempt}


def test_a_scheduler_on_plain_values_plans_as_the_same_one_on_records(model, expected):
    from kvlab.plugins import PlainDrafter, PlainScheduler
    own, _ = serve(model)
    plain, tokens = serve(model, scheduler=PlainScheduler(PlainFirstCome()),
                          drafter=PlainDrafter(PromptLookup()))
    assert tokens == expected and plain.speculation.drafted > 0
    bare, _ = serve(model, scheduler=PlainScheduler(PlainFirstCome()))
    assert [(r.prefill_tokens, r.decode_tokens) for r in own.metrics] == \
        [(r.prefill_tokens, r.decode_tokens) for r in bare.metrics]


def test_a_plain_scheduler_plugged_in_bare_is_told_to_use_the_adapter(model):
    class IndexesTheView:              # as lab 15's starter's scheduler does: view["running"]
        def plan(self, view):
            return {"run": [[r["id"], r["pending"]] for r in view["running"]]}

    engine = kvlab.Engine(model, num_blocks=20, block_size=4, scheduler=IndexesTheView())
    engine.add_request(PROMPTS[0], kvlab.SamplingParams(max_new_tokens=2))
    with pytest.raises(PluginError, match=r"SchedulerView.*PlainScheduler\(yours\)"):
        engine.step()


@pytest.mark.parametrize("answer, message", [
    ([[0, 1]], "must return"), ({"run": [[0, 1]], "extra": 1}, "must return"),
    ({"run": [[0, 1, 2]]}, "pairs"), ({"run": 5}, "pairs"),
    ({"run": [[0, 1]], "max_drafts": "2"}, "max_drafts")])
def test_a_plain_plan_that_is_not_one_is_refused(answer, message):
    from kvlab.plugins import _plan_lists, plan_from_plain
    with pytest.raises(PluginError, match=message):
        _plan_lists(plan_from_plain(answer))


def test_a_plain_plan_may_cap_the_drafts():
    from kvlab.plugins import plan_from_plain
    assert plan_from_plain({"run": [[0, 1]], "max_drafts": 2}) == StepPlan([(0, 1)], [], 2)
    assert plan_from_plain({"run": [[0, 1]]}).max_drafts is None


def test_the_view_carries_the_engines_clock(model):
    from kvlab.slo import StepCost, VirtualClock
    seen = []

    class Watching(FirstComeFirstServed):
        def plan(self, view):
            seen.append(view.now)
            return super().plan(view)
    clock = VirtualClock(StepCost.for_model(model))
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, scheduler=Watching(), clock=clock)
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_new_tokens=4))
    engine.run(progress=False)
    assert seen[0] == 0.0 and seen == sorted(seen) and seen[-1] < clock()


def test_the_plain_view_carries_each_requests_first_token_time(model):
    from kvlab.plugins import PlainScheduler
    from kvlab.slo import StepCost, VirtualClock
    seen = {}

    class Watching(PlainFirstCome):
        def plan(self, view):
            for r in view["running"] + view["waiting"]:
                seen.setdefault(r["id"], []).append((r["generated"], r["first_token_time"]))
            return super().plan(view)
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, max_batch_tokens=16,
                          scheduler=PlainScheduler(Watching()),
                          clock=VirtualClock(StepCost.for_model(model)))
    for p in PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=6))
    outputs = engine.run(progress=False)
    for rid, views in seen.items():
        first = outputs[rid].metrics.first_token_time
        assert views[0] == (0, None) and first > 0
        assert all(t is None if n == 0 else t == first for n, t in views)
        assert any(n > 0 for n, _ in views)


# ---- the prefix cache plug-in ------------------------------------------------------------------
class PrefixTrie:
    """The prefix cache interface, written for these tests: a tree of blocks (each node a
    dict from a block's tokens to the node after it)."""

    def __init__(self, block_size):
        self.size, self.root, self.removed = block_size, {}, 0

    def _node(self, tokens):
        node = self.root
        for i in range(0, len(tokens), self.size):
            node = node[tuple(tokens[i:i + self.size])]
        return node

    def insert(self, tokens):
        self._node(tokens[:-self.size])[tuple(tokens[-self.size:])] = {}

    def remove(self, tokens):
        del self._node(tokens[:-self.size])[tuple(tokens[-self.size:])]
        self.removed += 1

    def match(self, tokens):
        node, n = self.root, 0
        while n + self.size < len(tokens) and tuple(tokens[n:n + self.size]) in node:
            node, n = node[tuple(tokens[n:n + self.size])], n + self.size
        return n

    def prefixes(self, node=None, before=()):
        for block, child in (self.root if node is None else node).items():
            yield before + block
            yield from self.prefixes(child, before + block)


SYSTEM = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
SHARED = [SYSTEM + end for end in ("ROMEO:", "All:\nSpeak, speak.", "KING", "JULIET: O")] * 2


@pytest.fixture(scope="module")
def shared_expected(model):
    return [kvlab.generate(model, p, 20).tokens for p in SHARED]


def serve_shared(model, prefix_cache, num_blocks=26, **options):
    """SHARED on a pool that holds two requests (a prompt and its tokens take 25 blocks)."""
    engine = kvlab.Engine(model, num_blocks=num_blocks, block_size=4, max_batch_tokens=16,
                          prefix_cache=prefix_cache, **options)
    for p in SHARED:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=20))
    return engine


@pytest.mark.parametrize("options", [{}, {"num_blocks": 80}, {"preemption": "swap"},
                                     {"scheduler": FirstComeFirstServed()},
                                     {"drafter": PromptLookup()}])
def test_a_prefix_cache_plug_in_follows_the_pools_cache(model, shared_expected, options):
    engine = serve_shared(model, PrefixTrie, **options)
    outputs = engine.run(progress=False)
    assert [outputs[i].outputs[0].tokens for i in range(len(SHARED))] == shared_expected
    mirror = engine._prefix
    assert mirror.asked >= len(SHARED) and mirror.matched > 0    # it was asked, and hit
    mirror.sync()          # what it holds then is what the pool's cache finds
    assert set(mirror.cache.prefixes()) == set(kvlab.plugins.findable_prefixes(engine.pool))
    if options.get("num_blocks") is None and "preemption" not in options:
        assert mirror.cache.removed > 0                          # the tight pool evicted
        assert sum(r.preemptions for r in engine.metrics) > 0     # and preempted
    engine.pool.check()


def test_the_pools_findable_prefixes_are_what_it_reuses(model):
    """findable_prefixes (pool.prefix_parents' chains): for every prompt served, the
    longest whole-block prefix it holds is what reuse_prefix attaches."""
    engine = kvlab.Engine(model, num_blocks=24, block_size=4, max_batch_tokens=32)
    for p in SHARED + PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=6))
    engine.run(progress=False)
    mirror = kvlab.plugins.PrefixMirror(PrefixTrie(4), engine.pool)
    mirror.sync()
    found = 0
    for p in SHARED + PROMPTS:
        tokens = model.encode(p) + [7]
        seq = engine.pool.new_sequence()
        assert engine.pool.reuse_prefix(seq, tokens[:-1]) == mirror.expected(tokens) \
            == mirror.cache.match(tokens)
        found += seq.length
        engine.pool.free(seq)
    assert found > 0


class NeverForgets(PrefixTrie):
    def remove(self, tokens):            # the planted mistake: evicted blocks stay "cached"
        pass


class CountsTheLastToken(PrefixTrie):
    def match(self, tokens):             # the planted mistake: the last token's block too
        node, n = self.root, 0
        while n + self.size <= len(tokens) and tuple(tokens[n:n + self.size]) in node:
            node, n = node[tuple(tokens[n:n + self.size])], n + self.size
        return n


class AnswersAFloat(PrefixTrie):
    def match(self, tokens):
        return float(super().match(tokens))


@pytest.mark.parametrize("cache, message", [
    (NeverForgets, "claims blocks the cache does not find"),
    (CountsTheLastToken, "at most len\\(tokens\\) - 1"),
    (AnswersAFloat, "must return an int")])
def test_a_wrong_prefix_cache_is_caught_before_the_pool_changes(model, cache, message):
    engine = serve_shared(model, cache)
    for p in [SYSTEM[:24], SYSTEM[:24]]:     # 24 tokens, all cached (SHARED start so)
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=4))
    with pytest.raises(PluginError, match=message):
        while True:
            before = (engine.pool.stats(), [r.id for r in engine.scheduler.running],
                      [r.id for r in engine.scheduler.waiting])
            engine.step()
    assert (engine.pool.stats(), [r.id for r in engine.scheduler.running],
            [r.id for r in engine.scheduler.waiting]) == before
    engine.pool.check()


class WrongOnce(PrefixTrie):
    """Answers one block too many at its `at`-th match() call, right otherwise."""

    def __init__(self, block_size, at=3):
        super().__init__(block_size)
        self.calls, self.at = 0, at

    def match(self, tokens):
        self.calls += 1
        return super().match(tokens) + (self.size if self.calls == self.at else 0)


def test_a_run_stopped_by_a_wrong_match_goes_on_exactly(model, shared_expected):
    engine = serve_shared(model, WrongOnce)
    with pytest.raises(PluginError, match="match\\(\\) of a context"):
        engine.run(progress=False)
    outputs = engine.run(progress=False)     # asked again: right this time
    assert [outputs[i].outputs[0].tokens for i in range(len(SHARED))] == shared_expected


def test_a_prefix_cache_plug_in_is_checked_at_entry(model):
    with pytest.raises(TypeError, match="give one of the two"):
        kvlab.Engine(model, num_blocks=8, allocator=Allocator, prefix_cache=PrefixTrie)
    with pytest.raises(TypeError, match="has no insert, remove"):
        kvlab.Engine(model, num_blocks=8, prefix_cache=lambda size: object())
    with pytest.raises(TypeError, match="cls\\(block_size\\)"):
        kvlab.Engine(model, num_blocks=8, prefix_cache=PrefixTrie(16))    # an object
    with pytest.raises(PluginError, match="constructor raised"):
        kvlab.Engine(model, num_blocks=8, prefix_cache=lambda size: 1 / 0)


# ---- a plug-in that raises once ----------------------------------------------------------------
class RaisesOnce:
    """A plug-in whose method `hook` raises at its k-th call; everything else is `inner`'s."""

    def __init__(self, inner, hook, k):
        self.inner, self.hook, self.k, self.calls = inner, hook, k, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.hook:
            return attr

        def once(*args):
            self.calls += 1
            if self.calls == self.k:
                raise RuntimeError(f"{name} failed (a test)")
            return attr(*args)
        return once


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("kind, hook", [("scheduler", "plan"), ("prefix_cache", "insert"),
                                        ("prefix_cache", "remove"), ("prefix_cache", "match")])
def test_a_plug_in_that_raises_once_stops_a_step_and_the_run_goes_on_exactly(
        model, shared_expected, kind, hook, k):
    # the error comes out as a PluginError naming the hook, before the pool changed or
    # after the step it followed: run() again gives every request generate's tokens
    if kind == "scheduler":
        engine = serve_shared(model, PrefixTrie, scheduler=RaisesOnce(
            FirstComeFirstServed(), hook, k))
    else:
        engine = serve_shared(model, lambda size: RaisesOnce(PrefixTrie(size), hook, k))
    with pytest.raises(PluginError, match=f"{hook}\\(.*raised RuntimeError"):
        engine.run(progress=False)
    engine.pool.check()
    outputs = engine.run(progress=False)
    assert [outputs[i].outputs[0].tokens for i in range(len(SHARED))] == shared_expected


def test_an_allocator_that_raises_in_free_is_named_and_the_engine_stays_sound(model, expected):
    # the plug-in refused to free, so the pool did not free either: the two still agree, and
    # the run goes on exactly (before, the engine kept the freed handle and every plan raised
    # ValueError on it, naming no plug-in; then, the pool having freed what the plug-in had
    # not, every later step raised PluginError)
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, max_batch_tokens=16,
                          allocator=lambda n, size: RaisesOnce(Allocator(n, size), "free", 1))
    for p in PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=20))
    with pytest.raises(PluginError, match="free\\(\\) raised RuntimeError"):
        engine.run(progress=False)
    engine.pool.check()
    outputs = engine.run(progress=False)
    assert [outputs[i].outputs[0].tokens for i in range(len(PROMPTS))] == expected
    engine.pool.check()


# ---- an allocator plug-in that raises once: the pool and the plug-in stay in step -----------
class CountsCalls:
    """An allocator plug-in that counts its calls of each method (the sweep's range)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args)
        return counted


ALLOCATOR_RUNS = {   # name -> (samples, options, the hooks its run calls often)
    "plain": (1, {}, ("new_sequence", "append", "free", "num_free_blocks")),  # (and a check)
    "samples": (3, {}, ("fork", "append", "free")),            # n=3: forks
    "swap": (1, {"preemption": "swap"}, ("new_sequence", "free")),
    "drafts": (1, {"drafter": PromptLookup}, ("truncate", "append")),   # refused drafts cut
}


def allocator_engine(model, allocator, run):
    """serve()'s engine and requests, for the run named, with its allocator plug-in."""
    n_samples, options, _ = ALLOCATOR_RUNS[run]
    options = {k: v() if k == "drafter" else v for k, v in options.items()}
    engine = kvlab.Engine(model, num_blocks=20, block_size=4, max_batch_tokens=16,
                          allocator=allocator, **options)
    for p in PROMPTS:
        engine.add_request(p, kvlab.SamplingParams(max_new_tokens=20))
    if n_samples > 1:
        engine.add_request("KING", kvlab.SamplingParams(max_new_tokens=8, n=n_samples,
                                                        temperature=0.8, seed=3))
    return engine


def allocator_calls(model, run):
    made = []

    def counting(n, size):
        made.append(CountsCalls(Allocator(n, size)))
        return made[-1]
    allocator_engine(model, counting, run).run(progress=False)
    return made[0].calls


def committed(engine):
    """What a step commits: the steps counted, the requests' tokens and finish reasons."""
    return (len(engine.metrics), [[(list(s.tokens), s.finish_reason) for s in r.sequences]
                                  for r in engine.requests.values()])


@pytest.mark.parametrize("run", ALLOCATOR_RUNS)
def test_an_allocator_that_raises_at_any_call_leaves_the_pool_and_plug_in_in_step(
        model, expected, run):
    # a call of the plug-in that raised changed nothing in it (it raised before its work, as
    # a method that refuses should), so the pool must be as if the operation had not been
    # asked: the step stops with a PluginError naming the call, and the run goes on from
    # there, exactly. Before, a raising free() or truncate() came after the pool's own, and
    # a raising new_sequence() or fork() left the pool's new sequence unknown to the
    # plug-in: every later step raised PluginError (the two no longer agreed)
    calls = allocator_calls(model, run)
    for hook in ALLOCATOR_RUNS[run][2]:
        assert calls.get(hook, 0) >= 2, (hook, calls)
        for k in sorted({1, 2, calls[hook] // 2, calls[hook]}):
            engine = allocator_engine(model, lambda n, size: RaisesOnce(Allocator(n, size),
                                                                        hook, k), run)
            with pytest.raises(PluginError, match=f"{hook}\\(.*raised RuntimeError"):
                while True:                 # the step that raised committed nothing
                    before = committed(engine)
                    try:
                        engine.step()
                    finally:
                        after = committed(engine)
            assert after == before
            engine.pool.check()
            outputs = engine.run(progress=False)        # no PluginError: in step again
            tokens = [outputs[i].outputs[0].tokens for i in range(len(PROMPTS))]
            assert tokens == expected, (hook, k)
            assert engine.pool.stats().blocks_used == 0
            assert engine._mirror.allocator.num_free_blocks() == engine.pool.num_blocks
