"""Speculative decoding in kvlab.Engine (Engine(..., speculate=drafter, draft_tokens=k)).

The contract: speculation changes how many forward passes the engine runs, never what it
generates. Greedy outputs are token for token the engine's without speculation (and so
kvlab.generate's), with every drafter, under preemption, chunked prefill, prefix caching
on or off, forks and quantized pools; seeded sampled outputs are exactly
generate(speculate=...)'s when every pass has room for its drafts. Around it:

  * the pool: after every step each sequence holds exactly what plain decoding holds (the
    refused drafts' rows are cut off), and at the end the prefix cache holds the same
    blocks as without speculation; the block trace still replays into the pool's counts;
  * stop tokens and max_new_tokens cut a pass's tokens exactly where plain decoding stops;
  * streaming: StepResult.new_tokens never reports a token that is later taken back;
  * the counters add up (per sample, per request, per step and for the engine);
  * failures: interrupts at every call of every step resume exactly; a drafter that
    raises or proposes junk fails its request alone; bad arguments are refused at once.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
import kvlab.engine
from kvlab import SamplingParams
from kvlab.scheduler import State
from kvlab.speculative import DraftModel, PromptLookup
from block_trace import replay

MAX_STEPS = 2000

# text that repeats itself, so that prompt lookup's drafts are often right
PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft",
           "To be, or not to be, that is the question. To be, or not",
           "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nJULIET:\nO Romeo",
           "KING HENRY:\nNow, lords, the field is ours"]


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def drafters(model):
    return {"prompt lookup": lambda: PromptLookup(),
            "first layer": lambda: DraftModel.first_layers(model, 1)}


def encoded(model, prompts=PROMPTS):
    return [model.encode(p) for p in prompts]


def serve(model, requests, speculate=None, k=4, num_blocks=200, block_size=16,
          max_batch_tokens=256, check=None, trace=None, **pool_options):
    """Every request through one engine, step by step (pool.check() after each step, and
    `check(engine)` if given); returns the engine. requests: [(prompt ids, params)]."""
    pool = model.new_paged_pool(num_blocks, block_size, **pool_options)
    engine = kvlab.Engine(model, pool, max_batch_tokens=max_batch_tokens, trace=trace,
                          speculate=speculate, draft_tokens=k)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    while engine.has_work:
        assert len(engine.metrics) < MAX_STEPS, "the engine stopped making progress"
        engine.step()
        pool.check()
        if check is not None:
            check(engine)
    assert pool.stats().blocks_used == 0 and pool.stats().n_sequences == 0
    return engine


def tokens_of(engine):
    return {rid: [(o.tokens, o.finish_reason) for o in out.outputs]
            for rid, out in engine.outputs.items()}


def greedy_requests(model, max_new_tokens=(60, 45, 50, 30), n=(1, 1, 2, 1)):
    return [(prompt, SamplingParams(max_new_tokens=m, n=k))
            for prompt, m, k in zip(encoded(model), max_new_tokens, n)]


def pool_holds_plain_decodings_rows(engine):
    """What must hold between steps: each running sample's sequence holds the K and V of
    the tokens it has computed (decoding: all but its newest, as plain decoding's would),
    and the pool's tokens for them are the sample's own (no draft left behind)."""
    pool = engine.pool
    for request in engine.scheduler.running:
        for sample in request.sequences:
            seq = sample.handle
            if seq is None:
                continue
            assert seq.length == sample.computed <= len(sample.tokens)
            table = seq.block_table.tolist()
            stored = np.concatenate([pool.block_tokens[b] for b in table])[:seq.length] \
                if table else np.zeros(0)
            assert stored.tolist() == sample.tokens[:seq.length]


def cached_blocks(pool):
    return sorted(tuple(pool.block_tokens[b].tolist()) for b in pool.cached_blocks)


# ---- greedy: the same tokens as without speculation ------------------------------------------

@pytest.mark.parametrize("drafter", ["prompt lookup", "first layer"])
@pytest.mark.parametrize("setting", ["roomy", "tight pool", "small budget", "no prefix cache",
                                     "small blocks"])
def test_greedy_output_is_the_engines_own_without_speculation(model, drafter, setting):
    # tight: the n=2 request alone needs 16 blocks of 16 (2 x 114 tokens)
    options = {"roomy": {}, "tight pool": {"num_blocks": 16},
               "small budget": {"max_batch_tokens": 7},
               "no prefix cache": {"prefix_cache": False, "num_blocks": 18},
               "small blocks": {"block_size": 2, "num_blocks": 130}}[setting]
    requests = greedy_requests(model)
    plain = serve(model, requests, **options)
    trace = []

    def check(engine):
        pool_holds_plain_decodings_rows(engine)
        refs = replay(trace)           # the cuts are in the block trace too
        assert refs == {b: int(engine.pool.ref_counts[b]) for b in refs}

    spec = serve(model, requests, speculate=drafters(model)[drafter](), **options,
                 check=check, trace=trace)
    assert tokens_of(spec) == tokens_of(plain)
    for rid, (prompt, params) in enumerate(requests):
        want = kvlab.generate(model, prompt, params.max_new_tokens).tokens
        assert all(o.tokens == want for o in spec.outputs[rid].outputs)
    stats = spec.speculation
    assert stats.accepted > 0 and stats.passes_saved > 0
    if setting in ("tight pool", "no prefix cache"):
        assert sum(m.preemptions for m in spec.metrics) > 0
    if setting == "roomy":
        assert len(spec.metrics) < len(plain.metrics)        # fewer steps for the same tokens


def test_each_step_is_one_forward_call_within_the_budget(model):
    budget = 12
    requests = greedy_requests(model)
    calls = []
    real = model.forward_batch

    def counted(seqs, chunks, all_logits=False):
        calls.append(sum(len(c) for c in chunks))
        return real(seqs, chunks, all_logits=all_logits)

    model.forward_batch = counted
    try:
        engine = serve(model, requests, speculate=PromptLookup(), max_batch_tokens=budget)
    finally:
        del model.forward_batch
    ran = [m for m in engine.metrics if m.batch_size]
    assert len(calls) == len(ran)                             # one call per step
    assert [m.prefill_tokens + m.decode_tokens + m.drafted for m in ran] == calls
    assert max(calls) <= budget and max(calls) == budget
    assert sum(m.drafted for m in engine.metrics) == engine.speculation.drafted


def test_the_prefix_cache_ends_up_as_without_speculation(model):
    # the rows of refused drafts never reach the prefix cache: the blocks cached at the end
    # (no eviction in this pool) are the same as without speculation. (With draft_tokens
    # >= block_size, a block of refused drafts alone can stay cached: see kvlab/engine.py)
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    plain = serve(model, requests, block_size=8)
    spec = serve(model, requests, speculate=PromptLookup(), block_size=8, k=7)
    assert spec.speculation.drafted > spec.speculation.accepted > 0
    assert cached_blocks(spec.pool) == cached_blocks(plain.pool)
    assert spec.pool.stats().blocks_cached == plain.pool.stats().blocks_cached


def test_a_quantized_pool_gives_the_same_tokens_as_without_speculation(model):
    requests = greedy_requests(model)
    for dtype in ("int8", "int4"):
        plain = serve(model, requests, dtype=dtype)
        spec = serve(model, requests, speculate=PromptLookup(), dtype=dtype)
        assert tokens_of(spec) == tokens_of(plain), dtype


def test_the_test_can_tell_keeping_every_draft_changes_the_output(model, monkeypatch):
    requests = greedy_requests(model)
    plain = serve(model, requests)

    def keep_all(rows, drafts, q, sampling):
        return len(drafts), int(np.argmax(rows[len(drafts)]))
    monkeypatch.setattr(kvlab.engine, "verify_drafts", keep_all)
    assert tokens_of(serve(model, requests, speculate=PromptLookup())) != tokens_of(plain)


# ---- where plain decoding stops --------------------------------------------------------------

def test_stop_tokens_and_length_cut_a_pass_where_plain_decoding_stops(model):
    # the engine is told an EOS token that generation picks; drafts are kept in long runs,
    # so the EOS and the length limit fall inside passes, at every offset
    prompt = encoded(model)[1]
    full = kvlab.generate(model, prompt, 60).tokens
    for eos in sorted(set(full[3:40]))[:6]:
        requests = [(prompt, SamplingParams(max_new_tokens=m)) for m in (1, 2, 3, 7, 19, 60)]
        runs = []
        for speculate in (None, PromptLookup()):
            engine = kvlab.Engine(model, model.new_paged_pool(64, 8), speculate=speculate,
                                  draft_tokens=6)
            engine._eos = eos
            for p, sp in requests:
                engine.add_request(p, sp)
            engine.run(progress=False)
            assert engine.pool.stats().blocks_used == 0
            runs.append((tokens_of(engine), cached_blocks(engine.pool)))
        assert runs[1] == runs[0], eos
        stopped = [r for r in runs[1][0].values() if r[0][1] == "eos"]
        assert stopped and all(eos not in tokens for (tokens, _), in stopped)


def test_max_new_tokens_never_gets_drafts_that_could_not_be_kept(model):
    prompt = encoded(model)[1]
    engine = serve(model, [(prompt, SamplingParams(max_new_tokens=m)) for m in (1, 2, 5)],
                   speculate=PromptLookup(), k=8)
    for rid, m in enumerate((1, 2, 5)):
        s = engine.outputs[rid].speculation
        assert len(engine.outputs[rid].outputs[0].tokens) == m
        # a pass checks at most the room left less one: 0 for m = 1, 0 for 2, <= 3 for 5
        assert len(s.proposed_at) <= max(0, m - 2)


# ---- streaming and counters ------------------------------------------------------------------

def test_streamed_tokens_are_never_taken_back_and_the_counters_add_up(model):
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    streamed = {}

    def collect(engine):
        for rid, tokens in engine.metrics[-1].new_tokens.items():
            streamed.setdefault(rid, []).extend(tokens)
            # what was reported so far is a prefix of the request's tokens, now and later
            sample = engine.requests[rid].sequences[0]
            assert sample.outputs[:len(streamed[rid])] == streamed[rid]

    k = 5
    engine = serve(model, requests, speculate=PromptLookup(), k=k, max_batch_tokens=16,
                   check=collect)
    totals = engine.speculation
    assert {rid: [t] for rid, t in streamed.items()} == \
        {rid: [o.tokens for o in out.outputs] for rid, out in engine.outputs.items()}
    assert sum(m.accepted for m in engine.metrics) == totals.accepted > 0
    assert sum(m.drafted for m in engine.metrics) == totals.drafted > totals.accepted
    for rid, out in engine.outputs.items():
        s = out.outputs[0].speculation
        assert out.speculation.accepted == s.accepted and out.speculation.sequences == 1
        assert s.tokens == len(out.outputs[0].tokens)          # no EOS in this model
        assert s.passes_saved == s.tokens - 1 - s.verify_passes >= 0
        assert sum(s.accepted_at) == s.accepted and sum(s.proposed_at) == s.drafted
        assert len(s.proposed_at) <= k and s.draft_tokens == k and s.draft_passes == 0
        assert all(0 <= r <= 1 for r in s.acceptance_by_position)
    assert totals.tokens == sum(len(o.outputs[0].tokens) for o in engine.outputs.values())
    assert totals.passes_saved == sum(o.speculation.passes_saved for o in engine.outputs.values())
    step = next(m for m in engine.metrics if m.accepted)
    assert f"decode tokens + {step.drafted} drafts ({step.accepted} kept)" in str(step)


def test_counts_match_generates_for_a_request_alone(model):
    prompt = encoded(model)[0]
    for make in drafters(model).values():
        alone = kvlab.generate(model, prompt, 50, speculate=make(), draft_tokens=4)
        engine = serve(model, [(prompt, SamplingParams(max_new_tokens=50))], speculate=make())
        s, g = engine.outputs[0].speculation, alone.speculation
        assert engine.outputs[0].outputs[0].tokens == alone.tokens
        assert (s.drafted, s.accepted, s.verify_passes, s.tokens, s.proposed_at, s.accepted_at,
                s.passes_saved) == (g.drafted, g.accepted, g.verify_passes, g.tokens,
                                    g.proposed_at, g.accepted_at, g.passes_saved)
        assert s.draft_passes == g.draft_passes


def test_n_samples_count_one_first_token_each(model):
    prompt = encoded(model)[0]
    params = SamplingParams(max_new_tokens=30, n=3, temperature=0.8, seed=4)
    engine = serve(model, [(prompt, params)], speculate=PromptLookup())
    out = engine.outputs[0]
    assert out.speculation.sequences == 3
    assert out.speculation.passes_saved == sum(o.speculation.passes_saved for o in out.outputs)


# ---- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["prompt lookup", "first layer"])
def test_seeded_samples_are_generates_own_with_the_same_drafter(model, drafter):
    # with room for every draft, each sample draws exactly what generate(speculate=...)
    # draws for its prompt alone with seed + sample index
    make = drafters(model)[drafter]
    requests = [(p, SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=3 + i,
                                   n=1 + i % 2))
                for i, p in enumerate(encoded(model))]
    engine = serve(model, requests, speculate=make())
    for rid, (prompt, params) in enumerate(requests):
        for i, o in enumerate(engine.outputs[rid].outputs):
            want = kvlab.generate(model, prompt, 40, temperature=0.8, top_k=20,
                                  seed=params.seed + i, speculate=make(), draft_tokens=4)
            assert o.tokens == want.tokens, (rid, i)
    assert engine.speculation.accepted > 0


# ---- interrupts and failures -----------------------------------------------------------------

class Injector:
    """Counts the calls made through wrapped functions; raises KeyboardInterrupt at the
    k-th (or each with probability `rate`), before the call or after it."""

    def __init__(self, at=(), when="before", rate=0.0, seed=0):
        self.at, self.when, self.rate = set(at), when, rate
        self.rng = np.random.default_rng(seed)
        self.calls, self.fired = 0, []

    def wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            fire = self.calls in self.at or (self.rate > 0 and self.rng.random() < self.rate)
            if fire and self.when == "before":
                self.fired.append((self.calls, name))
                raise KeyboardInterrupt(f"before call {self.calls} ({name})")
            result = fn(*args, **kwargs)
            if fire and self.when == "after":
                self.fired.append((self.calls, name))
                raise KeyboardInterrupt(f"after call {self.calls} ({name})")
            return result
        return wrapper


class Lookup(PromptLookup):
    """Prompt lookup whose proposals go through the injector."""
    injector = None

    def propose(self, tokens, k, sampling=None):
        if self.injector is None:
            return super().propose(tokens, k, sampling)
        return self.injector.wrap("propose", super().propose)(tokens, k, sampling)


class Layers(DraftModel):
    """A draft model (and its spawns) whose proposals go through the injector."""
    injector = None

    def spawn(self):
        return Layers(self.model, self.dtype)

    def propose(self, tokens, k, sampling=None):
        if Layers.injector is None:
            return super().propose(tokens, k, sampling)
        return Layers.injector.wrap("propose", super().propose)(tokens, k, sampling)


def injected(engine, injector):
    """Wraps every collaborator of a step; returns a function that unwraps them."""
    model, pool, space = engine.model, engine.pool, engine.space
    patched = [(model, "forward_batch"), (engine.scheduler, "plan"), (engine.scheduler, "apply"), (space, "start"),
               (space, "release"), (pool, "new_sequence"), (pool, "fork"), (pool, "free"),
               (pool, "reuse_prefix"), (pool, "truncate")]
    for owner, name in patched:
        setattr(owner, name, injector.wrap(name, getattr(owner, name)))
    functions = [(name, getattr(kvlab.engine, name)) for name in ("sample_token", "verify_drafts")]
    for name, fn in functions:
        setattr(kvlab.engine, name, injector.wrap(name, fn))
    Lookup.injector = Layers.injector = injector

    def undo():
        for name, fn in functions:
            setattr(kvlab.engine, name, fn)
        for owner, name in patched:
            del owner.__dict__[name]
        Lookup.injector = Layers.injector = None
    return undo


def assert_consistent(engine):
    """Between steps, after an exception as after a normal step: one queue per request,
    every sequence a sample's, each holding its tokens (with its drafts while their logits
    wait to be checked)."""
    pool, scheduler = engine.pool, engine.scheduler
    pool.check()
    held = set()
    for request in engine.requests.values():
        where = (request in scheduler.running) + (request in scheduler.waiting)
        if request.state is State.FINISHED:
            assert where == 0 and all(s.handle is None for s in request.sequences)
            continue
        assert where == 1
        for sample in request.sequences:
            if request.state is State.WAITING or sample.finished:
                assert sample.handle is None
            elif sample.handle is not None:
                seq = sample.handle
                assert seq.alive
                assert seq.length == sample.computed
                held.add((seq.id, seq.serial))
    assert {(s.id, s.serial) for s in pool.sequences()} == held


def run_through(engine, check=True):
    for _ in range(500):
        try:
            return engine.run(progress=False)
        except KeyboardInterrupt:
            if check:
                assert_consistent(engine)
    raise AssertionError("the engine did not finish")


_LOOPING = {}


def looping_text(model):
    """The model's own greedy text after "ROMEO:\n": it repeats itself."""
    if "ids" not in _LOOPING:
        _LOOPING["ids"] = model.encode("ROMEO:\n") + kvlab.generate(model, "ROMEO:\n", 80).tokens
    return _LOOPING["ids"]


