"""kvlab.Engine under failure: interrupts at every point of a step, failing requests,
refused constructions.

The guarantee under test (kvlab/engine.py, Engine's docstring): whatever raises out of
Engine.step (a KeyboardInterrupt, a forward call's error, a trace sink's), the engine and
its pool are left consistent, and calling run() again gives every request exactly the
tokens kvlab.generate gives for its prompt alone. A request whose next token cannot be
chosen (the sampler raises, or the logits hold NaN) fails on its own, with a finish reason
naming the step and why, and the others go on; run() never loops without progress.

Interrupts are injected by wrapping every call a step makes into its collaborators (the
model's forward_batch, the sampler, the scheduler, the engine's view of the pool, the
pool's own methods, swap_out and swap_in included, and the trace sink) and raising at the k-th call, either before the
call (it did not happen) or after it (it happened, its result was lost): the second is
what a Ctrl-C during forward_batch does, since the C call completes and the interrupt is
raised as it returns.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvlab
import kvlab.engine
from kvlab import SamplingParams
from kvlab.scheduler import State
from kvlab.speculative import PromptLookup
from block_trace import replay

MAX_STEPS = 2000
MAX_RESUMES = 500


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


_expected_cache: dict = {}


def expected(model, prompt, params, sample=0):
    """kvlab.generate's tokens for sample `sample` of a request, its prompt alone."""
    key = (tuple(prompt), params, sample)
    if key not in _expected_cache:
        seed = None if params.seed is None else params.seed + sample
        _expected_cache[key] = kvlab.generate(
            model, list(prompt), max_new_tokens=params.max_new_tokens,
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=seed).tokens
    return _expected_cache[key]


def assert_matches_generate(model, outputs, requests):
    """requests: request id -> (prompt, SamplingParams)."""
    assert sorted(outputs) == sorted(requests)
    for rid, (prompt, params) in requests.items():
        reasons = [o.finish_reason for o in outputs[rid].outputs]
        assert reasons == ["length"] * params.n, reasons
        for i, sample in enumerate(outputs[rid].outputs):
            assert sample.tokens == expected(model, prompt, params, i), \
                f"request {rid} sample {i} differs from kvlab.generate"


def assert_consistent(engine):
    """What must hold between steps, after an exception as after a normal step."""
    pool, scheduler = engine.pool, engine.scheduler
    pool.check()
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    held = set()
    for request in engine.requests.values():
        where = (request in running) + (request in waiting)
        if request.state is State.FINISHED:
            assert where == 0
            assert all(s.handle is None for s in request.sequences)
            continue
        assert where == 1, f"request {request.id} is in {where} queues"
        assert (request in running) == (request.state is State.RUNNING)
        for sample in request.sequences:
            if sample.swapped is not None:               # preempted by swapping: waits
                assert request.state is State.WAITING    # with its K and V in host memory
                assert sample.computed == sample.swapped.length
            if request.state is State.WAITING or sample.finished:
                assert sample.handle is None                # its blocks are freed
            elif sample.handle is not None:                 # (not forked yet: None)
                assert sample.handle.alive and sample.handle.length == sample.computed
                held.add((sample.handle.id, sample.handle.serial))
        if request.state is State.RUNNING:
            for sample in request.active():
                assert sample.handle is not None and sample.handle.alive
                assert len(sample.outputs) < request.params.max_new_tokens
    # every sequence in the pool is a sample's: nothing made and lost
    assert {(s.id, s.serial) for s in pool.sequences()} == held


# ---- injecting failures --------------------------------------------------------------------------

class Injector:
    """Counts the calls made through wrapped functions; raises `error` at the chosen
    ones (the k-th calls in `at`, or each with probability `rate`), before the call or
    after it."""

    def __init__(self, at=(), when="before", error=KeyboardInterrupt, rate=0.0, seed=0):
        self.at, self.when, self.error, self.rate = set(at), when, error, rate
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        self.fired = []

    def due(self) -> bool:
        return self.calls in self.at or (self.rate > 0 and self.rng.random() < self.rate)

    def wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            fire = self.due()
            if fire and self.when == "before":
                self.fired.append((self.calls, name, "before"))
                raise self.error(f"injected before call {self.calls} ({name})")
            result = fn(*args, **kwargs)
            if fire and self.when == "after":
                self.fired.append((self.calls, name, "after"))
                raise self.error(f"injected after call {self.calls} ({name})")
            return result
        return wrapper


