"""kvlab.scheduler on its own: no model, no compiled module, a pool made of counters.

The scheduler only decides; these tests carry its decisions out on a FakePool that counts
blocks the way the paged pool does (a sequence of L tokens holds ceil(L / block_size)
blocks; a fork shares them) and check the rules: the token budget, chunked prefill,
admission by free blocks, FIFO order, preemption of the most recently admitted request,
and that any workload finishes.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

KVLAB = Path(__file__).resolve().parents[1] / "kvlab"


def load_pure_scheduler():
    """kvlab/scheduler.py (and the sampling module it uses) loaded as a package of their
    own, so that kvlab/__init__.py and its compiled core are never imported."""
    name = "_kvlab_pure"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(KVLAB)]
        sys.modules[name] = package
        for module in ("sampling", "scheduler"):
            spec = importlib.util.spec_from_file_location(f"{name}.{module}", KVLAB / f"{module}.py")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = loaded
            spec.loader.exec_module(loaded)
    return sys.modules[f"{name}.scheduler"]


sched = load_pure_scheduler()


def blocks_for(n, block_size):
    return -(-n // block_size)


class FakePool:
    """Blocks counted the way the paged pool counts them. A sequence owns the blocks it
    wrote; forked samples share their parent's blocks, and the first write into a shared,
    partly filled last block costs one more block (copy-on-write). Shared blocks are
    counted until the whole request is released, which is never less than the real pool."""

    def __init__(self, num_blocks, block_size, prefix_hits=None, max_seqs=1000):
        self.num_blocks, self.block_size, self.max_seqs = num_blocks, block_size, max_seqs
        self.own = {}              # sequence id -> blocks it owns
        self.group = {}            # sequence id -> request id whose shared blocks it reads
        self.shared = {}           # request id -> blocks shared by its forked samples
        self.partial_shared = set()  # sequences whose last block is shared and partly filled
        self.prefix_hits = prefix_hits or {}   # request id -> tokens found in a prefix cache
        self.next_seq = 0

    def used(self):
        return sum(self.own.values()) + sum(self.shared.values())

    def available(self):
        return self.num_blocks - self.used()

    def sequences_left(self):
        return self.max_seqs - len(self.own)

    def needed(self, sample, n):
        if sample.handle is None:
            return blocks_for(n, self.block_size)
        have = blocks_for(sample.computed, self.block_size)
        copy = 1 if sample.handle in self.partial_shared else 0
        return blocks_for(sample.computed + n, self.block_size) - have + copy

    def start(self, request):
        self.release(request)          # what an interrupted start or release left (the contract)
        hits = 0
        for sample in request.active():
            sample.handle = self.next_seq
            self.next_seq += 1
            hit = min(self.prefix_hits.get(request.id, 0), len(sample.tokens) - 1)
            sample.computed = hit
            self.own[sample.handle] = blocks_for(hit, self.block_size)
            hits += hit
        return hits

    def fork(self, request, parent, children):
        """The engine forks the parent's sequence into the other samples."""
        self.shared[request.id] = self.own.pop(parent.handle)
        partial = parent.computed % self.block_size != 0
        for sample in [parent] + children:
            if sample is not parent:
                sample.handle, sample.computed = self.next_seq, parent.computed
                self.next_seq += 1
            self.own[sample.handle] = 0
            self.group[sample.handle] = request.id
            if partial:
                self.partial_shared.add(sample.handle)

    def freed(self, request):
        """What release(request) would give back (the plan asks before preempting)."""
        return (sum(self.own.get(s.handle, 0) for s in request.sequences if s.handle is not None)
                + self.shared.get(request.id, 0))

    def release(self, request):
        for sample in request.sequences:
            if sample.handle is not None:
                self.own.pop(sample.handle, None)
                self.group.pop(sample.handle, None)
                self.partial_shared.discard(sample.handle)
                sample.handle = None
        self.shared.pop(request.id, None)

    def run(self, sample, n):
        """Carry out one scheduled item: the sequence grows by n tokens."""
        self.own[sample.handle] += self.needed(sample, n)
        self.partial_shared.discard(sample.handle)
        sample.computed += n
        assert self.used() <= self.num_blocks, "the scheduler overcommitted the pool"