def interrupt_workload(model, drafter, sampled):
    """Prompts cut from the model's own greedy text, which repeats itself (prompt lookup's
    drafts are kept). Tight: chunked prefill (budget 12), preemption (10 blocks of 8), a
    prefix-cache hit, an n=2 request that forks; greedy. Roomy (sampled=True): seeded
    samples, a budget and a pool with room for every draft, so that their draws are exact."""
    text = looping_text(model)
    if sampled:
        requests = [(text[:50], SamplingParams(max_new_tokens=10, temperature=0.8, seed=1, n=2)),
                    (text[10:60], SamplingParams(max_new_tokens=8, temperature=0.9, seed=2)),
                    (text[:40], SamplingParams(max_new_tokens=8))]
        engine = kvlab.Engine(model, model.new_paged_pool(64, 8), max_batch_tokens=256,
                              speculate=drafter, draft_tokens=4)
    else:
        requests = [(text[:40], SamplingParams(max_new_tokens=10)),
                    (text[:33] + [5, 6], SamplingParams(max_new_tokens=6)),
                    (text[20:44], SamplingParams(max_new_tokens=6, n=2))]
        engine = kvlab.Engine(model, model.new_paged_pool(10, 8), max_batch_tokens=12,
                              speculate=drafter, draft_tokens=4)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    return engine


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy-tight", "sampled-roomy"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_at_any_call_of_any_step_resumes_exactly(model, when, sampled):
    reference = interrupt_workload(model, Lookup(), sampled)
    counter = Injector()
    undo = injected(reference, counter)
    try:
        want = tokens_of_run(reference.run(progress=False))
    finally:
        undo()
    if not sampled:
        assert sum(m.preemptions for m in reference.metrics) > 0
        assert sum(m.prefix_hit_tokens for m in reference.metrics) > 0
        plain = interrupt_workload(model, None, sampled)
        assert tokens_of_run(plain.run(progress=False)) == want
    assert reference.speculation.accepted > 0
    for k in range(1, counter.calls + 1):
        engine = interrupt_workload(model, Lookup(), sampled)
        injector = Injector(at=[k], when=when)
        undo = injected(engine, injector)
        try:
            outputs = run_through(engine)
        finally:
            undo()
        assert len(injector.fired) == 1, k
        assert tokens_of_run(outputs) == want, injector.fired
        assert engine.pool.stats().blocks_used == 0 and not engine.has_work


