"""kvlab.Engine's long steps: a step of more than about measure.CHUNK_FLOPS of work runs its
forward in several calls, and a Ctrl-C between two of them stops the step there, unfinished,
for the next step() or run() to finish (kvlab/engine.py's module text).

What is checked, never how fast (benchmarks/interrupt_latency.py measures that): how the
calls are cut, that a SIGINT sent during a call stops the step before the next call (so
Ctrl-C waits at most one call, not the whole step), that the engine stopped that way is
consistent and finishes with exactly the tokens kvlab.generate gives, and an uninterrupted
engine gives when it samples, speculates, forks and preempts. The SIGINTs are real, sent to
this process from inside a wrapped forward_batch: where they land is deterministic.
Most tests shrink the calls (kvlab.engine's CHUNK_FLOPS and CHUNK_MIN) so that short
prompts on the bundled model make steps of many calls.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest

import kvlab
import kvlab.engine
from kvlab import SamplingParams
from kvlab.measure import CHUNK_FLOPS, CHUNK_MIN, work_rates
from kvlab.scheduler import State
from kvlab.speculative import PromptLookup
from step_interrupts import Interrupter, interrupted_step

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to oneself")


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture
def small_calls(monkeypatch):
    """Forward calls of about 20 MFLOP (9 tokens of the bundled model), at least 4 tokens:
    a 40-token prompt takes several."""
    monkeypatch.setattr(kvlab.engine, "CHUNK_FLOPS", 2e7)
    monkeypatch.setattr(kvlab.engine, "CHUNK_MIN", 4)


class Calls:
    """Wraps engine.model.forward_batch: records each call's token counts, and sends this
    process SIGINT during the calls numbered in `sigint_at` (after the C call returned,
    before the engine sees its logits: where a Ctrl-C during the call is first seen), or as
    those of `sigint_before` start (before the C call: one let through stops it at once)."""

    def __init__(self, engine, sigint_at=(), error_at=(), sigint_before=()):
        self.engine, self.sigint_at, self.error_at = engine, set(sigint_at), set(error_at)
        self.sigint_before = set(sigint_before)
        self.tokens, self.inner = [], engine.model.forward_batch
        engine.model.forward_batch = self

    def __call__(self, handles, chunks, all_logits=False):
        if len(self.tokens) + 1 in self.error_at:
            self.tokens.append(None)
            raise RuntimeError("injected: the forward call failed")
        if len(self.tokens) + 1 in self.sigint_before:
            self.tokens.append(None)             # (counted: it was asked for)
            os.kill(os.getpid(), signal.SIGINT)
        logits = self.inner(handles, chunks, all_logits=all_logits)
        self.tokens.append([len(c) for c in chunks])
        if len(self.tokens) in self.sigint_at:
            os.kill(os.getpid(), signal.SIGINT)
        return logits

    def remove(self):
        del self.engine.model.__dict__["forward_batch"]


def step_taking_interrupt(engine):
    """engine.step(): True if it raised KeyboardInterrupt (a pending SIGINT lands inside)."""
    try:
        try:
            engine.step()
        finally:
            time.sleep(0)                 # a SIGINT still pending is raised here
    except KeyboardInterrupt:
        return True
    return False


def prompts(model, n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, length).tolist() for _ in range(n)]


def tokens_of(outputs):
    return {rid: [(o.tokens, o.finish_reason) for o in out.outputs] for rid, out in outputs.items()}


def assert_unfinished_is_consistent(engine, number):
    """A step stopped between its forward calls: nothing of it committed, the pool sound,
    every running sample's handle holding at least its committed rows."""
    assert engine.unfinished == number and engine.has_work
    assert len(engine.metrics) == number
    engine.pool.check()
    held = set()
    for request in engine.requests.values():
        assert (request in engine.scheduler.running) == (request.state is State.RUNNING)
        for sample in request.sequences:
            if sample.handle is not None:
                assert request.state is State.RUNNING and sample.handle.alive
                assert sample.computed <= sample.handle.length <= len(sample.tokens) + 8
                held.add((sample.handle.id, sample.handle.serial))
    assert {(s.id, s.serial) for s in engine.pool.sequences()} == held


