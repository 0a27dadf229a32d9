"""Hidden grading tests for lab 3 (cache size). Each test says in its message what it expected.

Run by the judge (kvlab/grading/judge.py), never shipped in the package. The answers are
checked against kvlab's own cache arithmetic (kvlab.kv_cache_bytes), the bytes a real cache
allocates (cache.nbytes) and the course's worked example, on shapes drawn at grading time.
The measurement is checked against what the caches really take: the model lent to the
student's code (kvlab/grading/handouts.py, LabModel) stays in the judge and gives each
cache it fills an extra block of memory of a size drawn here, so only a measurement of
resident memory around filled caches is right; and the model knows which caches were
filled, which bounds the answer from above.
"""
import mmap

import kvlab
from kvlab.grading.handouts import LabModel
from kvlab.grading.testkit import bundled_model, config_record, described, number, points, whole_number

GiB = 1024 ** 3
LLAMA2_7B = kvlab.ModelConfig.llama2_7b()
LLAMA3_8B = kvlab.ModelConfig.llama3_8b()


def prepare():
    bundled_model()


def random_configs(rng, n):
    """Shapes of every kind, small and large: MHA, GQA and MQA in turn."""
    for i in range(n):
        kind = i % 3
        n_kv_heads = 1 if kind == 2 else int(rng.choice([2, 4, 8]))
        n_heads = n_kv_heads * (1 if kind == 0 else int(rng.choice([2, 4, 8])))
        head_dim = int(rng.choice([8, 16, 64, 128]))
        yield kvlab.ModelConfig(dim=n_heads * head_dim, hidden_dim=4 * n_heads * head_dim,
                                n_layers=int(rng.integers(1, 81)), n_heads=n_heads,
                                n_kv_heads=n_kv_heads, vocab_size=int(rng.integers(100, 60000)),
                                max_seq_len=8192)


def shape_text(config):
    return (f"{config.n_layers} layers, {config.n_heads} heads, {config.n_kv_heads} KV heads "
            f"x {config.head_dim}")


@points(1)
def test_bytes_per_token_worked_example(sub, rng):
    """Llama 2 7B in fp16: 512 KiB per token; and its shape at other depths and widths, drawn now"""
    got = sub.kv_bytes_per_token(32, 32, 128, 2)
    assert got == 524_288, f"32 layers x 32 KV heads x 128 x 2 bytes: expected 524,288, got {described(got)}"
    for _ in range(3):      # the worked example's arithmetic, not its answer
        n_layers, size = int(rng.integers(1, 81)), int(rng.choice([1, 2, 4]))
        got = sub.kv_bytes_per_token(n_layers, 32, 128, size)
        want = 2 * n_layers * 32 * 128 * size
        assert got == want, (f"Llama 2 7B's heads (32 KV heads x 128) with {n_layers} layers and "
                             f"{size}-byte values: expected {want:,}, got {described(got)}")


@points(1)
def test_bytes_per_token_counts_keys_and_values(sub, rng):
    """K and V of every layer and head: shapes drawn at grading time"""
    for _ in range(10):
        n_layers, n_kv_heads = int(rng.integers(1, 100)), int(rng.integers(1, 64))
        head_dim, size = int(rng.integers(1, 300)), int(rng.choice([1, 2, 4]))
        got = sub.kv_bytes_per_token(n_layers, n_kv_heads, head_dim, size)
        want = 2 * n_layers * n_kv_heads * head_dim * size
        assert got == want, (f"{n_layers} layers x {n_kv_heads} KV heads x {head_dim} x {size} "
                             f"bytes, for K and for V: expected {want:,}, got {described(got)}")


@points(2)
def test_cache_bytes_worked_example(sub, rng):
    """Llama 2 7B, fp16: 2 GiB for 4,096 tokens, 32 GiB for 16 requests; and other lengths, batches and formats, drawn now"""
    config = config_record(LLAMA2_7B)
    one = sub.kv_cache_bytes(config, 4096, 1, "fp16")
    assert one == 2 * GiB, f"one request of 4,096 tokens: expected {2 * GiB:,} B (2 GiB), got {described(one)}"
    sixteen = sub.kv_cache_bytes(config, 4096, 16, "fp16")
    assert sixteen == 32 * GiB, f"16 requests: expected {32 * GiB:,} B (32 GiB), got {described(sixteen)}"
    for dtype in rng.permutation(["fp16", "fp32", "int8"]):
        seq_len, batch = int(rng.integers(1, 8193)), int(rng.integers(1, 33))
        got = sub.kv_cache_bytes(config, seq_len, batch, str(dtype))
        want = kvlab.kv_cache_bytes(LLAMA2_7B, seq_len, batch, str(dtype))
        assert got == want, (f"Llama 2 7B, {dtype}, {batch} requests of {seq_len:,} tokens: "
                             f"expected {want:,} B, got {described(got)}")


