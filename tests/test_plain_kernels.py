"""The two tiers of the C core's kernels run the whole model to the same bits.

csrc/plain.c holds plain, readable attention, matrix product, RMSNorm, RoPE and SwiGLU (the
ones the chapters quote); csrc/ops.c and csrc/attention.c the fast ones. kvlab.set_kernels
("plain") or KVLAB_KERNELS=plain switches the whole process to the plain ones. Here every
way of running the model (generation, prefill with every token's logits, decode, a paged
pool, a batch, cache.attend) gives identical arrays on both tiers, on one thread and two.
The kernels themselves are compared one by one in tests/c/test_core.c.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvlab

PROMPT = "ROMEO: What light through yonder window breaks?"
FORMATS = [("fp32", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {}),
           ("fp8", {}), ("int8", {"window": 4})]


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(autouse=True)
def back_to_fast():
    threads = kvlab.get_num_threads()
    yield
    kvlab.set_kernels("fast")
    kvlab.set_num_threads(threads)


def on_each_tier(run):
    """run() on the fast kernels, then on the plain ones: (fast result, plain result)."""
    results = []
    for tier in ("fast", "plain"):
        kvlab.set_kernels(tier)
        assert kvlab.get_kernels() == tier
        results.append(run())
    kvlab.set_kernels("fast")
    return results


def test_the_switch():
    assert kvlab.get_kernels() == "fast"
    kvlab.set_kernels("plain")
    assert kvlab.get_kernels() == "plain"
    with pytest.raises(ValueError, match="'fast' or 'plain'"):
        kvlab.set_kernels("slow")
    assert kvlab.get_kernels() == "plain"      # a refused name changes nothing
    with pytest.raises(TypeError):
        kvlab.set_kernels(1)
    kvlab.set_kernels("fast")
    assert kvlab.get_kernels() == "fast"


@pytest.mark.parametrize("threads", [1, 2])
def test_generate_gives_the_same_tokens(model, threads):
    kvlab.set_num_threads(threads)

    def run():
        greedy = kvlab.generate(model, PROMPT, max_new_tokens=40, stop_at_eos=False)
        sampled = kvlab.generate(model, PROMPT, max_new_tokens=40, temperature=0.9, top_k=20,
                                 seed=7, stop_at_eos=False)
        stepped = kvlab.generate(model, PROMPT, max_new_tokens=12, fast=False, stop_at_eos=False)
        uncached = kvlab.generate(model, PROMPT, max_new_tokens=12, use_cache=False,
                                  stop_at_eos=False)
        return [g.tokens for g in (greedy, sampled, stepped, uncached)]

    fast, plain = on_each_tier(run)
    assert fast == plain
    assert fast[2] == fast[3] == fast[0][:12]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,options", FORMATS, ids=[f + str(o) for f, o in FORMATS])
def test_prefill_and_decode_give_the_same_logits(model, dtype, options, threads):
    kvlab.set_num_threads(threads)
    tokens = model.encode(PROMPT)

    def run():
        cache = model.new_cache(128, dtype, **options)
        logits = [model.prefill(tokens, cache, all_logits=True)]
        token = int(np.argmax(logits[-1][-1]))
        for _ in range(6):
            logits.append(model.decode(token, cache))
            token = int(np.argmax(logits[-1]))
        logits.append(model.forward(tokens, all_logits=True))
        return logits

    fast, plain = on_each_tier(run)
    assert all(np.array_equal(f, p) for f, p in zip(fast, plain))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_paged_pool_and_a_batch_give_the_same_logits(model, threads):
    kvlab.set_num_threads(threads)
    tokens = model.encode(PROMPT)

    def run():
        pool = model.new_paged_pool(num_blocks=64, block_size=5, dtype="int8")
        a, b = pool.new_sequence(), pool.new_sequence()
        logits = [model.prefill(tokens, a, all_logits=True), model.prefill(tokens[:17], b)]
        for step in range(4):
            chunks = [[tokens[step]], tokens[17 + step:19 + step]]
            logits.append(model.forward_batch([a, b], chunks))
        logits.append(model.decode(tokens[-1], a))
        return logits

    fast, plain = on_each_tier(run)
    assert all(np.array_equal(f, p) for f, p in zip(fast, plain))


@pytest.mark.parametrize("threads", [1, 2])
def test_cache_attend_is_the_same_on_both_tiers(threads):
    kvlab.set_num_threads(threads)
    # 600 positions: enough work for attention to be split over the threads
    config = kvlab.ModelConfig(dim=128, hidden_dim=64, n_layers=1, n_heads=8, n_kv_heads=2,
                               head_dim=16, vocab_size=32, max_seq_len=1024)
    rng = np.random.default_rng(3)
    model = kvlab.Model(config, kvlab.Weights.random(config, seed=0))
    cache = model.new_cache(600, "fp16")
    keys, values = rng.standard_normal((2, 600, 1, 2, 16), dtype=np.float32)
    cache.append(keys, values)
    q = rng.standard_normal((8, 16), dtype=np.float32)
    fast, plain = on_each_tier(lambda: cache.attend(q, 0))
    assert np.array_equal(fast, plain)


SCRIPT = """
import json, sys
import numpy as np
import kvlab
model = kvlab.load()
tokens = model.encode(sys.argv[1])
cache = model.new_cache(128)
logits = model.prefill(tokens, cache, all_logits=True)
out = kvlab.generate(model, sys.argv[1], max_new_tokens=30, stop_at_eos=False)
np.save(sys.argv[2], logits)
print(json.dumps({"kernels": kvlab.get_kernels(), "tokens": out.tokens}))
"""


def test_the_environment_variable_runs_the_plain_kernels(model, tmp_path):
    env = dict(os.environ, KVLAB_KERNELS="plain")
    done = subprocess.run([sys.executable, "-c", SCRIPT, PROMPT, str(tmp_path / "plain.npy")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kernels"] == "plain"
    cache = model.new_cache(128)
    logits = model.prefill(model.encode(PROMPT), cache, all_logits=True)
    tokens = kvlab.generate(model, PROMPT, max_new_tokens=30, stop_at_eos=False).tokens
    assert kvlab.get_kernels() == "fast"
    assert np.array_equal(np.load(tmp_path / "plain.npy"), logits)
    assert report["tokens"] == tokens


def test_a_wrong_environment_variable_is_named(tmp_path):
    env = dict(os.environ, KVLAB_KERNELS="plian")
    done = subprocess.run([sys.executable, "-c", "import kvlab"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    assert "KVLAB_KERNELS must be 'fast' or 'plain', got 'plian'" in done.stderr