def tokens_of_run(outputs):
    return {rid: [(o.tokens, o.finish_reason) for o in out.outputs] for rid, out in outputs.items()}


# Seeds whose interrupts reach the drafter's proposals (seed 2's draws miss them since the
# injector also wraps the scheduler's plan and apply); even seeds greedy, odd sampled;
# 0-3 interrupt before a call, 4-7 after it.
@pytest.mark.parametrize("seed", [0, 1, 3, 4, 5, 6, 7])
def test_repeated_interrupts_with_a_draft_model_still_finish_exactly(model, seed):
    # a draft model of its own per sample, interrupted in its proposals too; interrupts
    # may hit the repair after an interrupt
    sampled = seed % 2 == 1
    reference = interrupt_workload(model, Layers.first_layers(model, 1), sampled)
    want = tokens_of_run(reference.run(progress=False))
    engine = interrupt_workload(model, Layers.first_layers(model, 1), sampled)
    injector = Injector(rate=0.15, seed=seed, when=["before", "after"][seed // 4])
    undo = injected(engine, injector)
    try:
        outputs = run_through(engine, check=False)
    finally:
        undo()
    assert len(injector.fired) > 5 and any(name == "propose" for _, name in injector.fired)
    assert tokens_of_run(outputs) == want
    assert_consistent(engine)
    assert engine.pool.stats().blocks_used == 0


class Broken(PromptLookup):
    """Prompt lookup, except for one prompt: after a few proposals for it, it raises or
    proposes junk."""

    def __init__(self, prompt, junk, after):
        super().__init__()
        self.prompt, self.junk, self.after = prompt, junk, after

    def propose(self, tokens, k, sampling=None):
        if list(tokens[:len(self.prompt)]) == self.prompt:
            self.after -= 1
            if self.after < 0:
                if isinstance(self.junk, Exception):
                    raise self.junk
                return self.junk
        return super().propose(tokens, k, sampling)


@pytest.mark.parametrize("junk, error", [
    (RuntimeError("drafter down"), "RuntimeError: drafter down"),
    ([999], "ValueError: a drafter proposed token 999, out of range"),
    ([2.5], "TypeError: a drafter proposed 2.5"),
    (None, "TypeError: a drafter's propose() returns a list")])
def test_a_drafter_that_fails_fails_its_request_alone(model, junk, error):
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    plain = tokens_of(serve(model, requests))
    target = 2
    engine = serve(model, requests, speculate=Broken(requests[target][0], junk, after=6))
    failed = {rid: why for m in engine.metrics for rid, why in m.failed.items()}
    assert list(failed) == [target]
    why = failed[target]
    assert error in why and why.startswith("error: step ")
    out = engine.outputs[target].outputs[0]
    assert out.finish_reason == why and 6 <= len(out.tokens) < 50
    assert out.tokens == plain[target][0][0][:len(out.tokens)]
    del plain[target]
    assert {r: t for r, t in tokens_of(engine).items() if r != target} == plain


def test_a_drafter_failing_in_a_step_that_then_raises_fails_its_request_on_the_retry(model):
    # the drafter fails one request while planning; then the forward call raises, so the
    # step is not done. Before, the request was marked failed in the plan all the same: the
    # retry retired it without freeing its pool sequence (a leak the pool kept forever)
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    plain = tokens_of(serve(model, requests))
    target = 2
    pool = model.new_paged_pool(200, 16)
    engine = kvlab.Engine(model, pool, speculate=Broken(requests[target][0],
                                                        RuntimeError("drafter down"), after=6))
    for prompt, params in requests:
        engine.add_request(prompt, params)
    real = model.forward_batch
    raised = []

    def forward_batch(seqs, chunks, all_logits=False):
        drafter_failed = engine.speculate.after < 0
        if drafter_failed and not raised:
            raised.append(len(engine.metrics))
            raise RuntimeError("the device went away")
        return real(seqs, chunks, all_logits=all_logits)

    model.forward_batch = forward_batch
    try:
        with pytest.raises(RuntimeError, match="the device went away"):
            while engine.has_work:
                engine.step()
        while engine.has_work:
            engine.step()
            pool.check()
    finally:
        del model.forward_batch
    failed = {rid: why for m in engine.metrics for rid, why in m.failed.items()}
    assert list(failed) == [target] and "RuntimeError: drafter down" in failed[target]
    assert engine.outputs[target].outputs[0].finish_reason == failed[target]
    assert pool.live_sequences == 0 and pool.stats().blocks_used == 0
    del plain[target]
    assert {r: t for r, t in tokens_of(engine).items() if r != target} == plain


def test_a_request_its_drafter_fails_is_not_the_one_preempted_for_room(model):
    # the drafter fails the newest request at a step where the pool is out of blocks: the
    # plan must not preempt it for room (it leaves at the step's end), else it went back
    # to the waiting queue and, failed there, was never retired (the engine stuck)
    first, newest = encoded(model, PROMPTS[:2])
    params = SamplingParams(max_new_tokens=40)
    plain = tokens_of(serve(model, [(first, params), (newest, params)], num_blocks=17, block_size=8))
    engine = serve(model, [(first, params), (newest, params)], num_blocks=17, block_size=8,
                   speculate=Broken(newest, RuntimeError("drafter down"), after=0))
    failed = {rid: why for m in engine.metrics for rid, why in m.failed.items()}
    assert list(failed) == [1] and "RuntimeError: drafter down" in failed[1]
    assert engine.outputs[1].preemptions == 0
    assert tokens_of(engine)[0] == plain[0]
    assert engine.pool.live_sequences == 0 and engine.pool.stats().blocks_used == 0


class Scribbling(PromptLookup):
    """Prompt lookup that also writes into the context it is given (as a drafter may that
    takes it for its own copy)."""

    def propose(self, tokens, k, sampling=None):
        drafts = super().propose(tokens, k, sampling)
        tokens.append(0)
        return drafts


def test_a_drafter_writing_into_its_context_changes_no_sequence(model):
    # the engine gave the drafter the sequence's own token list: the appended 0 became a
    # token of the output (generate gives each pass a list of its own)
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    plain = tokens_of(serve(model, requests))
    assert tokens_of(serve(model, requests, speculate=Scribbling())) == plain


def test_nan_logits_in_a_draft_row_fail_that_request(model):
    requests = greedy_requests(model, n=(1, 1, 1, 1))
    real = model.forward_batch

    def poisoned(seqs, chunks, all_logits=False):
        rows = real(seqs, chunks, all_logits=all_logits)
        if all_logits:
            rows[len(chunks[0]) - 1] = np.nan        # the first sequence's last row
        return rows

    model.forward_batch = poisoned
    try:
        engine = serve(model, requests, speculate=PromptLookup())
    finally:
        del model.forward_batch
    plain = tokens_of(serve(model, requests))
    failed = 0
    for rid, [(tokens, reason)] in tokens_of(engine).items():
        if reason == "length":
            assert tokens == plain[rid][0][0]
        else:                          # the NaN was in a row it read: it failed alone
            assert "ValueError: the logits hold NaN" in reason
            assert tokens == plain[rid][0][0][:len(tokens)]
            failed += 1
    assert failed >= 1


# ---- refused arguments -----------------------------------------------------------------------

def test_bad_arguments_are_refused_at_construction(model, tmp_path):
    pool = model.new_paged_pool(8, 4)
    trace = tmp_path / "trace.jsonl"
    for speculate, draft_tokens, error, match in (
            (PromptLookup(), 0, ValueError, "draft_tokens must be at least 1, got 0"),
            (PromptLookup(), 2.5, ValueError, "draft_tokens"),
            (PromptLookup(), True, ValueError, "draft_tokens"),
            ("ngram", 4, TypeError, "speculate takes a drafter"),
            (PromptLookup, 4, TypeError, "speculate takes a drafter")):
        with pytest.raises(error, match=match):
            kvlab.Engine(model, pool, trace=trace, speculate=speculate, draft_tokens=draft_tokens)
    small_vocab = kvlab.Model(model.config.replace(vocab_size=128), _shrunk(model.weights, 128))
    with pytest.raises(ValueError, match="vocabulary"):
        kvlab.Engine(model, pool, trace=trace, speculate=DraftModel(small_vocab))
    windowed = model.new_paged_pool(8, 4, dtype="int8", window=4)
    with pytest.raises(ValueError, match="without a residual window"):
        kvlab.Engine(model, windowed, trace=trace, speculate=PromptLookup())
    assert not trace.exists()                          # nothing opened, nothing left behind
    assert pool.stats().n_sequences == 0
    engine = kvlab.Engine(model, pool, speculate=PromptLookup(), draft_tokens=np.int64(3))
    assert engine.draft_tokens == 3 and kvlab.Engine(model, pool).speculation is None


def _shrunk(weights, vocab):
    import dataclasses
    embedding = np.ascontiguousarray(weights.token_embedding[:vocab])
    return dataclasses.replace(weights, token_embedding=embedding,
                               classifier=np.ascontiguousarray(weights.classifier[:vocab]))
