"""kvlab.Engine end to end, on the bundled model and a real paged pool.

The engine's contract is that batching changes nothing but speed: every sample of every
request comes out token for token as kvlab.generate makes it for that prompt alone (greedy,
or seeded sampling with seed + sample index), whatever else shares the batch, whenever the
request arrived, however often it was preempted, and with a quantized pool as with the
matching quantized contiguous cache. Around that contract these tests check the mechanics
it rests on:

  * scheduling: random arrival orders, tiny pools that force preemption (and still finish
    and release every block), chunked prefill within the per-step token budget, and one
    forward call per step for the whole batch (model.counters);
  * the pool: prefix-cache hits on a repeated prompt (full blocks only), n > 1 samples
    forked onto shared blocks with copy-on-write of the partial last block, and the block
    trace, replayed into reference counts that must match the pool's own;
  * the edges: requests that could never fit, bad prompts and bad SamplingParams rejected
    with a ValueError naming the problem; Model.forward_batch bit-identical to running
    each sequence alone, and its errors leaving the pool exactly as it was.

pool.check() (the C invariant checker) runs after every engine step.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import kvlab
from kvlab import SamplingParams
from block_trace import replay

MAX_STEPS = 2000   # far more than any workload here needs: hitting it means a deadlock


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


# ---- helpers ---------------------------------------------------------------------------------

def expected_tokens(model, prompt, params, sample, **cache_format):
    """What kvlab.generate makes for sample `sample` of a request, the prompt alone."""
    seed = None if params.seed is None else params.seed + sample
    dtype = cache_format.pop("dtype", "fp32")
    return kvlab.generate(model, prompt, max_new_tokens=params.max_new_tokens,
                          temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, seed=seed, dtype=dtype,
                          **cache_format).tokens


def assert_outputs_match_generate(model, outputs, requests, **cache_format):
    """requests: request id -> (prompt ids, SamplingParams)."""
    assert sorted(outputs) == sorted(requests)
    for rid, (prompt, params) in requests.items():
        out = outputs[rid]
        assert out.prompt == list(prompt)
        assert len(out.outputs) == params.n
        for i, sample in enumerate(out.outputs):
            want = expected_tokens(model, prompt, params, i, **cache_format)
            assert sample.index == i and sample.tokens == want, f"request {rid} sample {i} differs from kvlab.generate"


def drain(engine, pool):
    """Step until the engine is idle, checking the pool's invariants after every step."""
    while engine.has_work:
        assert len(engine.metrics) < MAX_STEPS, "the engine stopped making progress"
        engine.step()
        pool.check()
    return engine.metrics


def random_ids(rng, n):
    return rng.integers(0, 256, n).tolist()


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


def single_request_blocks(prompt, params, block_size):
    """Blocks one request can hold at most: each sample's prompt + max_tokens - 1 tokens
    (the last sampled token is never fed back)."""
    return params.n * blocks_for(len(prompt) + params.max_new_tokens - 1, block_size)


# ---- the contract under random workloads -------------------------------------------------------