@points(2)
def test_cache_bytes_gqa(sub, rng):
    """GQA caches only the KV heads: Llama 3 8B has 8 of them for 32 query heads (and 4, 2 or 1, drawn now)"""
    seq_len = int(rng.integers(1000, 9000))
    got = sub.kv_cache_bytes(config_record(LLAMA3_8B), seq_len, 1, "bf16")
    want = kvlab.kv_cache_bytes(LLAMA3_8B, seq_len, 1, "bf16")
    assert got == want, (f"Llama 3 8B (32 layers, 8 KV heads x 128), {seq_len:,} tokens in bf16: "
                         f"expected {want:,} B, got {described(got)}")
    n_kv_heads = int(rng.choice([4, 2, 1]))
    fewer = LLAMA3_8B.replace(n_kv_heads=n_kv_heads)
    got = sub.kv_cache_bytes(config_record(fewer), seq_len, 1, "bf16")
    want = kvlab.kv_cache_bytes(fewer, seq_len, 1, "bf16")
    assert got == want, (f"Llama 3 8B's shape with {n_kv_heads} KV head{'s' * (n_kv_heads > 1)} "
                         f"for its 32 query heads, {seq_len:,} tokens in bf16: expected {want:,} B, "
                         f"got {described(got)}")


@points(2)
def test_cache_bytes_every_shape_and_float_dtype(sub, rng):
    """fp32, fp16 and bf16 caches of MHA, GQA and MQA shapes"""
    for config in random_configs(rng, 20):
        for dtype in ("fp32", "fp16", "bf16"):
            seq_len, batch = int(rng.integers(1, 5000)), int(rng.integers(1, 9))
            got = sub.kv_cache_bytes(config_record(config), seq_len, batch, dtype)
            want = kvlab.kv_cache_bytes(config, seq_len, batch, dtype)
            assert got == want, (f"{shape_text(config)}, {seq_len} tokens x {batch} requests, "
                                 f"{dtype}: expected {want:,}, got {described(got)}")


@points(2)
def test_cache_bytes_int8_counts_its_scales(sub, rng):
    """int8: one byte per value plus a float32 scale per head row"""
    for config in random_configs(rng, 10):
        seq_len, batch = int(rng.integers(1, 3000)), int(rng.integers(1, 5))
        got = sub.kv_cache_bytes(config_record(config), seq_len, batch, "int8")
        want = kvlab.kv_cache_bytes(config, seq_len, batch, "int8")
        codes_only = 2 * config.n_layers * config.kv_dim * seq_len * batch
        hint = " (did you forget the scales?)" if got == codes_only else ""
        assert got == want, (f"{shape_text(config)}, {seq_len} tokens x {batch} requests, int8: "
                             f"expected {want:,}, got {described(got)}{hint}")


@points(1)
def test_cache_bytes_match_a_real_cache(sub, rng):
    """the formula equals what a real cache allocates: the bundled model's, and caches of shapes drawn now"""
    model = bundled_model()
    for dtype in ("fp32", "fp16", "int8"):
        positions = int(rng.integers(10, 500))
        cache = model.new_cache(positions, dtype)
        got = sub.kv_cache_bytes(config_record(model.config), positions, 1, dtype)
        assert got == cache.nbytes, (f"the bundled model's {dtype} cache of {positions} positions "
                                     f"allocates {cache.nbytes:,} B; your formula says {described(got)}")
    for config in random_configs(rng, 3):
        config = config.replace(n_layers=int(rng.integers(1, 9)))      # a cache small enough to make
        dtype, positions = str(rng.choice(["fp32", "fp16", "int8"])), int(rng.integers(10, 300))
        cache = kvlab.KVCache(config.n_layers, config.n_kv_heads, config.head_dim, positions,
                              key_format=dtype, value_format=dtype)
        got = sub.kv_cache_bytes(config_record(config), positions, 1, dtype)
        assert got == cache.nbytes, (f"a {dtype} cache of {positions} positions for {shape_text(config)} "
                                     f"allocates {cache.nbytes:,} B; your formula says {described(got)}")