# ---- how a long step's forward is cut ----------------------------------------------------------

def test_a_long_prefill_step_runs_in_calls_of_about_chunk_flops(model):
    # 4 prompts of 500 tokens in one step, the real sizes: about 6 GFLOP
    engine = kvlab.Engine(model, num_blocks=140, block_size=16, max_batch_tokens=2000)
    asked = prompts(model, 4, 500)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=3)) for p in asked]
    calls = Calls(engine)
    first = engine.step()
    assert first.prefill_tokens == 2000 and len(calls.tokens) >= 3
    per_token, per_position = work_rates(model.config)
    fed = [0] * 4                          # each prompt's rows so far, in the calls' order
    for counts in calls.tokens:
        n_call = sum(counts)
        work = 0.0
        # a call's sequences are the step's items in order, the first one partly done
        order = [i for i in range(4) if fed[i] < 500][:len(counts)]
        for i, n in zip(order, counts):
            work += n * per_token + per_position * (n * fed[i] + n * (n + 1) // 2)
            fed[i] += n
        assert work <= CHUNK_FLOPS * 1.01 or n_call <= CHUNK_MIN, (counts, work)
    assert fed == [500] * 4
    calls.tokens.clear()
    engine.step()                          # a decode step of 4 tokens: one call
    assert calls.tokens == [[1, 1, 1, 1]]
    calls.remove()
    outputs = engine.run(progress=False)
    for rid, prompt in zip(ids, asked):
        assert outputs[rid].outputs[0].tokens == kvlab.generate(model, prompt, 3).tokens


def test_a_short_step_is_one_call(model):
    engine = kvlab.Engine(model, num_blocks=40, block_size=16, max_batch_tokens=256)
    for p in prompts(model, 3, 60):
        engine.add_request(p, SamplingParams(max_new_tokens=2))
    calls = Calls(engine)
    engine.step()
    assert calls.tokens == [[60, 60, 60]]


# ---- Ctrl-C between the calls -------------------------------------------------------------------

def test_ctrl_c_in_a_long_step_stops_it_after_that_call_and_run_finishes_it(model):
    # the real sizes: a SIGINT during the first of several calls stops the step before the
    # second (Ctrl-C waits one call's time, not the step's)
    engine = kvlab.Engine(model, num_blocks=140, block_size=16, max_batch_tokens=2000)
    asked = prompts(model, 4, 500, seed=1)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=3)) for p in asked]
    calls = Calls(engine, sigint_at=[1])
    assert step_taking_interrupt(engine)
    assert len(calls.tokens) == 1
    assert_unfinished_is_consistent(engine, 0)
    calls.remove()
    outputs = engine.run(progress=False)
    assert engine.unfinished is None and engine.metrics[0].prefill_tokens == 2000
    for rid, prompt in zip(ids, asked):
        assert outputs[rid].outputs[0].tokens == kvlab.generate(model, prompt, 3).tokens