class Sink(list):
    """A trace sink (a list, as trace= takes) whose append goes through the injector."""
    injector = None

    def append(self, event):
        if self.injector is None:
            return super().append(event)
        return self.injector.wrap("trace sink", super().append)(event)


@contextlib.contextmanager
def injected(engine, injector):
    """Every collaborator of engine's steps, wrapped by injector, for the with block."""
    model, pool, space = engine.model, engine.pool, engine.space
    patched = [(model, "forward_batch"), (engine.scheduler, "plan"), (engine.scheduler, "apply"), (space, "start"),
               (space, "release"), (space, "swap_out"), (pool, "new_sequence"), (pool, "fork"),
               (pool, "free"), (pool, "reuse_prefix"), (pool, "swap_out"), (pool, "swap_in")]
    for owner, name in patched:
        setattr(owner, name, injector.wrap(name, getattr(owner, name)))
    sampler = kvlab.engine.sample_token
    kvlab.engine.sample_token = injector.wrap("sampler", sampler)
    if engine._tracer is not None:
        engine._tracer.sink.__self__.injector = injector
    try:
        yield injector
    finally:
        kvlab.engine.sample_token = sampler
        for owner, name in patched:
            del owner.__dict__[name]
        if engine._tracer is not None:
            engine._tracer.sink.__self__.injector = None


def run_through(engine, error=KeyboardInterrupt, check=True):
    """run() again after every injected exception, checking consistency each time."""
    for _ in range(MAX_RESUMES):
        try:
            return engine.run(progress=False)
        except error:
            if check:
                assert_consistent(engine)
    raise AssertionError("the engine did not finish")