@points(2)
def test_max_requests(sub, rng):
    """requests that fit next to the weights"""
    weights = LLAMA2_7B.n_params() * 2
    per_request = kvlab.kv_cache_bytes(LLAMA2_7B, 4096, 1, "fp16")
    cases = [(80 * 10**9, 4096, "fp16", "fp16"), (24 * GiB, 4096, "fp16", "fp16"),
             (80 * 10**9, 2048, "int8", "fp16"), (40 * 10**9, 1000, "fp32", "fp32"),
             (weights + per_request - 1, 4096, "fp16", "fp16"),
             (weights + per_request, 4096, "fp16", "fp16"), (10 * 10**9, 4096, "fp16", "fp16")]
    for _ in range(6):
        cases.append((int(rng.integers(10, 200)) * 10**9, int(rng.integers(100, 8000)),
                      str(rng.choice(["fp16", "int8", "fp32"])), str(rng.choice(["fp16", "fp32"]))))
    config = config_record(LLAMA2_7B)
    for memory, seq_len, dtype, weights_dtype in cases:
        got = sub.max_requests(config, memory, seq_len, dtype, weights_dtype)
        left = memory - LLAMA2_7B.n_params() * {"fp16": 2, "fp32": 4}[weights_dtype]
        want = max(0, left // kvlab.kv_cache_bytes(LLAMA2_7B, seq_len, 1, dtype))
        assert got == want, (f"Llama 2 7B, {memory:,} B of memory, {weights_dtype} weights, "
                             f"{dtype} caches of {seq_len} tokens: expected {want}, got {described(got)}")


@points(1)
def test_max_requests_returns_a_whole_number(sub, rng):
    """a fraction of a request does not run: the whole number of requests that fit"""
    memory = int(rng.integers(15, 60)) * GiB + int(rng.integers(1, GiB))
    got = whole_number(sub.max_requests(config_record(LLAMA2_7B), memory, 4096, "fp16", "fp16"),
                       "max_requests")
    left = memory - LLAMA2_7B.n_params() * 2
    want = max(0, left // kvlab.kv_cache_bytes(LLAMA2_7B, 4096, 1, "fp16"))
    assert got == want, (f"Llama 2 7B, {memory:,} B of memory, fp16 weights and caches of 4,096 "
                         f"tokens: {want} requests fit, you say {got}")


@points(2)
def test_measured_growth_matches_the_formula(sub, rng):
    """filling real caches grows resident memory by what they hold: a measurement, not a formula"""
    config = bundled_model().config
    seq_len, batch = int(rng.integers(192, 321)), int(rng.integers(16, 25))
    per_cache = kvlab.kv_cache_bytes(config, seq_len, 1, "fp32")
    extra = -(-int(per_cache * rng.uniform(0.4, 1.0)) // mmap.PAGESIZE) * mmap.PAGESIZE
    lent = LabModel(extra_bytes=extra)
    got = number(sub.measure_resident_growth(lent, seq_len, batch), "measure_resident_growth")
    filled = [c for c in lent.caches if c.filled]
    assert len(filled) >= batch, (
        f"measure_resident_growth(model, {seq_len}, {batch}) filled {len(filled)} of the "
        f"{len(lent.caches)} caches it made: the growth asked for is that of {batch} filled "
        f"caches living at once (make and fill each one, then measure)")
    held = lent.filled_bytes()
    assert got <= 1.25 * held + (2 << 20), (
        f"you report {got:,.0f} B, but the caches your function filled hold {held:,} B in "
        f"all: create the caches, fill them, and measure")
    want = batch * (per_cache + extra)
    assert abs(got - want) <= 0.1 * want, (
        f"{batch} fp32 caches of {seq_len} tokens, from the model the grader lends you (it "
        f"adds a block of memory of its own to every cache it fills, of a size chosen now), "
        f"take {want:,} B of resident memory once filled; you measured {got:,.0f} B. Fill every "
        f"cache (pages are only taken when written) and read resident memory before and "
        f"while they live.")
