"""Cache-size arithmetic: the course's worked example, exactly, and real caches agree."""
import pytest

import kvlab
from kvlab.measure import kv_bytes_per_token, kv_cache_bytes, weights_bytes

GiB = 1024 ** 3


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def test_the_worked_example_of_the_chapter():
    llama = kvlab.ModelConfig.llama2_7b()          # 32 layers, 4096 hidden, MHA
    assert kv_bytes_per_token(llama, "fp16") == 524_288                 # 512 KiB
    assert kv_cache_bytes(llama, seq_len=4096, dtype="fp16") == 2 * GiB
    assert kv_cache_bytes(llama, seq_len=4096, batch=16, dtype="fp16") == 32 * GiB
    weights = weights_bytes(llama, "fp16")
    assert 13.4e9 < weights < 14e9                  # "14 GB of fp16 weights"
    assert kv_cache_bytes(llama, 4096, 16, "fp16") > weights


def test_gqa_divides_cache_bytes_by_the_group_size():
    big = kvlab.ModelConfig.llama2_70b()           # 64 query heads, 8 KV heads
    mha = big.replace(n_kv_heads=big.n_heads)
    assert kv_bytes_per_token(mha, "fp16") == 8 * kv_bytes_per_token(big, "fp16")


def test_the_formulas_default_to_new_caches_format_and_say_the_default_changed(model):
    # kv_cache_bytes once defaulted to fp16 while new_cache defaults to fp32: now both
    # mean fp32, and leaving dtype out says so (for one release) since the number changed.
    config = model.config
    with pytest.warns(FutureWarning, match="kv_cache_bytes's dtype now defaults to 'fp32'"):
        assert kv_cache_bytes(config, 300) == model.new_cache(300).nbytes
    with pytest.warns(FutureWarning, match="kv_bytes_per_token's dtype now defaults"):
        assert kv_bytes_per_token(config) == kv_bytes_per_token(config, "fp32")
    # nothing to say when both sides are named
    assert kv_bytes_per_token(config, key_format="int8", value_format="fp16") > 0


def test_a_cache_format_object_is_a_dtype_everywhere(model):
    fmt = kvlab.CacheFormat.make(model.config.head_dim, key="int8", value="int4", window=4)
    cache = model.new_cache(64, fmt)
    assert (cache.key_format, cache.value_format, cache.window) == ("int8", "int4", 4)
    assert cache.nbytes == kv_cache_bytes(model.config, 64, dtype=fmt)
    assert model.new_cache(64, fmt).nbytes == model.new_cache(64, key_format="int8",
                                                             value_format="int4", window=4).nbytes
    pool = model.new_paged_pool(8, 16, fmt)
    assert (pool.key_format, pool.value_format, pool.window) == ("int8", "int4", 4)
    assert kvlab.generate(model, [1, 2, 3], 5, dtype=fmt).tokens == \
        kvlab.generate(model, [1, 2, 3], 5, key_format="int8", value_format="int4", window=4).tokens
    engine = kvlab.Engine(model, num_blocks=8, dtype=fmt)
    assert engine.pool.key_format == "int8"
    # a CacheFormat says everything: options beside it are refused, not merged
    with pytest.raises(TypeError, match="drop group"):
        model.new_cache(64, fmt, group=8)
    # and it is checked against the model: groups must divide this model's head_dim
    odd = kvlab.CacheFormat.make(model.config.head_dim * 3, "int8", group=model.config.head_dim * 3)
    with pytest.raises(ValueError, match="must divide head_dim"):
        model.new_cache(64, odd)
    with pytest.raises(TypeError, match="dtype must be a format name"):
        model.new_cache(64, 8)


@pytest.mark.parametrize("preset", sorted(kvlab.ModelConfig.presets()))
def test_presets_are_consistent(preset):
    config = kvlab.ModelConfig.presets()[preset]
    assert config.n_heads % config.n_kv_heads == 0
    assert kv_bytes_per_token(config, "fp32") == 2 * kv_bytes_per_token(config, "fp16")


def test_real_caches_allocate_what_the_formula_says():
    config = kvlab.ModelConfig.shakespeare_1m()
    model = kvlab.Model(config, kvlab.Weights.random(config))
    assert model.new_cache(300).nbytes == kv_cache_bytes(config, 300, dtype="fp32")
    pool = model.new_paged_pool(num_blocks=10, block_size=16)
    assert pool.nbytes == kv_cache_bytes(config, 160, dtype="fp32")