def workload(model, trace=None, preemption="recompute"):
    """Chunked prefill (a budget of 8), preemption (12 blocks of 4), a prefix-cache hit, a
    seeded n=2 request that forks, and greedy requests."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 256, 23).tolist()
    requests = [(shared, SamplingParams(max_new_tokens=6)),
                (shared[:17] + [5, 6], SamplingParams(max_new_tokens=5)),
                (rng.integers(0, 256, 9).tolist(), SamplingParams(max_new_tokens=5, n=2,
                                                                  temperature=0.8, seed=3)),
                (rng.integers(0, 256, 4).tolist(), SamplingParams(max_new_tokens=7))]
    pool = model.new_paged_pool(12, block_size=4)
    engine = kvlab.Engine(model, pool, max_batch_tokens=8, trace=trace, preemption=preemption)
    ids = {engine.add_request(p, sp): (p, sp) for p, sp in requests}
    return engine, ids


def count_calls(model, preemption="recompute"):
    engine, _ = workload(model, Sink(), preemption)
    with injected(engine, Injector()) as counter:
        engine.run(progress=False)
    assert engine.metrics and sum(m.preemptions for m in engine.metrics) >= 1
    assert sum(m.prefix_hit_tokens for m in engine.metrics) > 0
    if preemption == "swap":
        assert sum(m.swapped_in_blocks for m in engine.metrics) > 0
    return counter.calls


# ---- the interrupt sweep -------------------------------------------------------------------------

@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_at_any_call_of_any_step_resumes_exactly(model, when, preemption):
    total = count_calls(model, preemption)
    assert total > 100
    for k in range(1, total + 1):
        trace = Sink()
        engine, ids = workload(model, trace, preemption)
        with injected(engine, Injector(at=[k], when=when)) as injector:
            outputs = run_through(engine)
        assert len(injector.fired) == 1, k
        assert_matches_generate(model, outputs, ids)
        assert_consistent(engine)
        assert engine.pool.stats().blocks_used == 0 and not engine.has_work
        # no block event lost: the trace still replays into the pool's counts
        refs = replay(trace)
        assert refs == {b: int(engine.pool.ref_counts[b]) for b in refs}, injector.fired


class Refused(RuntimeError):
    """An ordinary error, raised before a call does anything (a pool that refuses, a
    device that fails before it starts)."""


def error_at_every_call(model, preemption, when):
    """For each call k of the workload's run: an error (Refused) raised before or after
    call k, run() again until it finishes; generate's tokens for every request but one a
    failed sampler call chose for, the engine consistent, and the trace still replaying."""
    total = count_calls(model, preemption)
    for k in range(1, total + 1):
        trace = Sink()
        engine, ids = workload(model, trace, preemption)
        with injected(engine, Injector(at=[k], when=when, error=Refused)) as injector:
            outputs = run_through(engine, error=Refused, check=False)
        assert len(injector.fired) == 1, k
        failed = {rid for rid, out in outputs.items()
                  if any(o.finish_reason.startswith("error:") for o in out.outputs)}
        if injector.fired[0][1] == "sampler":         # the request it chose for fails alone
            assert len(failed) == 1
        assert_matches_generate(model, {r: o for r, o in outputs.items() if r not in failed},
                                {r: ids[r] for r in ids if r not in failed})
        assert_consistent(engine)
        assert engine.pool.stats().blocks_used == 0 and not engine.has_work
        refs = replay(trace)
        assert refs == {b: int(engine.pool.ref_counts[b]) for b in refs}, injector.fired


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_an_error_at_any_call_of_any_step_and_run_again_finishes_exactly(model, preemption):
    # An error is no interrupt: it leaves step() at once, the run half done (queues and
    # pool as far as it went), and the next step plans from there. Before, an error after
    # the run freed a finished sequence left it running without a pool sequence (the next
    # step raised AttributeError), or a request waiting with all its rows (admission planned
    # a chunk of 0 tokens)
    error_at_every_call(model, preemption, "before")


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_an_error_after_any_call_did_its_work_and_run_again_finishes_exactly(model, preemption):
    # An error raised after the call it came from had done its work (a plug-in allocator's
    # free, raising after the pool freed the sequence, is one): the step stops there, and
    # the next plans from where the queues and the pool are. Before, a sequence whose
    # handle the pool had freed kept it, dead, and every later plan raised ValueError
    # counting its blocks (the run could never finish)
    error_at_every_call(model, preemption, "after")


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(48))
def test_repeated_errors_at_random_calls_still_finish_exactly(model, seed, preemption):
    # errors one after another, some while a preemption or an admission is half done.
    # Before: a request left waiting with the pool sequences its preemption had not freed
    # held blocks the one before it in line needed, and the engine stopped (seed 31, swap);
    # one left waiting with every row admitted again with 0 tokens to feed (44, and with
    # them all cut back: 12); a sequence given a new pool sequence kept counting its old
    # rows as computed, and the plan promised too few blocks (44, OutOfBlocks)
    engine, ids = workload(model, Sink(), preemption)
    with injected(engine, Injector(rate=0.2, seed=seed, error=Refused)) as injector:
        outputs = run_through(engine, error=Refused, check=False)
    assert len(injector.fired) > 3
    failed = {rid for rid, out in outputs.items()
              if any(o.finish_reason.startswith("error:") for o in out.outputs)}
    assert len(failed) <= sum(name == "sampler" for _, name, _ in injector.fired)
    assert_matches_generate(model, {r: o for r, o in outputs.items() if r not in failed},
                            {r: ids[r] for r in ids if r not in failed})
    assert_consistent(engine)
    assert engine.pool.stats().blocks_used == 0


def speculating_workload(model, preemption):
    """Prompt lookup on the model's own repetitive text: greedy n=2 requests (their two
    sequences alike, so the pool shares their full blocks), a sampled one, a tight pool."""
    text = model.encode("ROMEO:\n") + kvlab.generate(model, "ROMEO:\n", 60).tokens
    requests = [(text[:20], SamplingParams(max_new_tokens=12, n=2)),
                (text[5:14], SamplingParams(max_new_tokens=10)),
                (text[10:36], SamplingParams(max_new_tokens=8, n=2, temperature=0.8, seed=2)),
                (text[:7], SamplingParams(max_new_tokens=12))]
    engine = kvlab.Engine(model, model.new_paged_pool(12, block_size=8), trace=Sink(),
                          preemption=preemption, speculate=PromptLookup(), draft_tokens=3)
    return engine, {engine.add_request(p, sp): (p, sp) for p, sp in requests}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(48))
def test_repeated_errors_while_speculating_still_finish_exactly(model, seed, preemption):
    # a step that raised after its forward call leaves the drafts' rows in the pool, to be
    # cut back when the sequence runs again; before, the plan counted that sequence's blocks
    # from the rows it held, and a cut that left a shared block partly filled needed a copy
    # nobody had counted (OutOfBlocks from the forward call at every retry: seeds 31, 41)
    engine, ids = speculating_workload(model, preemption)
    with injected(engine, Injector(rate=0.1, seed=seed, error=Refused)) as injector:
        outputs = run_through(engine, error=Refused, check=False)
    failed = {rid for rid, out in outputs.items()
              if any(o.finish_reason.startswith("error:") for o in out.outputs)}
    greedy = [r for r in ids if ids[r][1].temperature == 0.0 and r not in failed]
    assert_matches_generate(model, {r: outputs[r] for r in greedy}, {r: ids[r] for r in greedy})
    assert_consistent(engine)
    assert engine.pool.stats().blocks_used == 0


@pytest.mark.parametrize("seed", range(6))
def test_repeated_interrupts_even_during_recovery_still_finish_exactly(model, seed):
    engine, ids = workload(model, Sink(), preemption=["recompute", "swap"][seed // 3])
    when = ["before", "after"][seed % 2]
    with injected(engine, Injector(rate=0.15, seed=seed, when=when)) as injector:
        outputs = run_through(engine, check=False)     # a repair may itself be interrupted
    assert len(injector.fired) > 10
    assert_matches_generate(model, outputs, ids)
    assert_consistent(engine)
    assert engine.pool.stats().blocks_used == 0


# ---- the regressions of issue 18, one by one ----------------------------------------------------

@pytest.mark.parametrize("step", range(1, 16))
def test_interrupt_after_forward_batch_returned_gives_generates_text(model, step):
    # The case: K and V went into the pool, the bookkeeping did not follow, and the
    # resumed run fed tokens twice (59 runs of 60 gave other text than generate).
    engine, ids = workload(model)
    injector = Injector(at=[step], when="after")
    engine.model.forward_batch = injector.wrap("forward_batch", engine.model.forward_batch)
    try:
        outputs = run_through(engine)
    finally:
        del engine.model.forward_batch
    assert injector.fired
    assert_matches_generate(model, outputs, ids)


def test_an_interrupt_mid_prompt_keeps_the_chunk_and_recomputes_nothing(model):
    prompt = np.random.default_rng(2).integers(0, 256, 60).tolist()
    params = SamplingParams(max_new_tokens=4)
    engine = kvlab.Engine(model, model.new_paged_pool(32, block_size=4), max_batch_tokens=8)
    rid = engine.add_request(prompt, params)
    model.reset_counters()
    injector = Injector(at=[3], when="after")          # after the third chunk of eight
    engine.model.forward_batch = injector.wrap("forward_batch", engine.model.forward_batch)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.run(progress=False)
        sample = engine.requests[rid].sequences[0]
        assert sample.computed == sample.handle.length == 24     # the chunk counts as done
        outputs = engine.run(progress=False)
    finally:
        del engine.model.forward_batch
    # every token ran exactly once: prompt + max_tokens - 1
    assert model.counters.tokens == 60 + 3
    assert_matches_generate(model, outputs, {rid: (prompt, params)})


def test_an_interrupt_after_the_last_chunk_recomputes_from_the_prefix_cache(model):
    # the logits that choose the first token were lost with the interrupt: the request is
    # recomputed, and its full blocks come back from the prefix cache
    prompt = np.random.default_rng(3).integers(0, 256, 30).tolist()
    params = SamplingParams(max_new_tokens=4)
    engine = kvlab.Engine(model, model.new_paged_pool(32, block_size=4), max_batch_tokens=16)
    rid = engine.add_request(prompt, params)
    model.reset_counters()
    injector = Injector(at=[2], when="after")
    engine.model.forward_batch = injector.wrap("forward_batch", engine.model.forward_batch)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.run(progress=False)
        assert_consistent(engine)
        outputs = engine.run(progress=False)
    finally:
        del engine.model.forward_batch
    assert model.counters.tokens <= 30 + 3 + 4          # at most the last partial block again
    assert outputs[rid].preemptions == 0                # a recompute, not a preemption
    assert_matches_generate(model, outputs, {rid: (prompt, params)})


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupted_sampler_puts_the_random_generator_back(model, when):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=5, n=3)
    prompt = [10, 20, 30, 40, 50]
    for k in range(1, 3 * 8 + 1):
        engine = kvlab.Engine(model, model.new_paged_pool(16, block_size=4))
        rid = engine.add_request(prompt, params)
        sampler = kvlab.engine.sample_token
        kvlab.engine.sample_token = Injector(at=[k], when=when).wrap("sampler", sampler)
        try:
            outputs = run_through(engine)
        finally:
            kvlab.engine.sample_token = sampler
        assert_matches_generate(model, outputs, {rid: (prompt, params)})


def test_a_raising_trace_sink_loses_no_event_and_no_step(model):
    class Flaky(list):
        calls = 0

        def append(self, event):
            self.calls += 1
            if self.calls % 4 == 0:
                raise OSError("disk full")
            super().append(event)

    trace = Flaky()
    engine, ids = workload(model, trace)
    failures = 0
    while engine.has_work:
        assert len(engine.metrics) < MAX_STEPS
        try:
            engine.step()
        except OSError:
            failures += 1
            assert_consistent(engine)
            continue
        # after every step that went through, the trace tells the pool's state exactly
        refs = replay(trace)
        assert refs == {b: int(engine.pool.ref_counts[b]) for b in refs}
    assert failures > 5
    assert_matches_generate(model, engine.outputs, ids)
    assert engine.pool.stats().blocks_used == 0


def overflowing(**kwargs):
    """SamplingParams with temperature 1e-320, which SamplingParams now refuses: as the
    issue's user had them, to show the engine survives what the sampler cannot do."""
    params = SamplingParams(**kwargs)
    object.__setattr__(params, "temperature", 1e-320)
    return params