def make_request(rid, prompt_len, max_tokens=4, n=1):
    params = sched.SamplingParams(max_new_tokens=max_tokens, n=n)
    request = sched.Request(id=rid, prompt=[1] * prompt_len, params=params, arrival=rid)
    request.sequences = [sched.Sequence(index=i, tokens=[1] * prompt_len, prompt_len=prompt_len)
                         for i in range(n)]
    return request


def drive(scheduler, pool, requests, max_steps=10_000, on_step=None):
    """Step until everything finishes, generating token 7 whenever a sample's last token
    was computed (the engine's job); returns the scheduled steps."""
    for request in requests:
        scheduler.add(request)
    steps = []
    while scheduler.has_work:
        assert len(steps) < max_steps, "the scheduler made no progress (deadlock?)"
        step = scheduler.schedule(pool)
        assert step.n_tokens <= scheduler.max_batch_tokens
        for request, sample, n in step.items:
            pool.run(sample, n)
            if sample.computed < len(sample.tokens):
                continue
            targets = [sample]
            if request.params.n > 1 and not request.forked:    # the engine forks here
                pool.fork(request, sample, request.sequences[1:])
                request.forked = True
                targets = request.sequences
            for target in targets:
                target.tokens.append(7)
                if len(target.outputs) >= request.params.max_new_tokens:
                    target.finished = True
        for request in {r.id: r for r, _, _ in step.items}.values():
            if request.finished and request.state is sched.State.RUNNING:
                pool.release(request)
                scheduler.finish(request)
        steps.append(step)
        if on_step:
            on_step(step)
    return steps


def test_the_module_needs_no_compiled_core():
    # in a fresh interpreter where importing the compiled module fails
    code = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.endswith('_kvlab'):
            raise ImportError('no compiled module in this test')
sys.meta_path.insert(0, Refuse())
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_scheduler as t
pool = t.FakePool(8, 4)
s = t.sched.Scheduler(block_size=4, max_batch_tokens=8)
t.drive(s, pool, [t.make_request(0, 10), t.make_request(1, 3)])
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr
    assert "kvlab._kvlab" not in result.stderr


def test_chunked_prefill_respects_the_budget():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=16)
    pool = FakePool(64, 4)
    steps = drive(scheduler, pool, [make_request(0, 100, max_tokens=3)])
    # ceil(100 / 16) = 7 prefill steps (the last one samples the first token), then 2 decodes
    assert [s.n_tokens for s in steps] == [16] * 6 + [4, 1, 1]


def test_decodes_and_a_prefill_chunk_share_a_step():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=10)
    pool = FakePool(64, 4)
    first = make_request(0, 3, max_tokens=10)
    seen = []
    drive(scheduler, pool, [first, make_request(1, 30, max_tokens=2)],
          on_step=lambda step: seen.append([(r.id, n) for r, _, n in step.items]))
    # step 0: the whole short prompt, then 7 tokens of the long one; afterwards request 0
    # decodes one token a step and request 1's prompt fills the rest of the budget
    assert seen[0] == [(0, 3), (1, 7)]
    assert seen[1] == [(0, 1), (1, 9)]
    assert seen[2] == [(0, 1), (1, 9)]


def test_admission_waits_for_free_blocks_and_keeps_arrival_order():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=64)
    pool = FakePool(6, 4)                      # 24 slots
    big, small = make_request(0, 20, max_tokens=1), make_request(1, 8, max_tokens=1)
    later = make_request(2, 4, max_tokens=1)
    admitted = []
    drive(scheduler, pool, [big, small, later],
          on_step=lambda step: admitted.append([r.id for r in step.admitted]))
    # big takes 5 of 6 blocks; small needs 2 and waits. later would fit in the last block,
    # but it arrived after small: admission is first come, first served
    assert admitted[0] == [0]
    assert admitted[1] == [1, 2]               # big finished and gave its blocks back