@pytest.mark.parametrize("options", [
    {"dtype": "fp16"}, {"dtype": "bf16"}, {"dtype": "int8"}, {"dtype": "int8", "group": 4},
    {"dtype": "int4"}, {"dtype": "int4", "group": 8, "window": 32}, {"dtype": "fp8"},
    {"key_format": "int8", "value_format": "int4", "window": 5}])
def test_quantized_caches_allocate_what_the_formula_says(options):
    # scales, zero points and the window's float32 rows are part of the formula
    config = kvlab.ModelConfig.shakespeare_1m()
    model = kvlab.Model(config, kvlab.Weights.random(config))
    options = {"dtype": "fp32", **options}
    assert model.new_cache(300, **options).nbytes == kv_cache_bytes(config, 300, **options)
    assert (kv_cache_bytes(config, 300, 4, **options)
            == 4 * kv_cache_bytes(config, 300, 1, **options))
    pool = model.new_paged_pool(num_blocks=10, block_size=16, max_seqs=3, **options)
    fmt = model.cache_format(**options)
    window_rows = fmt.window_bytes(config.n_layers, config.n_kv_heads, config.head_dim)
    assert pool.nbytes == kv_cache_bytes(config, 160, **{**options, "window": 0}) + 3 * window_rows


def test_quantized_bytes_per_token_by_hand():
    # Llama 2 7B (head_dim 128), int8 with one scale per token per head: 128 one-byte codes
    # plus a 4-byte scale for each of 32 heads, K and V, 32 layers
    llama = kvlab.ModelConfig.llama2_7b()
    assert kv_bytes_per_token(llama, "int8") == 2 * 32 * 32 * (128 + 4)
    assert kv_bytes_per_token(llama, "int4") == 2 * 32 * 32 * (64 + 4 * 8)   # groups of 32
    assert kv_bytes_per_token(llama, "int4", group=128) == 2 * 32 * 32 * (64 + 8)
    assert kv_bytes_per_token(llama, key_format="int8", value_format="fp16") == 32 * 32 * (132 + 256)


def test_bad_arguments():
    config = kvlab.ModelConfig.stories260k()
    with pytest.raises(ValueError, match="format"):
        kv_cache_bytes(config, 10, dtype="fp64")
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(config, -1)


# ---- FLOP and byte counts: the formulas against the C core's counters ---------------------

import numpy as np  # noqa: E402

from kvlab.measure import (Counts, arithmetic_ratio, forward_counts,  # noqa: E402
                           generation_counts, scratch_bytes)

SHAPES = [  # (dim, hidden, layers, heads, kv_heads, head_dim, vocab)
    (32, 48, 2, 4, 4, 8, 50),       # MHA
    (64, 80, 3, 8, 2, 16, 97),      # GQA
    (48, 40, 1, 6, 1, 10, 33),      # MQA, head_dim not a multiple of 8
    (20, 36, 2, 3, 3, 6, 64),       # dim != n_heads * head_dim
]


def random_model(shape, seed=0):
    dim, hidden, layers, heads, kv_heads, head_dim, vocab = shape
    config = kvlab.ModelConfig(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads,
                               n_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                               max_seq_len=64)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=seed))


def without_scratch(counts: Counts) -> Counts:
    return Counts(**{**counts.__dict__, "scratch_bytes": 0})