def long_context_engine(model, extra=200):
    """The bundled model given room for 8,000 positions, its pool's prefix cache holding a
    prompt's first 6,912 tokens (rows appended by hand: what they hold does not matter, the
    engine reuses them), and a request of that prompt and `extra` tokens more: its prefill
    goes in calls of CHUNK_MIN tokens at about 7,000 positions, each more than
    measure.CHUNK_FLOPS (the C core's budget: a second each on a 110M model)."""
    long = kvlab.Model(model.config.replace(max_seq_len=8000), model.weights, model.tokenizer)
    pool = long.new_paged_pool(num_blocks=460, block_size=16)
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, long.config.vocab_size, 6912 + extra).tolist()
    c = long.config
    rows = rng.standard_normal((6912, c.n_layers, c.n_kv_heads, c.head_dim), np.float32)
    seq = pool.new_sequence()
    pool.append(seq, np.array(prompt[:6912], np.int32), rows, rows)
    pool.free(seq)                         # its full blocks stay in the prefix cache
    engine = kvlab.Engine(long, pool, max_batch_tokens=512)
    return engine, engine.add_request(prompt, SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize("k", [1, 2])
def test_ctrl_c_during_a_long_call_stops_it_and_the_step_goes_on_exactly(model, k):
    # a call is never cut below CHUNK_MIN tokens, so at a long context one call is more
    # than the C core's budget: a SIGINT during it is let through, and the call stops
    # between two layers (or before it began), changing nothing; the step stops unfinished
    # with the calls before it done. Before, the SIGINT was held to the end of that call
    # and the step stopped after it, with its rows
    engine, rid = long_context_engine(model)
    per_token, per_position = work_rates(engine.model.config)
    assert 96 * per_token + per_position * (96 * 6912 + 96 * 97 // 2) > kvlab.measure.CHUNK_FLOPS
    reference, _ = long_context_engine(model)
    counter = Calls(reference)
    want = reference.run(progress=False)[rid].outputs[0].tokens
    assert counter.tokens[:2] == [[CHUNK_MIN], [CHUNK_MIN]]      # the calls of the prefill
    calls = Calls(engine, sigint_before=[k])
    assert step_taking_interrupt(engine)
    assert len(calls.tokens) == k
    assert_unfinished_is_consistent(engine, 0)
    (seq,) = engine.requests[rid].sequences
    assert seq.handle.length == 6912 + CHUNK_MIN * (k - 1)    # none of call k's rows
    calls.remove()
    assert engine.run(progress=False)[rid].outputs[0].tokens == want
    assert engine.pool.stats().blocks_used == 0


def sampled_engine(model, **kwargs):
    """Sampling, n=2 forks, prompt-lookup drafts, preemption in a tight pool, chunked
    prefill: the requests of the tests below."""
    engine = kvlab.Engine(model, model.new_paged_pool(20, 4, max_seqs=6), max_batch_tokens=48,
                          speculate=PromptLookup(), draft_tokens=3, **kwargs)
    text = model.encode("ROMEO:\n") + kvlab.generate(model, "ROMEO:\n", 40).tokens
    for i in range(3):
        engine.add_request(text[2 * i:2 * i + 30],
                           SamplingParams(max_new_tokens=8, temperature=0.9, seed=i, n=2))
    engine.add_request(prompts(model, 1, 40)[0], SamplingParams(max_new_tokens=6))
    return engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_ctrl_c_between_any_two_calls_of_any_step_resumes_exactly(model, small_calls, preemption):
    reference = sampled_engine(model, preemption=preemption)
    counter = Calls(reference)
    want = tokens_of(reference.run(progress=False))
    assert sum(m.preemptions for m in reference.metrics) > 0
    n_calls = len(counter.tokens)
    assert n_calls > len(reference.metrics) + 5          # many steps took several calls
    stopped = 0
    for k in range(1, n_calls + 1):
        engine = sampled_engine(model, preemption=preemption)
        calls = Calls(engine, sigint_at=[k])
        while len(calls.tokens) < k:
            number = len(engine.metrics)
            if step_taking_interrupt(engine):
                assert len(calls.tokens) == k        # no call after the one it came in
                if engine.unfinished is not None:    # stopped between two calls
                    assert_unfinished_is_consistent(engine, number)
                    stopped += 1
                else:                                # it came in the step's last call:
                    assert len(engine.metrics) == number + 1    # the step was done
        calls.remove()
        assert tokens_of(engine.run(progress=False)) == want, k
        assert engine.pool.stats().blocks_used == 0
    assert stopped > n_calls // 3


def test_an_unfinished_step_takes_new_requests_and_a_second_ctrl_c(model, small_calls):
    reference = sampled_engine(model)
    extra = prompts(model, 1, 25, seed=5)[0]
    for _ in range(2):
        reference.step()
    reference.add_request(extra, SamplingParams(max_new_tokens=4))
    want = tokens_of(reference.run(progress=False))
    engine = sampled_engine(model)
    engine.step()
    calls = Calls(engine, sigint_at=[1, 2])    # twice in one step: stopped, then again
    assert step_taking_interrupt(engine) and engine.unfinished == 1
    assert step_taking_interrupt(engine) and engine.unfinished == 1
    engine.add_request(extra, SamplingParams(max_new_tokens=4))    # between: it waits
    calls.remove()
    assert tokens_of(engine.run(progress=False)) == want


def test_an_error_after_a_ctrl_c_ends_the_unfinished_step_and_run_still_finishes(model,
                                                                                 small_calls):
    engine = kvlab.Engine(model, num_blocks=30, block_size=8, max_batch_tokens=64)
    asked = prompts(model, 2, 30, seed=2)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in asked]
    calls = Calls(engine, sigint_at=[1], error_at=[2])
    assert step_taking_interrupt(engine) and engine.unfinished == 0
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.unfinished is None and not engine.metrics     # planned afresh next
    engine.pool.check()
    calls.remove()
    outputs = engine.run(progress=False)
    for rid, prompt in zip(ids, asked):
        assert outputs[rid].outputs[0].tokens == kvlab.generate(model, prompt, 5).tokens


def test_a_held_ctrl_c_is_taken_once(model, small_calls):
    # the step that stops takes the SIGINT: the with block's end does not raise it again,
    # and the handler Python had is back
    engine = kvlab.Engine(model, num_blocks=30, block_size=8, max_batch_tokens=64)
    engine.add_request(prompts(model, 1, 40, seed=3)[0], SamplingParams(max_new_tokens=2))
    calls = Calls(engine, sigint_at=[1])
    with pytest.raises(KeyboardInterrupt, match="unfinished"):
        engine.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    calls.remove()
    assert engine.step().prefill_tokens == 40 and engine.unfinished is None


def test_a_ctrl_c_at_any_line_of_a_step_of_many_calls_resumes_exactly(model, small_calls):
    # test_engine_interrupts' sweep (a real SIGINT at every 7th line kvlab runs in a step),
    # on a step whose forward runs in several calls: wherever it lands, the step is done
    # whole, not at all, or stopped between two calls, and the run ends with the same tokens
    def engine():
        made = sampled_engine(model, preemption="swap")
        made.step()
        return made

    reference = engine()
    calls = Calls(reference)
    reference.step()
    assert len(calls.tokens) >= 3                 # the step interrupted: several calls
    calls.remove()
    counter = Interrupter([], "sigint at line")
    interrupted_step(engine(), counter)
    assert counter.lines > 300
    want = tokens_of(reference.run(progress=False))
    outcomes = set()
    for line in range(1, counter.lines + 1, 7):
        resumed = engine()
        interrupter = Interrupter([line], "sigint at line")
        interrupted_step(resumed, interrupter)
        assert len(interrupter.fired) == 1, line
        outcomes.add((len(resumed.metrics), resumed.unfinished))
        if resumed.unfinished is not None:
            assert_unfinished_is_consistent(resumed, 1)
        assert tokens_of(resumed.run(progress=False)) == want, interrupter.fired
    # done whole, stopped between calls, and (a SIGINT in the plan: a drafter's) not done
    assert {(2, None), (1, 1)} <= outcomes <= {(2, None), (1, 1), (1, None)}


# ---- errors between the calls -------------------------------------------------------------------

def test_an_error_in_any_call_of_a_long_step_leaves_a_step_the_next_plans_from(model,
                                                                             small_calls):
    # a forward call that raises (not Ctrl-C) ends its step for good, with the rows of the
    # calls before in the pool: the next step plans from them, and the run ends with
    # generate's tokens (greedy, prefix cache and preemption in a tight pool)
    def engine():
        made = kvlab.Engine(model, model.new_paged_pool(16, 4), max_batch_tokens=40)
        asked = prompts(model, 3, 18, seed=4) + [prompts(model, 1, 18, seed=4)[0][:13] + [7]]
        return made, {made.add_request(p, SamplingParams(max_new_tokens=5)): p for p in asked}

    reference, _ = engine()
    counter = Calls(reference)
    reference.run(progress=False)
    assert sum(m.preemptions for m in reference.metrics) > 0
    for k in range(1, len(counter.tokens) + 1):
        made, asked = engine()
        calls = Calls(made, error_at=[k])
        with pytest.raises(RuntimeError, match="injected"):
            made.run(progress=False)
        assert made.unfinished is None
        made.pool.check()
        calls.remove()
        outputs = made.run(progress=False)
        for rid, prompt in asked.items():
            assert outputs[rid].outputs[0].tokens == kvlab.generate(model, prompt, 5).tokens, k
        assert made.pool.stats().blocks_used == 0