def test_preemption_frees_the_most_recent_request_and_requeues_it_first():
    scheduler = sched.Scheduler(block_size=2, max_batch_tokens=64)
    pool = FakePool(6, 2)
    old, new = make_request(0, 4, max_tokens=6), make_request(1, 4, max_tokens=6)
    preempted = []
    drive(scheduler, pool, [old, new],
          on_step=lambda step: preempted.extend((r.id, r.state) for r in step.preempted))
    assert preempted and all(rid == 1 for rid, _ in preempted)
    assert new.preemptions >= 1 and old.preemptions == 0
    assert all(r.finished for r in (old, new))
    assert len(new.sequences[0].outputs) == 6            # it kept its tokens and went on


def test_no_admission_in_a_step_that_preempted():
    scheduler = sched.Scheduler(block_size=2, max_batch_tokens=64)
    pool = FakePool(5, 2)
    requests = [make_request(i, 3, max_tokens=5) for i in range(3)]

    def check(step):
        assert not (step.preempted and step.admitted)
    drive(scheduler, pool, requests, on_step=check)


def test_prefix_hits_are_not_computed_again():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=64)
    pool = FakePool(16, 4, prefix_hits={0: 8})
    steps = drive(scheduler, pool, [make_request(0, 10, max_tokens=1)])
    assert steps[0].prefix_hit_tokens == 8 and steps[0].n_tokens == 2


def test_forked_samples_all_decode():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=64)
    pool = FakePool(32, 4)
    request = make_request(0, 6, max_tokens=3, n=3)
    steps = drive(scheduler, pool, [request])
    assert steps[0].n_tokens == 6                      # one prompt for the three samples
    assert [len(s.items) for s in steps[1:]] == [3, 3]
    assert all(len(s.outputs) == 3 for s in request.sequences)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_always_finish_within_the_pool(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 8]))
    budget = int(rng.integers(1, 40))
    requests = []
    for rid in range(int(rng.integers(1, 12))):
        requests.append(make_request(rid, int(rng.integers(1, 30)), int(rng.integers(1, 12)),
                                     int(rng.integers(1, 4))))
    # just enough blocks for the largest request alone: heavy preemption
    need = max(r.params.n * blocks_for(len(r.prompt) + r.params.max_new_tokens - 1, block_size)
               for r in requests)
    pool = FakePool(need + int(rng.integers(0, 4)), block_size)
    scheduler = sched.Scheduler(block_size, budget, max_batch_seqs=int(rng.integers(1, 9)))
    drive(scheduler, pool, requests)
    assert all(r.finished and r.state is sched.State.FINISHED for r in requests)
    assert all(len(s.outputs) == r.params.max_new_tokens for r in requests for s in r.sequences)
    assert pool.used() == 0


class SwappingPool(FakePool):
    """A FakePool for Scheduler(preemption="swap"): swap_out frees a sample's blocks and
    gives it a host copy that remembers how many tokens it holds; start() puts them back
    into blocks of the sample's own (a copy shares nothing)."""

    def swap_out(self, request):
        for sample in request.active():
            if sample.handle is not None and 0 < sample.computed < len(sample.tokens):
                sample.swapped = types.SimpleNamespace(length=sample.computed)
                self.own.pop(sample.handle)
                self.group.pop(sample.handle, None)
                self.partial_shared.discard(sample.handle)
                sample.handle = None

    def start(self, request):
        self.release(request)
        hits = 0
        for sample in request.active():
            sample.handle = self.next_seq
            self.next_seq += 1
            if sample.swapped is not None:
                sample.computed = sample.swapped.length
            else:
                sample.computed = min(self.prefix_hits.get(request.id, 0), len(sample.tokens) - 1)
                hits += sample.computed
            self.own[sample.handle] = blocks_for(sample.computed, self.block_size)
        return hits