def random_workload(seed):
    """6-10 requests: prompts of 1-40 random bytes (some extending an earlier prompt, so the
    prefix cache is hit while both run), greedy or seeded sampling, n of 1-3, each arriving
    before the first step or at a random later step."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(int(rng.integers(6, 11))):
        if requests and rng.random() < 0.3:
            base = requests[int(rng.integers(len(requests)))][0]
            prompt = (base[:int(rng.integers(1, len(base) + 1))]
                      + random_ids(rng, int(rng.integers(0, 10))))[:40]
        else:
            prompt = random_ids(rng, int(rng.integers(1, 41)))
        n = int(rng.choice([1, 1, 2, 3]))
        max_tokens = int(rng.integers(1, 21))
        if rng.random() < 0.5:
            params = SamplingParams(max_new_tokens=max_tokens, n=n)
        else:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=0.8,
                                    seed=int(rng.integers(10_000)), n=n)
        arrival = 0 if rng.random() < 0.4 else int(rng.integers(1, 15))
        requests.append((prompt, params, arrival))
    block_size = int(rng.choice([4, 8, 16]))
    # from just enough for the largest request alone (preemption likely) to roomy
    need = max(single_request_blocks(p, sp, block_size) for p, sp, _ in requests)
    num_blocks = need + int(rng.integers(0, 2 * need + 1))
    return requests, block_size, num_blocks


@pytest.mark.parametrize("seed", range(16))
def test_outputs_match_generate_whatever_the_arrival_order(model, seed):
    requests, block_size, num_blocks = random_workload(seed)
    pool = model.new_paged_pool(num_blocks, block_size=block_size)
    # budgets from a few tokens (prompts in many chunks, admissions that must count the
    # cached blocks a prefix hit takes) to enough for every prompt at once
    budget = [4, 7, 16, 256][seed % 4]
    engine = kvlab.Engine(model, pool, max_batch_tokens=budget)
    added = {}
    tick = 0
    while len(added) < len(requests) or engine.has_work:
        # requests join between steps, while others are mid-prompt or mid-generation
        for k, (prompt, params, arrival) in enumerate(requests):
            if arrival <= tick and k not in added:
                added[k] = engine.add_request(prompt, params)
        if engine.has_work:
            engine.step()
            pool.check()
        tick += 1
        assert tick < MAX_STEPS, "the engine stopped making progress"
    assert_outputs_match_generate(
        model, engine.outputs, {rid: requests[k][:2] for k, rid in added.items()})
    assert pool.stats().blocks_used == 0


def test_tiny_pool_preempts_and_still_matches_generate(model):
    rng = np.random.default_rng(7)
    block_size = 4
    requests = [(random_ids(rng, 12 + 2 * k), SamplingParams(max_new_tokens=12 + k)) for k in range(5)]
    requests.append((random_ids(rng, 14), SamplingParams(max_new_tokens=14, temperature=0.8,
                                                         seed=11, n=2)))
    # just enough blocks for the largest request on its own: all six cannot run together
    num_blocks = max(single_request_blocks(p, sp, block_size) for p, sp in requests)
    pool = model.new_paged_pool(num_blocks, block_size=block_size)
    engine = kvlab.Engine(model, pool)
    ids = {engine.add_request(p, sp): (p, sp) for p, sp in requests}
    metrics = drain(engine, pool)

    preemptions = sum(m.preemptions for m in metrics)
    assert preemptions >= 1
    # the per-step counts and the per-request counts tell the same story
    assert preemptions == sum(out.preemptions for out in engine.outputs.values())
    assert_outputs_match_generate(model, engine.outputs, ids)
    stats = pool.stats()
    assert stats.blocks_used == 0 and stats.n_sequences == 0
    assert stats.blocks_free + stats.blocks_cached == num_blocks
    assert metrics[-1].blocks_used == 0


# ---- scheduling mechanics ----------------------------------------------------------------------

@pytest.mark.parametrize("budget", [16, 7])
def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget(model, budget):
    prompt = random_ids(np.random.default_rng(3), 100)
    params = SamplingParams(max_new_tokens=5)
    pool = model.new_paged_pool(32, block_size=16)
    engine = kvlab.Engine(model, pool, max_batch_tokens=budget)
    rid = engine.add_request(prompt, params)
    metrics = drain(engine, pool)

    chunks = math.ceil(100 / budget)
    first_token_step = next(m.step for m in metrics if m.new_tokens)
    assert first_token_step == chunks - 1           # ceil(100 / budget) steps, counting its own
    last_chunk = 100 - budget * (chunks - 1)
    assert [m.prefill_tokens for m in metrics[:chunks]] == [budget] * (chunks - 1) + [last_chunk]
    assert all(m.decode_tokens == 1 and m.prefill_tokens == 0 for m in metrics[chunks:])
    assert len(metrics) == chunks + params.max_new_tokens - 1
    assert_outputs_match_generate(model, engine.outputs, {rid: (prompt, params)})


def test_no_step_runs_more_tokens_than_the_budget(model):
    rng = np.random.default_rng(5)
    budget = 16
    pool = model.new_paged_pool(128, block_size=8)
    engine = kvlab.Engine(model, pool, max_batch_tokens=budget)
    requests = {}
    for length in (100, 37, 3, 64, 20):
        prompt = random_ids(rng, length)
        params = SamplingParams(max_new_tokens=8)
        requests[engine.add_request(prompt, params)] = (prompt, params)
    metrics = drain(engine, pool)
    assert all(m.prefill_tokens + m.decode_tokens <= budget for m in metrics)
    # and the budget is used: a prompt chunk fills whatever decoding leaves over
    assert max(m.prefill_tokens + m.decode_tokens for m in metrics) == budget
    assert_outputs_match_generate(model, engine.outputs, requests)


def test_max_batch_seqs_caps_the_batch(model):
    rng = np.random.default_rng(6)
    pool = model.new_paged_pool(64, block_size=8)
    engine = kvlab.Engine(model, pool, max_batch_seqs=3)
    requests = {}
    for length in range(2, 9):
        prompt, params = random_ids(rng, length), SamplingParams(max_new_tokens=4)
        requests[engine.add_request(prompt, params)] = (prompt, params)
    metrics = drain(engine, pool)
    assert max(m.batch_size for m in metrics) == 3
    assert_outputs_match_generate(model, engine.outputs, requests)


def test_a_decode_step_runs_every_sequence_in_one_forward_call(model):
    # what one decode token costs in weight reads, run alone on a contiguous cache
    cache = model.new_cache(8)
    model.prefill([1, 2], cache)
    model.reset_counters()
    model.decode(3, cache)
    one_pass = model.counters.weight_bytes

    rng = np.random.default_rng(8)
    pool = model.new_paged_pool(64, block_size=16)
    engine = kvlab.Engine(model, pool, max_batch_tokens=256)
    for k in range(8):
        engine.add_request(random_ids(rng, 3 + k), SamplingParams(max_new_tokens=6))
    first = engine.step()                            # every prompt, all at once
    assert first.batch_size == 8 and len(first.new_tokens) == 8

    model.reset_counters()
    step = engine.step()
    assert (step.batch_size, step.decode_tokens, step.prefill_tokens) == (8, 8, 0)
    counters = model.counters
    assert counters.calls == 1 and counters.tokens == 8
    # eight separate decodes would read the weights eight times
    assert one_pass <= counters.weight_bytes < 2 * one_pass


# ---- the pool: prefix cache, forks, copy-on-write -----------------------------------------------

@pytest.mark.parametrize("length, hit", [(40, 32), (36, 32), (33, 32), (32, 24), (7, 0)])
def test_repeated_prompt_hits_the_prefix_cache_for_full_blocks_only(model, length, hit):
    prompt = random_ids(np.random.default_rng(length), length)
    params = SamplingParams(max_new_tokens=5)
    pool = model.new_paged_pool(32, block_size=8)
    engine = kvlab.Engine(model, pool)
    first = engine.add_request(prompt, params)
    drain(engine, pool)
    assert engine.metrics[0].prefix_hit_tokens == 0

    second = engine.add_request(prompt, params)
    admission = engine.step()
    pool.check()
    assert admission.admitted == [second]
    # only full blocks are shared, and never the prompt's last token: its logits are needed
    assert admission.prefix_hit_tokens == hit
    assert admission.prefill_tokens == length - hit
    drain(engine, pool)
    outputs = engine.outputs
    assert outputs[second].outputs == outputs[first].outputs
    assert_outputs_match_generate(model, outputs,
                                  {first: (prompt, params), second: (prompt, params)})


def test_n_samples_fork_the_prompt_and_copy_the_shared_partial_block_on_write(model):
    block_size = 8
    prompt = random_ids(np.random.default_rng(9), 20)     # 2 full blocks + 4 rows of a third
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=42, n=3)
    pool = model.new_paged_pool(32, block_size=block_size)
    trace = []
    engine = kvlab.Engine(model, pool, trace=trace)
    rid = engine.add_request(prompt, params)

    first = engine.step()
    pool.check()
    assert len(first.new_tokens[rid]) == 3               # one token per sample, one prompt pass
    assert first.prefill_tokens == 20 and first.batch_size == 1
    tables = [seq.block_table.tolist() for seq in pool.sequences()]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    shared = tables[0]
    assert [int(pool.ref_counts[b]) for b in shared] == [3, 3, 3]
    assert max(pool.ref_counts) == 3
    forked = [e for e in trace if e["step"] == 0 and e["event"] == "shared"]
    # two forks, each sharing every block of the prompt: 2 references, then 3
    assert [(e["block"], e["refs"]) for e in forked] == ([(b, 2) for b in shared]
                                                         + [(b, 3) for b in shared])
    assert all(e["phase"] == "sample" and e["index"] == shared.index(e["block"]) for e in forked)

    second = engine.step()
    pool.check()
    assert second.decode_tokens == 3
    copies = [e for e in trace if e["step"] == 1 and e["event"] == "copied"]
    # two samples copy the partial block before writing; the last one left owns the original
    assert len(copies) == 2 and all(e["from"] == shared[2] for e in copies)
    assert int(pool.ref_counts[shared[2]]) == 1
    assert [int(pool.ref_counts[b]) for b in shared[:2]] == [3, 3]   # full blocks still shared
    assert all(pool.ref_counts[e["block"]] == 1 for e in copies)

    drain(engine, pool)
    assert_outputs_match_generate(model, engine.outputs, {rid: (prompt, params)})
    assert pool.stats().blocks_used == 0


# ---- the block trace ----------------------------------------------------------------------------


def preempting_workload(model, trace):
    """Requests on a pool too small for all of them: preemption, recompute, re-admission
    through the prefix cache, and n > 1 samples whose forks share, copy and release blocks."""
    rng = np.random.default_rng(12)
    pool = model.new_paged_pool(21, block_size=4)   # the largest request alone, just
    engine = kvlab.Engine(model, pool, trace=trace)
    requests = {}
    for k in range(6):
        prompt, params = random_ids(rng, 10 + 3 * k), SamplingParams(max_new_tokens=12)
        if k in (1, 4):                       # two sampled requests with three samples each
            params = SamplingParams(max_new_tokens=6, n=3, temperature=0.8, seed=k)
        requests[engine.add_request(prompt, params)] = (prompt, params)
    return engine, pool, requests


def test_trace_replays_into_the_pools_reference_counts(model):
    trace = []
    engine, pool, requests = preempting_workload(model, trace)
    refs, seen, used = {}, 0, set()
    while engine.has_work:
        assert len(engine.metrics) < MAX_STEPS
        engine.step()
        pool.check()
        replay(trace[seen:], refs)
        seen = len(trace)
        # after every step, not just at the end
        assert refs == {b: int(pool.ref_counts[b]) for b in refs}
        used |= set(np.flatnonzero(pool.ref_counts).tolist())
    assert sum(m.preemptions for m in engine.metrics) >= 1
    assert set(refs.values()) == {0} and not pool.ref_counts.any()
    # every block in use at the end of some step was announced by an event
    assert used and used <= set(refs)
    kinds = {e["event"] for e in trace}
    assert {"allocated", "freed"} <= kinds
    assert any(e.get("prefix_hit") for e in trace)       # a preempted request came back
    assert_outputs_match_generate(model, engine.outputs, requests)


def test_trace_file_holds_one_json_event_per_line(model, tmp_path):
    def workload(trace):
        pool = model.new_paged_pool(12, block_size=4)
        engine = kvlab.Engine(model, pool, trace=trace)
        rng = np.random.default_rng(13)
        engine.add_request(random_ids(rng, 10), SamplingParams(max_new_tokens=6, temperature=0.8,
                                                               seed=1, n=2))
        for k in range(4):
            engine.add_request(random_ids(rng, 8 + k), SamplingParams(max_new_tokens=10))
        return engine

    path = tmp_path / "trace.jsonl"
    engine = workload(path)
    engine.run(progress=False)
    engine.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]

    assert events
    steps = [e["step"] for e in events]
    assert steps == sorted(steps)
    for e in events:
        assert {"step", "phase", "event", "block"} <= set(e)
        assert e["phase"] in ("admit", "forward", "sample")
        assert e["event"] in ("allocated", "shared", "copied", "released", "freed", "evicted")
        assert 0 <= e["block"] < 12
        if e["event"] in ("allocated", "shared", "copied", "released"):
            assert e["refs"] >= 1
        if e["event"] == "freed":
            assert e["to"] in ("cached", "free")
        if e["event"] == "copied":
            assert 0 <= e["from"] < 12 and e["from"] != e["block"]
    assert {"allocated", "shared", "copied", "freed"} <= {e["event"] for e in events}
    # the file says exactly what a list sink gets for the same run
    in_memory = []
    workload(in_memory).run(progress=False)
    assert events == in_memory


def test_leaving_a_with_block_closes_the_trace_file(model, tmp_path):
    """The README's way: step() alone never flushes the file, so it can stay empty until
    the engine is closed; `with` closes it."""
    path = tmp_path / "trace.jsonl"
    with kvlab.Engine(model, model.new_paged_pool(12, block_size=4), trace=path) as engine:
        request = engine.add_request("ROMEO:", SamplingParams(max_new_tokens=8))
        while engine.has_work:
            engine.step()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"allocated", "freed"} <= {e["event"] for e in events}
    assert len(engine.outputs[request].outputs[0].tokens) == 8     # outputs outlive the file


# ---- rejections ---------------------------------------------------------------------------------

def test_requests_that_could_never_fit_are_rejected_up_front(model):
    pool = model.new_paged_pool(8, block_size=4, max_seqs=4)
    engine = kvlab.Engine(model, pool)
    with pytest.raises(ValueError, match=r"request rejected: .*the pool has 8"):
        engine.add_request([1] * 40, SamplingParams(max_new_tokens=1))      # 10 blocks of 8
    with pytest.raises(ValueError, match=r"request rejected: .*the pool has 8"):
        engine.add_request([1] * 30, SamplingParams(max_new_tokens=4))      # 33 tokens: 9 blocks
    with pytest.raises(ValueError, match=r"request rejected: .*n=5"):
        engine.add_request([1] * 6, SamplingParams(max_new_tokens=3, n=5))  # 5 x 2 blocks
    with pytest.raises(ValueError, match=r"request rejected: .*max_seqs=4"):
        engine.add_request([1], SamplingParams(max_new_tokens=1, n=5))     # 5 sequences of 1 block
    short_table = model.new_paged_pool(64, block_size=4, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match=r"request rejected: .*max_blocks_per_seq=2"):
        kvlab.Engine(model, short_table).add_request([1] * 8, SamplingParams(max_new_tokens=2))
    # a rejected request leaves nothing behind
    assert not engine.has_work and engine.requests == {}
    assert pool.stats().blocks_used == 0


def test_requests_that_exactly_fill_the_pool_are_accepted_and_finish(model):
    # the rejection rule's edge: prompt + max_tokens - 1 tokens, n times, is all 8 blocks
    rng = np.random.default_rng(14)
    pool = model.new_paged_pool(8, block_size=4)
    engine = kvlab.Engine(model, pool)
    requests = {}
    for prompt, params in ((random_ids(rng, 30), SamplingParams(max_new_tokens=3)),
                           (random_ids(rng, 6), SamplingParams(max_new_tokens=3, n=4,
                                                               temperature=0.8, seed=5))):
        requests[engine.add_request(prompt, params)] = (prompt, params)
    drain(engine, pool)
    assert_outputs_match_generate(model, engine.outputs, requests)


def test_bad_prompts_are_rejected(model):
    engine = kvlab.Engine(model, model.new_paged_pool(16, block_size=4))
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="no tokens"):
        engine.add_request("")             # the byte tokenizer has no BOS to start from
    with pytest.raises(ValueError, match=r"token id 256 is out of range \[0, 256\)"):
        engine.add_request([1, 256, 2])
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        engine.add_request([-1])
    assert not engine.has_work


@pytest.mark.parametrize("kwargs, name", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"n": 0}, "n must"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


# ---- Model.forward_batch ------------------------------------------------------------------------

def alone(model, chunks):
    """Last-token logits after feeding `chunks` one after another to a contiguous cache."""
    cache = model.new_cache(sum(len(c) for c in chunks))
    for chunk in chunks:
        logits = model.prefill(chunk, cache)
    return logits


def test_forward_batch_gives_every_tokens_logits_when_asked(model):
    # what speculative decoding needs to verify every draft of every sequence in one call
    rng = np.random.default_rng(16)
    pool = model.new_paged_pool(64, block_size=4)
    histories = [random_ids(rng, n) for n in (9, 4, 1)]
    chunks = [random_ids(rng, n) for n in (3, 1, 5)]
    seqs = [pool.new_sequence() for _ in histories]
    for seq, history in zip(seqs, histories):
        model.prefill(history, seq)
    rows = model.forward_batch(seqs, chunks, all_logits=True)
    assert rows.shape == (9, model.config.vocab_size)
    start = 0
    for history, chunk in zip(histories, chunks):
        cache = model.new_cache(len(history) + len(chunk))
        model.prefill(history, cache)
        want = model.prefill(chunk, cache, all_logits=True)
        np.testing.assert_array_equal(rows[start:start + len(chunk)], want)
        start += len(chunk)
    pool.check()


def test_forward_batch_rows_are_bit_identical_to_each_sequence_alone(model):
    rng = np.random.default_rng(15)
    pool = model.new_paged_pool(64, block_size=4)
    a_history, b_history, c_history = random_ids(rng, 10), random_ids(rng, 13), random_ids(rng, 6)
    a, b, c = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    model.prefill(a_history, a)
    model.prefill(b_history, b)
    model.prefill(c_history, c)          # 6 tokens: its second block is half full
    fork = pool.fork(c)                  # shares that partial block with c
    fresh = pool.new_sequence()
    chunks = [random_ids(rng, 5), [7], random_ids(rng, 9), [11], [12]]
    logits = model.forward_batch([a, b, fresh, c, fork], chunks)
    pool.check()

    assert logits.shape == (5, 256)
    assert np.array_equal(logits[0], alone(model, [a_history, chunks[0]]))   # prompt chunk
    assert np.array_equal(logits[1], alone(model, [b_history, [7]]))         # decode
    assert np.array_equal(logits[2], alone(model, [chunks[2]]))              # a new prompt
    # a parent and its fork writing into their shared partial block in one batch
    assert np.array_equal(logits[3], alone(model, [c_history, [11]]))
    assert np.array_equal(logits[4], alone(model, [c_history, [12]]))
    assert c.block_table[1] != fork.block_table[1] and c.block_table[0] == fork.block_table[0]


def pool_snapshot(pool, seqs):
    return (pool.ref_counts.tolist(), list(pool.free_blocks), list(pool.cached_blocks),
            [(s.length, s.block_table.tolist()) for s in seqs])


def test_forward_batch_errors_leave_the_pool_unchanged(model):
    rng = np.random.default_rng(16)
    pool = model.new_paged_pool(6, block_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    model.prefill(random_ids(rng, 8), a)      # 2 blocks
    model.prefill(random_ids(rng, 2), b)      # 1 block; 3 left
    other = model.new_paged_pool(6, block_size=4).new_sequence()
    before = pool_snapshot(pool, [a, b])

    with pytest.raises(ValueError, match="same sequence"):
        model.forward_batch([a, a], [[1], [2]])
    with pytest.raises(ValueError, match="one pool"):
        model.forward_batch([a, other], [[1], [2]])
    with pytest.raises(ValueError, match="2 sequences but 1 chunks"):
        model.forward_batch([a, b], [[1]])
    with pytest.raises(ValueError, match="at least one sequence"):
        model.forward_batch([], [])
    with pytest.raises(ValueError, match="out of range"):
        model.forward_batch([a, b], [[1], [256]])
    # each alone would fit in the 3 blocks left (2 each); together they need 4
    with pytest.raises(kvlab.OutOfBlocks):
        model.forward_batch([a, b], [random_ids(rng, 8), random_ids(rng, 10)])
    assert pool_snapshot(pool, [a, b]) == before
    pool.check()

    # and the pool still works: the same sequences run as if nothing had failed
    logits = model.forward_batch([a, b], [[3], [4]])
    assert logits.shape == (2, 256)
    assert (a.length, b.length) == (9, 3)
    pool.check()


# ---- quantized pools ----------------------------------------------------------------------------

@pytest.mark.parametrize("cache_format", [{"dtype": "int8"}, {"dtype": "int4"},
                                          {"dtype": "int8", "window": 8}],
                         ids=["int8", "int4", "int8-window8"])
def test_quantized_pool_matches_generate_with_the_same_cache_format(model, cache_format):
    rng = np.random.default_rng(17)
    pool = model.new_paged_pool(40, block_size=8, **cache_format)
    engine = kvlab.Engine(model, pool, max_batch_tokens=32)
    requests = {}
    for prompt, params in ((random_ids(rng, 30), SamplingParams(max_new_tokens=12)),
                           (random_ids(rng, 5), SamplingParams(max_new_tokens=15, temperature=0.8,
                                                               seed=3, n=2)),
                           (random_ids(rng, 17), SamplingParams(max_new_tokens=9))):
        requests[engine.add_request(prompt, params)] = (prompt, params)
    drain(engine, pool)
    assert_outputs_match_generate(model, engine.outputs, requests, **cache_format)


# ---- run() and outputs ------------------------------------------------------------------------

def test_run_returns_every_request_with_decoded_texts(model):
    pool = model.new_paged_pool(64, block_size=16)
    engine = kvlab.Engine(model, pool)
    greedy = engine.add_request("ROMEO:", SamplingParams(max_new_tokens=20))
    sampled = engine.add_request([72, 105], SamplingParams(max_new_tokens=5, temperature=0.8,
                                                           seed=2, n=2))
    engine.step()
    assert engine.outputs == {}              # nothing finished yet: nothing reported

    outputs = engine.run(progress=False)
    assert sorted(outputs) == [greedy, sampled]
    assert outputs == engine.outputs
    assert outputs[greedy].prompt == model.encode("ROMEO:")
    for out in outputs.values():
        for sample in out.outputs:
            assert isinstance(sample, kvlab.CompletionOutput)
            assert sample.completion == model.decode_text(sample.tokens)
            assert sample.finish_reason == "length"          # no EOS in this model
        assert out.preemptions == 0
    assert [len(o.tokens) for o in outputs[sampled].outputs] == [5, 5]
    alone = kvlab.generate(model, "ROMEO:", max_new_tokens=20)
    assert outputs[greedy].outputs[0].completion == alone.completion
    assert_outputs_match_generate(
        model, outputs, {greedy: (model.encode("ROMEO:"), SamplingParams(max_new_tokens=20)),
                         sampled: ([72, 105], SamplingParams(max_new_tokens=5, temperature=0.8,
                                                             seed=2, n=2))})
    assert not engine.has_work and engine.run(progress=False) == outputs


def test_a_resumed_runs_progress_bar_counts_the_tokens_already_chosen(model, monkeypatch):
    # run() after some steps (a Ctrl-C, then run() again) starts its bar where the requests
    # are, not at 0, and ends at every token chosen
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, total, initial=0, **_):
            self.total, self.initial, self.n = total, initial, initial
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix(self, **_):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    engine = kvlab.Engine(model, model.new_paged_pool(64, block_size=16))
    engine.add_request("ROMEO:", SamplingParams(max_new_tokens=12))
    engine.add_request([72, 105], SamplingParams(max_new_tokens=5, temperature=0.8, seed=2, n=2))
    for _ in range(4):
        engine.step()
    chosen = sum(len(s.outputs) for r in engine.requests.values() for s in r.sequences)
    assert chosen > 0
    engine.run(progress=True)
    (bar,) = bars
    assert (bar.initial, bar.total, bar.n) == (chosen, 12 + 5 * 2, 12 + 5 * 2)


def test_an_engine_shared_by_threads_serializes_its_steps(model):
    # Two threads adding requests and stepping one engine: steps run one at a time, so
    # every request still matches generating it alone, and the pool stays consistent.
    import threading
    pool = model.new_paged_pool(64, block_size=4)
    engine = kvlab.Engine(model, pool, max_batch_tokens=32)
    rng = np.random.default_rng(21)
    prompts = [random_ids(rng, int(rng.integers(2, 20))) for _ in range(8)]
    ids = {}

    def worker(part):
        for prompt in part:
            ids[engine.add_request(prompt, SamplingParams(max_new_tokens=8))] = prompt
            engine.step()
        while engine.has_work:
            engine.step()

    threads = [threading.Thread(target=worker, args=(prompts[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.check()
    outputs = engine.outputs
    assert len(outputs) == 8
    for rid, prompt in ids.items():
        assert outputs[rid].outputs[0].tokens == kvlab.generate(model, prompt, 8).tokens


def test_admission_keeps_sequence_slots_for_forks_still_to_come(model):
    # Found by the engine fuzz: with max_seqs=6, an n=3 request (one sequence until its
    # prompt is done) and an n=4 request must not both be admitted, since their forks
    # will need 7 sequences; the second waits, and both finish.
    pool = model.new_paged_pool(32, block_size=2, max_seqs=6)
    engine = kvlab.Engine(model, pool, max_batch_tokens=2)
    a = engine.add_request([5], SamplingParams(max_new_tokens=2, n=3))
    b = engine.add_request([6], SamplingParams(max_new_tokens=1, n=4))
    first = engine.step()
    assert first.admitted == [a]
    outputs = engine.run(progress=False)
    assert [len(outputs[r].outputs) for r in (a, b)] == [3, 4]
    pool.check()


def test_a_forked_request_larger_than_a_batch_is_readmitted_after_preemption(model):
    # Issue 18: with max_batch_seqs=2, an n=3 request preempted after forking waited for
    # a batch with room for all three samples, which never came; every step did nothing
    pool = model.new_paged_pool(4, block_size=2)
    engine = kvlab.Engine(model, pool, max_batch_seqs=2)
    requests = {}
    for prompt, params in (([1, 2, 3, 4], SamplingParams(max_new_tokens=2)),
                           ([9], SamplingParams(max_new_tokens=2, n=3, temperature=0.8, seed=2))):
        requests[engine.add_request(prompt, params)] = (prompt, params)
    metrics = drain(engine, pool)
    assert sum(m.preemptions for m in metrics) >= 1
    assert max(m.batch_size for m in metrics) == 2
    assert_outputs_match_generate(model, engine.outputs, requests)


# ---- latency in the units users feel (RequestOutput.metrics) ----------------------------------

class StepClock:
    """A clock that moves one second each time it is read: every reading is distinct and
    known, so the latencies below are exact counts of readings."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_each_request_records_its_arrival_first_token_and_end(model):
    clock = StepClock()
    engine = kvlab.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=8, clock=clock)
    long = engine.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=5))
    short = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    first_seen, last_seen = {}, {}
    while engine.has_work:
        result = engine.step()
        for rid in result.new_tokens:
            first_seen.setdefault(rid, result.step)
            last_seen[rid] = result.step
    outputs = engine.outputs
    for rid in (long, short):
        m = outputs[rid].metrics
        assert m.arrival_time < m.first_token_time <= m.finished_time
        assert m.ttft == m.first_token_time - m.arrival_time and m.e2e == m.finished_time - m.arrival_time
        assert m.output_tokens == len(outputs[rid].outputs[0].tokens)
        assert m.tpot == pytest.approx((m.finished_time - m.first_token_time) / (m.output_tokens - 1))
    # the 20-token prompt is prefilled in chunks of 8: its first token comes two steps
    # after it arrived, and its TTFT covers them
    assert first_seen[long] == 2 and outputs[long].metrics.ttft > 0
    assert outputs[long].metrics == outputs[long].metrics and outputs[long] == outputs[long]