def test_a_sampling_error_fails_that_request_alone_and_run_finishes(model):
    engine = kvlab.Engine(model, model.new_paged_pool(32, block_size=4), max_batch_tokens=8)
    good = {}
    for prompt in ([1, 2, 3], list(range(40, 60))):
        good[engine.add_request(prompt, SamplingParams(max_new_tokens=6))] = (prompt, SamplingParams(max_new_tokens=6))
    bad = engine.add_request([7, 8, 9, 10], overflowing(max_new_tokens=6, n=2, seed=1))
    step_of = {}
    while engine.has_work:
        assert len(engine.metrics) < MAX_STEPS
        result = engine.step()
        assert_consistent(engine)
        for rid, why in result.failed.items():
            step_of[rid] = result.step
            assert rid in result.finished
    outputs = engine.outputs
    assert list(step_of) == [bad]
    reasons = [o.finish_reason for o in outputs[bad].outputs]
    assert len(reasons) == 2 and reasons[0] == reasons[1]
    assert reasons[0].startswith(f"error: step {step_of[bad]}: ValueError: ")
    assert "logits" in reasons[0] and [o.tokens for o in outputs[bad].outputs] == [[], []]
    assert_matches_generate(model, {r: outputs[r] for r in good}, good)
    assert engine.pool.stats().blocks_used == 0
    # run() once more is a no-op, not an endless loop
    assert [o.finish_reason for o in engine.run(progress=False)[bad].outputs] == reasons