def tight_workload(seed):
    """Random requests and a pool just large enough for the largest alone (heavy
    preemption): (requests, block_size, num_blocks, budget, max_batch_seqs)."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 8]))
    requests = [make_request(rid, int(rng.integers(1, 30)), int(rng.integers(4, 16)),
                             int(rng.integers(1, 4))) for rid in range(int(rng.integers(4, 12)))]
    need = max(r.params.n * blocks_for(len(r.prompt) + r.params.max_new_tokens - 1, block_size)
               for r in requests)
    return requests, block_size, need, int(rng.integers(8, 40)), int(rng.integers(2, 9))


def test_preemption_by_swapping_computes_every_token_once():
    swapping = 0
    for seed in range(12):
        computed = {}
        for preemption in ("recompute", "swap"):
            requests, block_size, num_blocks, budget, seqs = tight_workload(seed)
            pool = (SwappingPool if preemption == "swap" else FakePool)(num_blocks, block_size)
            scheduler = sched.Scheduler(block_size, budget, seqs, preemption=preemption)
            steps = drive(scheduler, pool, requests)        # never past the pool (run())
            assert all(r.finished for r in requests) and pool.used() == 0
            assert all(s.swapped is None for r in requests for s in r.sequences)
            computed[preemption] = sum(step.n_tokens for step in steps)
            preempted = sum(len(step.preempted) for step in steps)
            # each prompt once (its samples fork after it), then every sample's tokens but
            # its last; recompute computes the preempted requests' tokens again
            once = sum(len(r.prompt) + r.params.n * (r.params.max_new_tokens - 1)
                       for r in requests)
            if preemption == "swap":
                assert computed["swap"] == once, seed
                swapping += preempted > 0
            else:
                assert (computed["recompute"] > once) == (preempted > 0), seed
    assert swapping >= 8                          # the workloads do preempt


def test_a_sample_swapped_mid_prompt_waits_with_its_tokens_counted():
    scheduler = sched.Scheduler(block_size=2, max_batch_tokens=2, preemption="swap")
    pool = SwappingPool(8, 2)
    decoding, prompt = make_request(0, 2, max_tokens=12), make_request(1, 10, max_tokens=2)
    seen = []

    def watch(step):
        for sample in prompt.sequences:
            if step.preempted and sample.swapped is not None:
                seen.append((sample.computed, sample.swapped.length, sample.handle))
    drive(scheduler, pool, [decoding, prompt], on_step=watch)
    assert seen and all(0 < c == n < 10 and seq is None for c, n, seq in seen)
    assert prompt.preemptions >= 1 and prompt.finished


def test_preemption_modes_are_named():
    assert sched.Scheduler(4).preemption == "recompute"
    with pytest.raises(ValueError, match="preemption must be 'recompute' or 'swap', got 'disk'"):
        sched.Scheduler(4, preemption="disk")


def test_requests_that_can_never_fit_are_explained():
    params = sched.SamplingParams(max_new_tokens=10)
    assert sched.requests_fit(20, params, 4, 100, 100) is None
    assert "max_blocks_per_seq" in sched.requests_fit(200, params, 4, 100, 20)
    why = sched.requests_fit(20, sched.SamplingParams(max_new_tokens=10, n=4), 4, 20, 100)
    assert "n=4" in why and "the pool has 20" in why


@pytest.mark.parametrize("kwargs, match", [({"max_new_tokens": 0}, "max_new_tokens"), ({"n": 0}, "n must"),
                                           ({"temperature": -1}, "temperature"),
                                           ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p")])
def test_sampling_params_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sched.SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [({"max_batch_tokens": 2.5}, "max_batch_tokens"),
                                          ({"max_batch_tokens": True}, "max_batch_tokens"),
                                          ({"max_batch_tokens": 0}, "max_batch_tokens"),
                                          ({"max_batch_seqs": 0.5}, "max_batch_seqs"),
                                          ({"block_size": 4.0}, "block_size")])
def test_batch_limits_must_be_positive_integers(kwargs, name):
    # a budget of 2.5 tokens was accepted, then every step failed slicing a prompt with it
    args = {"block_size": 4, **kwargs}
    with pytest.raises(ValueError, match=f"{name} must be (an integer|at least 1), got "):
        sched.Scheduler(**args)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-39])
def test_denormal_temperatures_are_refused(temperature):
    # they passed the checks, then the sampler overflowed the logits divided by them
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or at least 1.18e-38"):
        sched.SamplingParams(temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, float(np.finfo(np.float32).tiny), 1e-30, 0.7])
def test_small_normal_temperatures_are_accepted(temperature):
    assert sched.SamplingParams(temperature=temperature).temperature == temperature


class Interrupting(FakePool):
    """A FakePool whose release is interrupted after freeing its first sequence."""
    armed = False

    def release(self, request):
        if self.armed and sum(s.handle is not None for s in request.sequences) > 1:
            self.armed = False
            first = next(s for s in request.sequences if s.handle is not None)
            self.own.pop(first.handle, None)
            first.handle = None
            raise KeyboardInterrupt
        super().release(request)


def test_an_interrupted_preemption_leaves_the_request_waiting_and_all_finish():
    # the queues change before the pool: an interrupted preemption leaves the request
    # waiting (first in line) with some sequences to free, which admission frees
    scheduler = sched.Scheduler(block_size=2, max_batch_tokens=64)
    pool = Interrupting(9, 2)
    old, new = make_request(0, 4, max_tokens=6), make_request(1, 2, max_tokens=6, n=2)
    interrupted = []

    def arm(step):
        if new.forked and new.state is sched.State.RUNNING and not interrupted:
            pool.armed = True
            try:
                scheduler.preempt(new, pool)
            except KeyboardInterrupt:
                interrupted.append(new)
            assert new.state is sched.State.WAITING and new not in scheduler.running
            assert scheduler.waiting[0] is new
            assert any(s.handle is not None for s in new.sequences)     # left to free

    drive(scheduler, pool, [old, new], on_step=arm)
    assert interrupted and all(r.finished for r in (old, new))
    assert pool.used() == 0 and pool.own == {}


def test_finish_takes_a_request_out_of_either_queue():
    scheduler = sched.Scheduler(block_size=4)
    waiting = make_request(0, 3)
    scheduler.add(waiting)
    scheduler.finish(waiting)
    assert waiting.state is sched.State.FINISHED and not scheduler.has_work


def test_a_forked_request_with_more_samples_than_a_batch_comes_back_after_preemption():
    # n=3 samples forked, then preempted, with max_batch_seqs=2: admission asked for room
    # for all three in one batch and never found it; every later step did nothing
    scheduler = sched.Scheduler(block_size=2, max_batch_tokens=64, max_batch_seqs=2)
    pool = FakePool(4, 2)
    old, new = make_request(0, 4, max_tokens=2), make_request(1, 1, max_tokens=2, n=3)
    steps = drive(scheduler, pool, [old, new], max_steps=100)
    assert new.preemptions >= 1 and len(new.active()) == 0
    assert all(len(step.items) <= 2 for step in steps)
    assert all(len(s.outputs) == 2 for s in new.sequences) and old.finished
    assert pool.used() == 0


# ---- speculative decoding: drafts ride on the chunk that ends a sample's tokens ---------

def decoding(scheduler, pool, requests):
    """Admit the requests and run their prompts; each sample then has one token to feed,
    and four drafts proposed after it."""
    for request in requests:
        scheduler.add(request)
    for request, sample, n in scheduler.schedule(pool).items:
        pool.run(sample, n)
        sample.tokens.append(7)
    for request in requests:
        assert request.state is sched.State.RUNNING
        for sample in request.sequences:
            sample.drafts, sample.drafted_after = [7, 7, 7, 7], len(sample.tokens)


def test_drafts_take_what_certain_work_leaves_of_the_budget():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=64)
    pool = FakePool(64, 4)
    a, b = make_request(0, 3, max_tokens=10), make_request(1, 3, max_tokens=10)
    decoding(scheduler, pool, [a, b])
    scheduler.add(make_request(2, 6))
    scheduler.max_batch_tokens = 10
    step = scheduler.schedule(pool)
    # the two decodes and the new prompt first (8 tokens), then 2 drafts for the oldest
    assert [(r.id, n) for r, _, n in step.items] == [(0, 3), (1, 1), (2, 6)]
    assert step.n_tokens == 10
    scheduler.max_batch_tokens = 64
    assert [n for _, _, n in scheduler.schedule(pool).items] == [5, 5, 6]


def test_drafts_never_preempt_and_take_only_blocks_left_over():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=64)
    pool = FakePool(3, 4)
    a, b = make_request(0, 3, max_tokens=10), make_request(1, 3, max_tokens=10)
    decoding(scheduler, pool, [a, b])                  # a block each: one left
    step = scheduler.schedule(pool)
    # a's newest token and 4 drafts need one more block; b's drafts would need another
    assert [(r.id, n) for r, _, n in step.items] == [(0, 5), (1, 1)]
    assert not step.preempted and a.preemptions == b.preemptions == 0


def test_drafts_wait_for_the_chunk_that_ends_the_tokens():
    scheduler = sched.Scheduler(block_size=4, max_batch_tokens=6)
    pool = FakePool(16, 4)
    request = make_request(0, 10, max_tokens=10)
    sample = request.sequences[0]
    sample.drafts, sample.drafted_after = [7, 7], 10   # proposed, then preempted (say)
    scheduler.add(request)
    first = scheduler.schedule(pool)
    assert [n for _, _, n in first.items] == [6]       # part of the tokens: no drafts
    pool.run(sample, 6)
    assert [n for _, _, n in scheduler.schedule(pool).items] == [4 + 2]
    sample.tokens.append(7)                            # a token chosen since: stale drafts
    assert sample.live_drafts == []


def test_sample_is_the_old_name_of_sequence():
    # issue 36: one noun for a generated sequence, beside the verb sample
    with pytest.warns(DeprecationWarning, match=r"kvlab.scheduler.Sample .* use kvlab.scheduler.Sequence"):
        old = sched.Sample
    assert old is sched.Sequence
    with pytest.raises(AttributeError):
        sched.NoSuchName


def test_the_old_names_of_a_requests_sequences_and_their_handles_warn():
    # issue 36's words: a Request holds `sequences` (it said samples), and a Sequence holds
    # the pool's `handle` for its K and V (it said seq, the noun of the Sequence itself)
    request = make_request(0, 3, n=2)
    with pytest.warns(DeprecationWarning, match=r"Request.samples .* use Request.sequences"):
        assert request.samples is request.sequences
    with pytest.warns(DeprecationWarning, match=r"Request.samples .* use Request.sequences"):
        request.samples = request.sequences[:1]
    assert len(request.sequences) == 1
    seq = request.sequences[0]
    with pytest.warns(DeprecationWarning, match=r"Sequence.seq .* use Sequence.handle"):
        seq.seq = "a pool's handle"
    assert seq.handle == "a pool's handle"
    with pytest.warns(DeprecationWarning, match=r"Sequence.seq .* use Sequence.handle"):
        assert seq.seq == "a pool's handle"


def test_positive_int_is_the_old_name_of_arguments_positive():
    with pytest.warns(DeprecationWarning, match=r"positive_int.* use kvlab.arguments.positive"):
        positive_int = sched.positive_int
    assert positive_int("max_batch_tokens", 3) == 3
    with pytest.raises(ValueError, match="max_batch_tokens"):
        positive_int("max_batch_tokens", 0)