@pytest.mark.parametrize("shape", SHAPES)
def test_core_counters_equal_the_formulas_call_by_call(shape):
    model = random_model(shape)
    c, threads = model.config, kvlab.get_num_threads()
    tokens = list(np.random.default_rng(0).integers(0, c.vocab_size, size=12))
    cache = model.new_cache(20)
    pool = model.new_paged_pool(num_blocks=8, block_size=3)
    seq = pool.new_sequence()
    calls = [
        (lambda: model.prefill(tokens[:7], cache, all_logits=True), (7, 0, True, True)),
        (lambda: model.prefill(tokens[7:9], cache), (2, 7, False, True)),
        (lambda: model.decode(int(tokens[9]), cache), (1, 9, False, True)),
        (lambda: model.forward(tokens, all_logits=False), (12, 0, False, False)),
        (lambda: model.forward(tokens[:5], all_logits=True), (5, 0, True, False)),
        (lambda: model.prefill(tokens[:4], seq), (4, 0, False, True)),
        (lambda: model.decode(int(tokens[4]), seq), (1, 4, False, True)),
    ]
    for call, (n, start, all_logits, cached) in calls:
        model.reset_counters()
        call()
        counted = model.counters
        assert without_scratch(counted) == forward_counts(c, n, start, all_logits)
        assert counted.scratch_bytes == scratch_bytes(c, n, threads, cached)
    # without a cache, holding one layer's K and V at a time: the same logits and work,
    # one layer's K and V in place of all of them, and the buffers for every token at once
    for n in (5, 12):
        model.reset_counters()
        held_one = model.forward(tokens[:n], all_logits=True, uncached_kv="one_layer")
        counted = model.counters
        assert np.array_equal(held_one, model.forward(tokens[:n], all_logits=True))
        assert without_scratch(counted) == forward_counts(c, n, 0, True)
        assert counted.scratch_bytes == scratch_bytes(c, n, threads, cached=False,
                                                      uncached_kv="one_layer")