def test_run_finishes_after_a_sampling_error_instead_of_looping(model):
    engine = kvlab.Engine(model, model.new_paged_pool(16, block_size=4))
    bad = engine.add_request([1, 2, 3], overflowing(max_new_tokens=5))
    good = engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=5))
    steps = 0
    real_step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        assert steps < 50, "run() stepped without progress"
        return real_step()

    engine.step = counted
    outputs = engine.run(progress=False)
    assert outputs[bad].outputs[0].finish_reason.startswith("error: step 0: ")
    assert_matches_generate(model, {good: outputs[good]}, {good: ([4, 5, 6], SamplingParams(max_new_tokens=5))})


def test_any_exception_from_the_sampler_fails_only_its_request(model):
    engine, ids = workload(model)
    target = next(rid for rid, (p, sp) in ids.items() if sp.n == 2)
    sampler = kvlab.engine.sample_token
    calls = 0

    def broken(logits, temperature, top_k, top_p, rng):
        nonlocal calls
        if temperature > 0:
            calls += 1
            if calls == 3:
                raise ZeroDivisionError("float division by zero")
        return sampler(logits, temperature, top_k, top_p, rng)

    kvlab.engine.sample_token = broken
    try:
        outputs = engine.run(progress=False)
    finally:
        kvlab.engine.sample_token = sampler
    why = [o.finish_reason for o in outputs[target].outputs]
    assert all(r.startswith("error: step ") and "ZeroDivisionError: float division by zero" in r
               for r in why)
    # the tokens chosen before the failure are kept
    assert [len(o.tokens) for o in outputs[target].outputs] == [1, 1]
    del ids[target]
    assert_matches_generate(model, {r: outputs[r] for r in ids}, ids)
    assert_consistent(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_the_request_naming_the_step_and_others_go_on(model, temperature):
    # greedy decoding over NaN took token 0 (or the NaN's index) forever; now the request
    # fails at the step where it happened, in the words of the sampler that refused it
    engine = kvlab.Engine(model, model.new_paged_pool(32, block_size=4), max_batch_tokens=8)
    prompt = list(range(30, 50))                  # 20 tokens: 3 chunks of 8 ... then decodes
    poisoned = engine.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=temperature,
                                                         seed=4))
    others = {}
    for p in ([1, 2, 3, 4], [9] * 11):
        others[engine.add_request(p, SamplingParams(max_new_tokens=6))] = (p, SamplingParams(max_new_tokens=6))
    real = model.forward_batch
    poison_at = 4                                  # the 5th forward call: mid-generation

    def forward_batch(seqs, chunks):
        logits = real(seqs, chunks)
        if len(engine.metrics) == poison_at:
            target = engine.requests[poisoned].sequences[0].handle
            for i, seq in enumerate(seqs):
                if seq is target:
                    logits[i, 17] = np.nan
        return logits

    model.forward_batch = forward_batch
    try:
        outputs = engine.run(progress=False)
    finally:
        del model.forward_batch
    reason = outputs[poisoned].outputs[0].finish_reason
    why = ("the logits hold NaN: no token can be chosen" if temperature == 0.0 else   # argmax's
           "the logits are not numbers (NaN, or all -inf): no token can be sampled")   # the core's
    assert reason == f"error: step {poison_at}: ValueError: {why}"
    assert engine.metrics[poison_at].failed == {poisoned: reason}
    good_tokens = expected(model, prompt, SamplingParams(max_new_tokens=6, temperature=temperature, seed=4))
    produced = outputs[poisoned].outputs[0].tokens
    assert 0 < len(produced) < 6 and produced == good_tokens[:len(produced)]
    assert_matches_generate(model, {r: outputs[r] for r in others}, others)
    assert engine.pool.stats().blocks_used == 0


