"""Issue 18: a long call stops for Ctrl-C within a fraction of a second and keeps what it
completed; NaN logits stop generation with an error naming the step; sane bounds and clear
messages for threads, token arrays, numbers in C messages and the command line.

The interrupts are real SIGINTs sent to this process while a call runs in C, sized to take
many seconds uninterrupted: the test checks that the call stopped early with
KeyboardInterrupt and what the cache holds after, never how fast (benchmarks do that)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvlab
from kvlab.measure import chunk_length, forward_counts, scratch_bytes

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to oneself")


@pytest.fixture(scope="module")
def long_model():
    """The bundled model with room for 9,000 positions: an 8,000-token call takes many
    seconds (attention over every earlier position), a decode loop minutes."""
    model = kvlab.load()
    return kvlab.Model(model.config.replace(max_seq_len=9000), model.weights, model.tokenizer)


def interrupt_after(seconds: float) -> threading.Thread:
    def fire():
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def interrupted(call, after: float = 0.3):
    """Runs call with a SIGINT `after` seconds in: the KeyboardInterrupt it raised, and the
    seconds the call ran (None if it finished first)."""
    thread = interrupt_after(after)
    started = time.perf_counter()
    try:
        call()
    except KeyboardInterrupt as error:
        thread.join()
        return error, time.perf_counter() - started
    thread.join()
    time.sleep(0.05)              # a SIGINT that came after the call must not hit the next test
    return None, None


def test_ctrl_c_stops_a_long_uncached_forward_and_the_model_still_works(long_model):
    tokens = np.random.default_rng(0).integers(0, 256, 8000)
    before = long_model.forward(tokens[:40])
    error, _ = interrupted(lambda: long_model.forward(tokens))
    assert error is not None, "an 8,000-token forward finished before the interrupt"
    assert np.array_equal(long_model.forward(tokens[:40]), before)


def test_ctrl_c_stops_a_long_uncached_forward_holding_one_layer(long_model):
    # It goes layer by layer over every token, so it cannot keep finished chunks as a
    # prefill does; it still stops between chunks of each layer (it ran in one pass, deaf
    # to Ctrl-C for as long as the whole call took: seconds here, minutes for 60,000).
    model = kvlab.Model(long_model.config.replace(max_seq_len=16000), long_model.weights)
    tokens = np.random.default_rng(0).integers(0, 256, 16000)
    before = model.forward(tokens[:40], uncached_kv="one_layer")
    model.reset_counters()
    error, seconds = interrupted(lambda: model.forward(tokens, uncached_kv="one_layer"))
    assert error is not None, "a 16,000-token forward finished before the interrupt"
    assert model.counters.calls == 0                       # a stopped call counts nothing
    # a Ctrl-C that waited for the end of the call would still raise, after it: this bound
    # is far above a chunk's time and far below the whole call's (tens of seconds)
    assert seconds < 3.0, f"the call ran {seconds:.1f} s, not stopped at the interrupt"
    assert np.array_equal(model.forward(tokens[:40], uncached_kv="one_layer"), before)


def test_an_interrupted_prefill_keeps_whole_chunks_and_goes_on_exactly(long_model):
    tokens = np.random.default_rng(1).integers(0, 256, 6000)
    cache = long_model.new_cache(6000)
    error, _ = interrupted(lambda: long_model.prefill(tokens, cache))
    assert error is not None, "a 6,000-token prefill finished before the interrupt"
    kept = cache.length
    chunk = chunk_length(long_model.config, 0, len(tokens))
    assert 0 < kept < len(tokens) and kept % chunk == 0, (kept, chunk)
    # what it kept is what a prefill of those tokens writes, and the rest continues exactly
    fresh = long_model.new_cache(6000)
    long_model.prefill(tokens[:kept], fresh)
    assert np.array_equal(cache.keys, fresh.keys) and np.array_equal(cache.values, fresh.values)
    last = long_model.prefill(tokens[kept:kept + 30], cache)
    assert np.array_equal(last, long_model.prefill(tokens[kept:kept + 30], fresh))


def test_an_interrupted_paged_prefill_keeps_whole_chunks_and_goes_on_exactly(long_model):
    # a paged sequence's long call goes in the same chunks, each reserved and committed
    tokens = np.random.default_rng(1).integers(0, 256, 6000)
    pool = long_model.new_paged_pool(num_blocks=400, block_size=16)
    seq = pool.new_sequence()
    error, _ = interrupted(lambda: long_model.forward(tokens, seq))
    assert error is not None, "a 6,000-token paged prefill finished before the interrupt"
    kept = seq.length
    chunk = chunk_length(long_model.config, 0, len(tokens))
    assert 0 < kept < len(tokens) and kept % chunk == 0, (kept, chunk)
    assert pool.stats().blocks_used == -(-kept // 16)      # no block held past what it kept
    fresh = pool.new_sequence()
    long_model.forward(tokens[:kept], fresh)
    for mine, theirs in zip(pool.gather(seq), pool.gather(fresh)):
        assert np.array_equal(mine, theirs)
    rest = tokens[kept:kept + 30]
    assert np.array_equal(long_model.forward(rest, seq), long_model.forward(rest, fresh))


def test_an_interrupted_decode_loop_keeps_its_steps_on_the_exception(long_model):
    cache = long_model.new_cache(9000)
    first = int(np.argmax(long_model.prefill([10, 20, 30], cache)))
    error, _ = interrupted(lambda: long_model.decode_steps(first, cache, 8000), after=0.2)
    assert error is not None, "8,000 decode steps finished before the interrupt"
    tokens, seconds = error.completed
    assert 0 < len(tokens) < 8000 and len(seconds) == len(tokens)
    assert cache.length == 3 + len(tokens)          # each completed step's token, no more
    reference = long_model.new_cache(9000)
    long_model.prefill([10, 20, 30], reference)
    again, _ = long_model.decode_steps(first, reference, len(tokens))
    assert np.array_equal(tokens, again)
    assert np.array_equal(cache.keys, reference.keys)


def batch_pool(model):
    """A pool with three sequences: one of 40 tokens, its fork (sharing a partly filled
    block: a batched call copies it on write) and an empty one."""
    pool = model.new_paged_pool(num_blocks=520, block_size=16)
    first = pool.new_sequence()
    model.forward(np.arange(40) % 256, first)
    return pool, [first, pool.fork(first), pool.new_sequence()]


def test_ctrl_c_stops_a_long_batched_forward_and_changes_nothing(long_model):
    # forward_batch runs every token of the batch through each layer at once, with no chunks
    # to stop between: it looks between layers, and a stopped call gives every reservation
    # back (the fork's copy on write too). Before, it ran to its end deaf to Ctrl-C (seconds
    # here; the Engine's calls at a long context, a second each on a 110M model) and the
    # KeyboardInterrupt came after, the rows committed
    rng = np.random.default_rng(5)
    chunks = [rng.integers(0, 256, 2500) for _ in range(3)]
    pool, seqs = batch_pool(long_model)
    before = (pool.stats(), [s.length for s in seqs], pool.ref_counts.copy())
    long_model.reset_counters()
    error, _ = interrupted(lambda: long_model.forward_batch(seqs, chunks))
    assert error is not None, "a batch of 7,500 tokens finished before the interrupt"
    assert (pool.stats(), [s.length for s in seqs]) == before[:2]
    assert np.array_equal(pool.ref_counts, before[2])
    assert long_model.counters.calls == 0               # a stopped call counts nothing
    pool.check()
    # the pool goes on exactly as one that never saw the call
    fresh, others = batch_pool(long_model)
    short = [c[:30] for c in chunks]
    assert np.array_equal(long_model.forward_batch(seqs, short),
                          long_model.forward_batch(others, short))
    for mine, theirs in zip(seqs, others):
        assert all(np.array_equal(m, t) for m, t in zip(pool.gather(mine), fresh.gather(theirs)))


@pytest.mark.parametrize("paged", [False, True])
def test_no_chunk_is_longer_than_the_first(paged):
    """The run state is sized for a call's first chunk. On this shape a call of two kernel
    passes and one token (2 x TOKEN_CHUNK + 1) is one pass and TOKEN_CHUNK + 1 tokens, which
    alone fit the work limit: asked again for what was left, the chunk rule gave the second
    chunk one row more than the buffers of the first (logits off by up to 0.9, found with
    TOKEN_CHUNK 48, 97 tokens and a vocabulary of 8,000). Every chunk after the first is now
    at most its length, and one call gives the bits of the same tokens in two calls."""
    k = kvlab._kvlab.TOKEN_CHUNK
    c = kvlab.ModelConfig(vocab_size=4000, max_seq_len=256, dim=512, hidden_dim=1376,
                          n_layers=2, n_heads=8, n_kv_heads=8)
    n = 2 * k + 1
    first = chunk_length(c, 0, n)
    assert first == k and chunk_length(c, first, n - first) == k + 1   # the case above
    model = kvlab.Model(c, kvlab.Weights.random(c, seed=3))
    tokens = np.random.default_rng(4).integers(0, 4000, n).astype(np.int32)

    def new():
        if paged:
            return model.new_paged_pool(num_blocks=16, block_size=16).new_sequence()
        return model.new_cache(256)
    one, two = new(), new()
    whole = model.forward(tokens, one, all_logits=True)
    parts = np.concatenate([model.forward(tokens[:k], two, all_logits=True),
                            model.forward(tokens[k:], two, all_logits=True)])
    assert np.array_equal(whole, parts)


def test_a_chunked_call_counts_and_returns_what_one_pass_would(long_model):
    c = long_model.config
    tokens = np.random.default_rng(2).integers(0, 256, 3000)
    chunk = chunk_length(c, 0, len(tokens))
    assert chunk < len(tokens)                       # this call is long enough to be chunked
    long_model.reset_counters()
    whole = long_model.forward(tokens, all_logits=True)
    counted = long_model.counters
    want = forward_counts(c, len(tokens), 0, True)
    assert counted.flops == want.flops and counted.weight_bytes == want.weight_bytes
    assert counted.calls == 1 and counted.tokens == len(tokens)
    assert counted.scratch_bytes == scratch_bytes(c, len(tokens), kvlab.get_num_threads(),
                                                  cached=False)
    # wanting the last token's logits alone, the chunks before skip the classifier
    long_model.reset_counters()
    assert np.array_equal(long_model.forward(tokens), whole[-1])
    counted, want_last = long_model.counters, forward_counts(c, len(tokens), 0, False)
    assert counted.flops_logits == want_last.flops_logits == 2 * c.dim * c.vocab_size
    assert counted.flops == want_last.flops and counted.weight_bytes == want_last.weight_bytes
    cache = long_model.new_cache(3000)
    parts = np.concatenate([long_model.prefill(tokens[i:i + 500], cache, all_logits=True)
                            for i in range(0, 3000, 500)])
    assert np.array_equal(whole, parts)
    # a paged sequence goes in the same chunks: the same logits, work and scratch
    seq = long_model.new_paged_pool(num_blocks=200, block_size=16).new_sequence()
    long_model.reset_counters()
    assert np.array_equal(whole, long_model.forward(tokens, seq, all_logits=True))
    counted = long_model.counters
    assert counted.flops == want.flops and counted.calls == 1
    assert counted.scratch_bytes == scratch_bytes(c, len(tokens), kvlab.get_num_threads())
    # blocks for every chunk are checked before the first runs: a refusal changes nothing
    small = long_model.new_paged_pool(num_blocks=150, block_size=16)
    seq = small.new_sequence()
    long_model.forward(tokens[:5], seq)
    with pytest.raises(kvlab.OutOfBlocks):
        long_model.forward(tokens, seq)
    assert seq.length == 5 and small.stats().blocks_used == 1
    # holding one layer's K and V, each layer goes over the same chunks: the same logits
    # and work, but the final norm and the classifier read once, not once a chunk
    long_model.reset_counters()
    one_layer = long_model.forward(tokens, all_logits=True, uncached_kv="one_layer")
    counted = long_model.counters
    assert np.array_equal(whole, one_layer)
    n_chunks = -(-len(tokens) // chunk)
    once = 4 * c.dim + 4 * c.dim * c.vocab_size
    assert counted.flops == want.flops and counted.calls == 1
    assert counted.weight_bytes == want.weight_bytes - (n_chunks - 1) * once
    assert counted.scratch_bytes == scratch_bytes(c, len(tokens), kvlab.get_num_threads(),
                                                  cached=False, uncached_kv="one_layer")


def test_the_chunk_rule_in_python_is_the_c_cores():
    config = kvlab.ModelConfig.llama2_7b()
    # one chunk for a short call; a long one splits, the same length until the last
    assert chunk_length(kvlab.load().config, 0, 512) == 512
    step = kvlab._kvlab.TOKEN_CHUNK                     # the kernels' pass (48, now 96)
    n = chunk_length(config, 0, 4096)
    assert step <= n < 4096
    assert chunk_length(config, 100_000, 10) == 10     # never fewer than step, never more than asked
    assert chunk_length(config, 100_000, step + 4) == step


def test_a_chunk_is_whole_passes_of_the_matrix_kernels():
    # The kernels stream each weight matrix once per TOKEN_CHUNK tokens: a chunk of 16 (the
    # old floor, what 2 GFLOP gave the 110M shape) read the weights three times as often
    # for the same tokens, and a 256-token prefill ran at 0.6x (issue 37).
    step = kvlab._kvlab.TOKEN_CHUNK
    assert kvlab.measure.CHUNK_MIN == step
    stories110m = kvlab.ModelConfig(dim=768, hidden_dim=2048, n_layers=12, n_heads=12,
                                    n_kv_heads=12, vocab_size=32000, max_seq_len=1024)
    stories15m = kvlab.ModelConfig(dim=288, hidden_dim=768, n_layers=6, n_heads=6,
                                   n_kv_heads=6, vocab_size=32000, max_seq_len=1024)
    assert chunk_length(stories110m, 0, 256) == step
    assert chunk_length(stories15m, 0, 256) == step       # 2 GFLOP is 66 tokens there
    for config in (stories110m, stories15m, kvlab.ModelConfig.llama2_7b(), kvlab.load().config):
        for start, n in ((0, 4096), (3000, 5000), (0, 8000)):
            chunk = chunk_length(config, start, n)
            assert chunk == n or chunk % step == 0, (config.name, start, n, chunk)


# ---- numbers ------------------------------------------------------------------------------------

def nan_model():
    model = kvlab.load()
    weights = model.weights
    import dataclasses
    broken = dataclasses.replace(weights, final_norm=np.full_like(weights.final_norm, np.nan))
    return kvlab.Model(model.config, broken, model.tokenizer)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_over_nan_logits_raises_naming_the_step(use_cache):
    with pytest.raises(ValueError, match=r"generate, new token 0 \(position 5\).*NaN"):
        kvlab.generate(nan_model(), "ROMEO:", 5, use_cache=use_cache)


def test_c_messages_show_their_numbers():
    from kvlab._core import core
    for call, shown in ((lambda: core.sample(np.zeros(3, np.float32), -1.5, 0, 1.0, 0.5), "-1.5"),
                        (lambda: core.sample(np.zeros(3, np.float32), 1.0, 0, 1.25, 0.5), "1.25"),
                        (lambda: core.sample(np.zeros(3, np.float32), 1.0, 0, 1.0, 2.5), "2.5")):
        with pytest.raises(ValueError) as error:
            call()
        assert shown in str(error.value) and "%" not in str(error.value)


# ---- resources and messages --------------------------------------------------------------------

def test_threads_are_bounded_by_the_cores():
    before = kvlab.get_num_threads()
    with pytest.raises(ValueError, match="4 per core"):
        kvlab.set_num_threads(1024)
    assert kvlab.get_num_threads() == before
    try:
        kvlab.set_num_threads(4 * len(os.sched_getaffinity(0)))      # the most it allows
    finally:
        kvlab.set_num_threads(before)


def test_a_misaligned_token_array_is_copied_not_refused():
    model = kvlab.load()
    raw = np.zeros(4 * 6 + 1, np.uint8)
    tokens = raw[1:].view(np.int32)                 # contiguous, at an odd address
    tokens[:] = [82, 79, 77, 69, 79, 58]
    assert tokens.flags.c_contiguous and not tokens.flags.aligned
    assert np.array_equal(model.forward(tokens), model.forward(tokens.copy()))
    pool = model.new_paged_pool(num_blocks=4, block_size=4)
    assert pool.reuse_prefix(pool.new_sequence(), tokens) == 0


def kvlab_cli(*args, pipe_into=None, cwd):
    """The command line, run from `cwd` (not the repository root, whose source folder would
    shadow an installed kvlab)."""
    command = [sys.executable, "-m", "kvlab", *args]
    if pipe_into is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    shell = " ".join(command) + f" | {pipe_into}; exit ${{PIPESTATUS[0]}}"
    return subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_bench_refuses_zero_repeats_plainly(tmp_path):
    run = kvlab_cli("bench", "--repeats", "0", cwd=tmp_path)
    assert run.returncode == 2 and "--repeats: must be at least 1, got 0" in run.stderr
    assert "Traceback" not in run.stderr


def test_output_cut_short_by_head_is_not_an_error(tmp_path):
    run = kvlab_cli("lab", "show", "scheduler", pipe_into="head -c 20 > /dev/null", cwd=tmp_path)
    assert run.stderr == "", run.stderr