def test_arrival_time_counts_from_when_the_request_arrived(model):
    clock = StepClock()
    engine = kvlab.Engine(model, num_blocks=16, block_size=4, clock=clock)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=1), arrival_time=0.5)
    engine.run(progress=False)
    m = engine.outputs[rid].metrics
    assert m.arrival_time == 0.5 and m.output_tokens == 1 and m.tpot is None
    with pytest.raises(ValueError, match="no later than now"):
        engine.add_request([1, 2], arrival_time=clock.now + 100)
    with pytest.raises(TypeError, match="clock must be"):
        kvlab.Engine(model, num_blocks=16, clock=3.0)


def test_asking_for_an_unfinished_requests_output_says_so(model):
    engine = kvlab.Engine(model, num_blocks=32, block_size=4)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    with pytest.raises(KeyError, match=f"request {rid} is not finished yet \\(waiting\\)"):
        engine.outputs[rid]
    engine.step()
    with pytest.raises(KeyError, match="not finished yet \\(running\\)"):
        engine.outputs[rid]
    with pytest.raises(KeyError, match="no request 99 was added"):
        engine.outputs[99]
    assert engine.outputs.get(rid) is None and rid not in engine.outputs
    engine.run()
    assert len(engine.outputs[rid].outputs[0].tokens) == 3