def test_a_request_failing_beside_one_mid_prompt_leaves_it_alone(model):
    # a long prompt is still being prefilled in chunks when the request beside it fails
    # and its blocks are freed
    rng = np.random.default_rng(6)
    long_prompt = rng.integers(0, 256, 50).tolist()
    engine = kvlab.Engine(model, model.new_paged_pool(40, block_size=4), max_batch_tokens=12)
    bad = engine.add_request(long_prompt[:9], overflowing(max_new_tokens=4))
    good = engine.add_request(long_prompt, SamplingParams(max_new_tokens=5))
    first = engine.step()
    assert first.failed and bad in first.failed
    assert engine.requests[good].sequences[0].computed < 50     # mid-prompt
    outputs = engine.run(progress=False)
    assert_matches_generate(model, {good: outputs[good]}, {good: (long_prompt, SamplingParams(max_new_tokens=5))})
    assert engine.pool.stats().blocks_used == 0


def test_run_refuses_to_spin_when_the_pool_is_held_outside_the_engine(model):
    pool = model.new_paged_pool(8, block_size=4)
    squatter = pool.new_sequence()
    model.prefill(list(range(28)), squatter)            # 7 of 8 blocks
    engine = kvlab.Engine(model, pool)
    engine.add_request(list(range(10)), SamplingParams(max_new_tokens=3))   # needs 3 blocks
    steps = 0
    real_step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        assert steps < 50, "run() stepped without progress"
        return real_step()

    engine.step = counted
    with pytest.raises(RuntimeError, match=r"cannot make progress: 1 requests wait .* 1 blocks"):
        engine.run(progress=False)
    with pytest.raises(RuntimeError, match="cannot make progress"):
        real_step()                                     # step() alone says so too
    assert squatter.alive and squatter.length == 28     # the engine never touches it
    pool.free(squatter)
    assert engine.run(progress=False)[0].outputs[0].tokens == expected(model, list(range(10)),
                                                                 SamplingParams(max_new_tokens=3))