def test_scratch_counts_the_packed_copy_of_a_products_input():
    """The AVX-512 tiles (the running variant's, kvlab._kvlab.PACKED_INPUTS) pack a
    product's input, a chunk of TOKEN_CHUNK tokens of the widest one at a time: the
    counters' peak includes that copy (the plain tier makes none), and scratch_bytes agrees."""
    model = random_model(SHAPES[0])
    c, n, threads = model.config, 60, kvlab.get_num_threads()
    tokens = np.arange(n) % c.vocab_size
    counted = {}
    kernels = kvlab.get_kernels()
    try:
        for tier in ("fast", "plain"):
            kvlab.set_kernels(tier)
            cache = model.new_cache(n)
            model.reset_counters()
            model.prefill(tokens, cache)
            counted[tier] = model.counters.scratch_bytes
            assert counted[tier] == scratch_bytes(c, n, threads)
    finally:
        kvlab.set_kernels(kernels)
    widest = max(c.dim, c.hidden_dim, c.q_dim)
    chunk = min(n, kvlab._kvlab.TOKEN_CHUNK)
    packed = (chunk + 1) // 2 * (widest // 8) * 16 * 4 if kvlab._kvlab.PACKED_INPUTS & 1 else 0
    assert counted["fast"] - counted["plain"] == packed


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_scratch_counts_the_int8_tiles_sums_and_panels(fmt):
    """With block weights and int8 activations, the AVX-512 VNNI tile (PACKED_INPUTS & 2)
    takes a product of 8 tokens or more, which allocates each token's blocks' starting sums
    and a panel of 16 rows per thread (640 bytes a block); fewer tokens stream the rows and
    allocate nothing the plain tier does not. The counters include it; scratch_bytes agrees."""
    config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, vocab_size=64, max_seq_len=64)  # widths of 32s
    stored = kvlab.Weights.random(config, seed=4).converted(fmt)
    model = kvlab.Model(config, stored, activations="int8")
    threads, blocks = kvlab.get_num_threads(), max(config.dim, config.hidden_dim) // 32
    tokens = np.arange(13) % config.vocab_size
    kernels = kvlab.get_kernels()
    try:
        for n in (7, 8, 13):
            counted = {}
            for tier in ("fast", "plain"):
                kvlab.set_kernels(tier)
                model.reset_counters()
                model.prefill(tokens[:n], model.new_cache(n))
                counted[tier] = model.counters.scratch_bytes
                assert counted[tier] == scratch_bytes(config, n, threads, weights=stored.formats,
                                                      int8_activations=True)
            tile = n >= 8 and kvlab._kvlab.PACKED_INPUTS & 2
            want = (n * blocks + threads * blocks * 640 // 4) * 4 if tile else 0
            assert counted["fast"] - counted["plain"] == want, n
    finally:
        kvlab.set_kernels(kernels)


@pytest.mark.parametrize("options", [{"dtype": "int8"}, {"dtype": "int4", "window": 3},
                                     {"key_format": "fp8", "value_format": "bf16", "window": 20}])
def test_core_counts_the_bytes_a_quantized_cache_moves(options):
    # reads: stored bytes (codes, scales, zeros) outside the window, float32 inside it;
    # writes: each new row as stored, and the window's float32 copy
    model = random_model(SHAPES[1])
    fmt = model.cache_format(**options)
    tokens = list(np.random.default_rng(1).integers(0, model.config.vocab_size, size=10))
    cache = model.new_cache(20, **options)
    seq = model.new_paged_pool(num_blocks=8, block_size=3, **options).new_sequence()
    for target in (cache, seq):
        for n, start in ((6, 0), (1, 6), (3, 7)):
            model.reset_counters()
            model.prefill(tokens[start:start + n], target)
            assert without_scratch(model.counters) == forward_counts(model.config, n, start,
                                                                     cache=fmt)
    fp32 = forward_counts(model.config, 1, 9).kv_read_bytes
    read = forward_counts(model.config, 1, 9, cache=fmt).kv_read_bytes
    # a window as long as the sequence reads everything in float32: no saving at all
    assert read == fp32 if fmt.window >= 10 else read < fp32


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_counts_equal_the_core_counters(use_cache):
    model = random_model(SHAPES[1], seed=2)
    out = kvlab.generate(model, [1, 2, 3, 4, 5], max_new_tokens=17, use_cache=use_cache)
    want = generation_counts(model.config, 5, 17, use_cache)
    assert without_scratch(out.counts) == without_scratch(want)
    assert out.flops == want.flops


def test_the_cache_saves_arithmetic_in_proportion_to_the_length():
    llama = kvlab.ModelConfig.llama2_7b()
    # 2,048 tokens generated after a one-token prompt: about a thousand times less work
    assert 980 < arithmetic_ratio(llama, 1, 2048) < 1000
    assert arithmetic_ratio(llama, 1, 2100) > 1000
    # the longer the prompt is relative to the output, the smaller the saving
    assert arithmetic_ratio(llama, 1024, 1024) < arithmetic_ratio(llama, 1, 2048)
    assert arithmetic_ratio(llama, 100, 1) == pytest.approx(1.0)


def test_counters_reject_a_wrong_array():
    model = random_model(SHAPES[0])
    with pytest.raises(TypeError, match="int64"):
        model._core.forward(np.array([1], dtype=np.int32), None, False, np.zeros(3))


MEASURE_IN_A_FRESH_PROCESS = """
import json, sys, kvlab
from kvlab.measure import measure_memory
config = kvlab.ModelConfig.stories260k().replace(max_seq_len=1024)
model = kvlab.Model(config, kvlab.Weights.random(config))
report = measure_memory(model, context=1024, batch=16, cache=sys.argv[1])
print(json.dumps({**report.__dict__, "threads": kvlab.get_num_threads()}))
"""


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_measured_memory_matches_the_formula(kind, tmp_path):
    """Resident memory is a property of the whole process, so this measures in a fresh one."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    # the same kvlab these tests import, from a folder where no source tree can shadow it
    env = {**os.environ, "PYTHONPATH": str(Path(kvlab.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", MEASURE_IN_A_FRESH_PROCESS, kind],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    config = kvlab.ModelConfig.stories260k().replace(max_seq_len=1024)
    formula = kv_cache_bytes(config, 1024, 16, "fp32")
    assert report["formula_bytes"] == report["allocated_bytes"] == formula
    # memory is reserved lazily: creating the caches costs little, filling them the formula
    assert report["rss_after_create"] < 0.2 * formula
    assert abs(report["rss_after_fill"] - formula) < 0.1 * formula
    assert report["scratch_bytes"] == scratch_bytes(config, 1024, report["threads"])


def test_measure_memory_checks_its_arguments():
    from kvlab.measure import measure_memory
    model = random_model(SHAPES[0])
    with pytest.raises(ValueError):
        measure_memory(model, context=4096)
    with pytest.raises(ValueError):
        measure_memory(model, context=8, cache="fancy")


def test_working_memory_of_256_tokens_follows_from_the_shapes():
    from kvlab.measure import working_memory
    model = random_model(SHAPES[1], seed=3)
    model = kvlab.Model(model.config.replace(max_seq_len=300), model.weights)
    threads = kvlab.get_num_threads()
    report = working_memory(model, [1, 2, 3], new_tokens=256)
    c = model.config
    # without a cache, the last step runs all 258 tokens and rebuilds their K and V
    assert report.uncached_scratch == scratch_bytes(c, 3 + 255, threads, cached=False)
    # with one, the largest call is the prefill or a late decode; the cache holds 258 rows
    assert report.cached_scratch == max(scratch_bytes(c, 3, threads),
                                        scratch_bytes(c, 1, threads))
    assert report.cache_bytes == kv_cache_bytes(c, 258, dtype="fp32")
    assert report.ratio > 1
    # holding one layer's K and V at a time saves the other layers' (this shape's calls
    # run in one chunk, so the buffers are the same size either way)
    assert report.uncached_one_layer_scratch == scratch_bytes(c, 258, threads, cached=False,
                                                              uncached_kv="one_layer")
    assert (report.uncached_scratch - report.uncached_one_layer_scratch
            == (c.n_layers - 1) * 2 * 258 * c.kv_dim * 4)
    assert report.one_layer_ratio < report.ratio


def test_working_memory_of_a_model_on_the_gpu_skips_the_one_layer_run(monkeypatch):
    # The GPU's no-cache path holds every layer's K and V and refuses uncached_kv=
    # "one_layer": working_memory reports what it ran (None for the other way) instead of
    # raising after both generations. A stand-in for kvlab.cuda.CudaModel: its generations
    # run on the CPU model, and a forward of its own would raise as the GPU model's does.
    from kvlab import measure
    model = random_model(SHAPES[0])

    class OnTheGpu:
        device = "cuda"

        def forward(self, *args, **kwargs):
            raise ValueError("uncached_kv='one_layer' runs on the CPU")

    real_generate = measure.generate
    monkeypatch.setattr(measure, "generate",
                        lambda _, *args, **kwargs: real_generate(model, *args, **kwargs))
    report = measure.working_memory(OnTheGpu(), [1, 2, 3], new_tokens=5)
    assert report.uncached_one_layer_scratch is None and report.one_layer_ratio is None
    assert report.uncached_scratch == scratch_bytes(model.config, 7, kvlab.get_num_threads(),
                                                    cached=False)
    assert report.ratio > 0


def test_uncached_kv_is_checked_and_means_no_cache():
    model = random_model(SHAPES[0])
    with pytest.raises(ValueError, match="uncached_kv must be one of"):
        model.forward([1, 2], uncached_kv="none")
    with pytest.raises(ValueError, match="give cache=None"):
        model.forward([1, 2], model.new_cache(4), uncached_kv="one_layer")
    with pytest.raises(ValueError, match="uncached_kv must be"):
        scratch_bytes(model.config, 4, cached=False, uncached_kv="two")
    # with a cache there is no other way to hold K and V: refused, as forward refuses it
    with pytest.raises(ValueError, match="give cached=False"):
        scratch_bytes(model.config, 4, uncached_kv="one_layer")
    # a long sequence held one layer at a time goes layer by layer: its buffers span it all
    c = kvlab.ModelConfig.llama2_7b()
    assert kvlab.measure.chunk_length(c, 0, 262) < 262
    one = scratch_bytes(c, 262, cached=False, uncached_kv="one_layer")
    one_layer_kv = 2 * 262 * c.kv_dim * 4
    # (the buffers alone: the plain tier's count, without the AVX-512 tiles' packed copy of
    # a product's input, which is one chunk of tokens in both)
    kernels = kvlab.get_kernels()
    kvlab.set_kernels("plain")
    try:
        buffers = scratch_bytes(c, 262, cached=False, uncached_kv="one_layer") - one_layer_kv
        # 262 tokens' buffers, not one chunk's (TOKEN_CHUNK tokens)
        assert buffers > 262 // kvlab._kvlab.TOKEN_CHUNK * scratch_bytes(c, 262)
    finally:
        kvlab.set_kernels(kernels)
    # ... and still far less than the cache it does without (chapter 1: about 0.2x)
    assert one < 0.25 * kv_cache_bytes(c, 262, dtype="fp32")


def test_counting_block_keeps_its_own_peak():
    model = random_model(SHAPES[0])
    model.forward(list(range(40)))                     # a big call first
    with model.counting() as small:
        model.forward([1])
    assert small.scratch_bytes < model.counters.scratch_bytes
    assert small.calls == 1 and model.counters.calls == 2


def test_counting_blocks_nest():
    # generate counts inside its own block; a caller's block around it sees the same calls
    model = random_model(SHAPES[0])
    with model.counting() as outer:
        model.forward([1, 2])
        with model.counting() as inner:
            model.forward([3])
        model.forward([4])
    assert (outer.calls, inner.calls) == (3, 1)


def test_per_token_saving_grows_with_position():
    from kvlab.measure import per_token_saving
    llama = kvlab.ModelConfig.llama2_7b()
    assert per_token_saving(llama, 0) == pytest.approx(0.0)
    assert per_token_saving(llama, 3) == pytest.approx(0.75, abs=0.01)
    assert per_token_saving(llama, 9) == pytest.approx(0.90, abs=0.01)
    assert per_token_saving(llama, 2047) > 0.999


def test_counting_blocks_in_two_threads_see_only_their_own_calls():
    import threading
    model = random_model(SHAPES[1])
    results = {}

    def work(name, n_tokens):
        with model.counting() as counts:
            for _ in range(20):
                model.forward(list(range(n_tokens)))
        results[name] = counts

    threads = [threading.Thread(target=work, args=(name, n)) for name, n in (("a", 3), ("b", 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"].tokens == 60 and results["b"].tokens == 180
    assert results["a"].flops == 20 * forward_counts(model.config, 3).flops
    assert model.counters.calls == 40


def test_memory_bandwidth_is_measured_by_the_core():
    bandwidth = kvlab.measure.memory_bandwidth(1 << 22, 1)
    assert set(bandwidth) == {"read_bytes_per_s", "triad_bytes_per_s"}
    assert all(value > 1e8 for value in bandwidth.values())
    with pytest.raises(ValueError, match="n_bytes"):
        kvlab.measure.memory_bandwidth(100)
    with pytest.raises(ValueError, match="repeats"):
        kvlab.measure.memory_bandwidth(1 << 22, 0)


def test_compute_roof_is_measured_by_the_core():
    """The compute roof: every rate positive on one thread and on the core's threads, the
    int8 dot product's rate at least its own product sequence's (which adds a conversion, a
    scale and a multiply-add to every sum of four), the instructions named; repeats out of
    range refused."""
    roof = kvlab.measure.compute_roof(1)
    rates = [k for k in roof if k.endswith("_per_s") or k.endswith("_per_s_1_thread")]
    assert len(rates) == 6 and all(roof[k] > 1e7 for k in rates)
    assert roof["int8_ops_per_s_1_thread"] >= roof["int8_product_ops_per_s_1_thread"]
    assert roof["threads"] == kvlab.get_num_threads()
    assert isinstance(roof["f32_instruction"], str) and isinstance(roof["int8_instruction"], str)
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="repeats"):
            kvlab.measure.compute_roof(bad)


def test_attention_walk_bandwidth_is_measured_by_the_core():
    """Attention's access pattern alone: a rate in a plausible range, for a context of whole
    tiles and one ending in a partial tile, and clear errors for shapes the walk cannot
    take."""
    for context in (16, 100):
        rate = kvlab.measure.attention_walk_bandwidth(context, n_kv_heads=2, head_dim=64,
                                                      repeats=1)
        assert 1e8 < rate < 1e13
    with pytest.raises(ValueError, match="multiple of 8"):
        kvlab.measure.attention_walk_bandwidth(64, head_dim=12)
    with pytest.raises(ValueError, match="context of 16"):
        kvlab.measure.attention_walk_bandwidth(8)
    with pytest.raises(ValueError, match="must be an integer"):
        kvlab.measure.attention_walk_bandwidth(64.0)


@pytest.mark.parametrize("call, name", [
    (lambda c: kvlab.measure.per_token_saving(c, -1), "position"),
    (lambda c: kvlab.measure.per_token_saving(c, 2.5), "position"),
    (lambda c: kvlab.measure.arithmetic_ratio(c, 0, 10), "prompt_len"),
    (lambda c: kvlab.measure.arithmetic_ratio(c, 1, 0), "new_tokens"),
    (lambda c: kvlab.measure.forward_counts(c, 0), "n_tokens"),
    (lambda c: kvlab.measure.forward_counts(c, 4, start_pos=-2), "start_pos"),
    (lambda c: kvlab.measure.scratch_bytes(c, True), "n_tokens"),
    (lambda c: kvlab.measure.scratch_bytes(c, 4, n_threads=0), "n_threads"),
])
def test_counts_from_the_shapes_refuse_impossible_arguments_by_name(call, name):
    # (these once divided by zero or multiplied a list by a float)
    with pytest.raises(ValueError, match=f"{name} must be (an integer|at least)"):
        call(kvlab.ModelConfig.llama2_7b())