# ---- construction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch_tokens": 2.5}, "max_batch_tokens must be an integer, got 2.5"),
    ({"max_batch_tokens": 0}, "max_batch_tokens"),
    ({"max_batch_tokens": True}, "max_batch_tokens"),
    ({"max_batch_tokens": "8"}, "max_batch_tokens"),
    ({"max_batch_seqs": 0}, "max_batch_seqs must be at least 1, got 0"),
    ({"max_batch_seqs": 1.5}, "max_batch_seqs"),
])
def test_bad_batch_limits_are_refused_at_construction(model, tmp_path, kwargs, match):
    trace = tmp_path / "trace.jsonl"
    with pytest.raises(ValueError, match=match):
        kvlab.Engine(model, model.new_paged_pool(8, block_size=4), trace=trace, **kwargs)
    assert not trace.exists()                          # nothing opened, nothing left behind


def test_numpy_integer_limits_are_accepted(model):
    engine = kvlab.Engine(model, model.new_paged_pool(8, block_size=4),
                          max_batch_tokens=np.int64(8), max_batch_seqs=np.int32(2))
    assert engine.scheduler.max_batch_tokens == 8 and engine.scheduler.max_batch_seqs == 2


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_a_pool_made_for_another_model_is_refused(model, dtype):
    mha = kvlab.load(kvlab.MHA_MODEL)                # 8 KV heads where the default has 2
    with pytest.raises(ValueError, match=r"this pool holds 6 layers x 8 KV heads x 16, but the "
                                         r"model needs 6 x 2 x 16"):
        kvlab.Engine(model, mha.new_paged_pool(8, block_size=4, dtype=dtype))
    with pytest.raises(ValueError, match=r"6 layers x 2 KV heads x 16, but the model needs 6 x 8"):
        kvlab.Engine(mha, model.new_paged_pool(8, block_size=4, dtype=dtype))
    kvlab.Engine(model, model.new_paged_pool(8, block_size=4, dtype=dtype))   # its own: fine


def test_things_that_are_not_pools_are_refused(model):
    with pytest.raises(TypeError, match="pool must be a kvlab.PagedPool"):
        kvlab.Engine(model, model.new_cache(16))
    with pytest.raises(TypeError, match="trace must be"):
        kvlab.Engine(model, model.new_paged_pool(8, block_size=4), trace=42)


# ---- the state machine -----------------------------------------------------------------------------

class InterruptedEngine(RuleBasedStateMachine):
    """Requests arrive between steps; some steps are interrupted at a random call, before
    or after it; after each, the engine is consistent, and at the end every request has
    exactly kvlab.generate's tokens and the pool is empty. Preemption by recomputing or by
    swapping, and speculation (prompt lookup, 1-4 drafts) on or off. With speculation on,
    requests are greedy: sampled speculation resumed after an interrupt can differ from an
    uninterrupted run (issue 36, where the step is rebuilt as plan, run, commit)."""

    model = None

    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 4, 8]),
                budget=st.integers(1, 24), seqs=st.integers(1, 4),
                fmt=st.sampled_from(["fp32", "int8"]),
                preemption=st.sampled_from(["recompute", "swap"]),
                drafts=st.sampled_from([0, 0, 1, 4]))
    def make(self, num_blocks, block_size, budget, seqs, fmt, preemption, drafts):
        if InterruptedEngine.model is None:
            InterruptedEngine.model = kvlab.load()
        self.fmt = fmt
        self.pool = self.model.new_paged_pool(num_blocks, block_size, dtype=fmt, max_seqs=6)
        self.trace = Sink()
        speculation = {"speculate": PromptLookup(), "draft_tokens": drafts} if drafts else {}
        self.speculating = bool(drafts)
        self.engine = kvlab.Engine(self.model, self.pool, max_batch_tokens=budget,
                                   max_batch_seqs=seqs, trace=self.trace, preemption=preemption,
                                   **speculation)
        self.requests = {}

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(0, 255), max_size=12),
          max_tokens=st.integers(1, 8), n=st.integers(1, 3), sampled=st.booleans(),
          seed=st.integers(0, 9))
    def add(self, prefix, tail, max_tokens, n, sampled, seed):
        # prompts that share their starts, for the prefix cache
        prompt = ([3, 1, 4, 1, 5, 9, 2, 6][:prefix * 4] + tail) or [7]
        sampled = sampled and not self.speculating
        params = SamplingParams(max_new_tokens=max_tokens, n=n, temperature=0.8 if sampled else 0.0,
                                seed=seed)
        try:
            rid = self.engine.add_request(prompt, params)
        except ValueError:                     # too big for this pool
            return
        self.requests[rid] = (prompt, params)

    @rule()
    def step(self):
        self.engine.step()

    @rule(at=st.lists(st.integers(1, 25), min_size=1, max_size=3),
          when=st.sampled_from(["before", "after"]))
    def interrupted_step(self, at, when):
        # a second interrupt may hit the repair that follows the first
        with injected(self.engine, Injector(at=at, when=when)):
            try:
                self.engine.step()
            except KeyboardInterrupt:
                pass

    @invariant()
    def consistent(self):
        if hasattr(self, "engine"):
            assert_consistent(self.engine)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        outputs = self.engine.run(progress=False)
        options = {} if self.fmt == "fp32" else {"dtype": self.fmt}
        for rid, (prompt, params) in self.requests.items():
            for i, sample in enumerate(outputs[rid].outputs):
                tokens = sample.tokens
                seed = None if params.seed is None else params.seed + i
                want = kvlab.generate(self.model, prompt, params.max_new_tokens,
                                      temperature=params.temperature, seed=seed,
                                      **options).tokens
                assert tokens == want, f"request {rid} sample {i}"
        assert self.pool.stats().blocks_used == 0
        refs = replay(self.trace)
        assert refs == {b: int(self.pool.ref_counts[b]) for b in refs}


InterruptedEngine.TestCase.settings = settings(max_examples=30, stateful_step_count=20,
                                               deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestInterruptedEngine = InterruptedEngine.TestCase


def test_interrupts_around_an_end_of_sequence_resume_exactly(model):
    # the bundled model has no EOS token: the engine is told one that generation picks
    prompt = [5, 6, 7, 8, 9]
    full = kvlab.generate(model, prompt, 20).tokens
    eos = full[4]
    before_eos = full[:full.index(eos)]

    def make():
        engine = kvlab.Engine(model, model.new_paged_pool(26, block_size=2), max_batch_tokens=3,
                              trace=Sink())
        engine._eos = eos
        engine.add_request(prompt, SamplingParams(max_new_tokens=20, n=2))
        engine.add_request([1, 2], SamplingParams(max_new_tokens=5))
        return engine

    engine = make()
    with injected(engine, Injector()) as counter:
        engine.run(progress=False)
    for when in ("before", "after"):
        for k in range(1, counter.calls + 1):
            engine = make()
            with injected(engine, Injector(at=[k], when=when)):
                outputs = run_through(engine)
            assert [o.tokens for o in outputs[0].outputs] == [before_eos] * 2, (when, k)
            assert [o.finish_reason for o in outputs[0].outputs] == ["eos", "eos"]
            assert engine.pool.stats().blocks_used == 0
