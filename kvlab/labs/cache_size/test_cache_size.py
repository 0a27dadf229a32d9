"""Grader for lab 2 (cache size). Each test says in its message what it expected.

The answers are checked against kvlab's own cache arithmetic (kvlab.kv_cache_bytes), the
bytes a real cache allocates (cache.nbytes), and the course's worked example.
"""
import numpy as np
import pytest

import kvlab

GiB = 1024 ** 3
LLAMA2_7B = kvlab.ModelConfig.llama2_7b()
LLAMA3_8B = kvlab.ModelConfig.llama3_8b()


def random_configs(n=25, seed=1):
    """Shapes of every kind: MHA, GQA and MQA, small and large."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        n_kv_heads = int(rng.choice([1, 2, 4, 8]))
        n_heads = n_kv_heads * int(rng.choice([1, 2, 4]))
        head_dim = int(rng.choice([8, 16, 64, 128]))
        yield kvlab.ModelConfig(dim=n_heads * head_dim, hidden_dim=4 * n_heads * head_dim,
                                n_layers=int(rng.integers(1, 81)), n_heads=n_heads,
                                n_kv_heads=n_kv_heads, vocab_size=int(rng.integers(100, 60000)),
                                max_seq_len=8192)


@pytest.mark.points(1)
def test_bytes_per_token_worked_example(submission):
    """Llama 2 7B in fp16: 512 KiB per token"""
    got = submission.kv_bytes_per_token(32, 32, 128, 2)
    assert got == 524_288, f"32 layers x 32 KV heads x 128 x 2 bytes: expected 524,288, got {got!r}"


@pytest.mark.points(1)
def test_bytes_per_token_counts_keys_and_values(submission):
    """one layer, one head of 1 value in fp32 is 8 bytes (K and V)"""
    got = submission.kv_bytes_per_token(1, 1, 1, 4)
    assert got == 8, f"a K value and a V value of 4 bytes each: expected 8, got {got!r}"


@pytest.mark.points(2)
def test_cache_bytes_worked_example(submission):
    """Llama 2 7B, fp16: 2 GiB for 4,096 tokens, 32 GiB for 16 requests"""
    one = submission.kv_cache_bytes(LLAMA2_7B, 4096, 1, "fp16")
    assert one == 2 * GiB, f"one request of 4,096 tokens: expected {2 * GiB:,} B (2 GiB), got {one!r}"
    sixteen = submission.kv_cache_bytes(LLAMA2_7B, 4096, 16, "fp16")
    assert sixteen == 32 * GiB, f"16 requests: expected {32 * GiB:,} B (32 GiB), got {sixteen!r}"


@pytest.mark.points(2)
def test_cache_bytes_gqa(submission):
    """GQA caches only the KV heads: Llama 3 8B has 8 of them for 32 query heads"""
    got = submission.kv_cache_bytes(LLAMA3_8B, 8192, 1, "bf16")
    want = kvlab.kv_cache_bytes(LLAMA3_8B, 8192, 1, "bf16")
    assert got == want, (f"Llama 3 8B (32 layers, 8 KV heads x 128), 8,192 tokens in bf16: "
                         f"expected {want:,} B, got {got!r}")


@pytest.mark.points(2)
def test_cache_bytes_every_shape_and_float_dtype(submission):
    """fp32, fp16 and bf16 caches of MHA, GQA and MQA shapes"""
    for i, config in enumerate(random_configs()):
        for dtype in ("fp32", "fp16", "bf16"):
            seq_len, batch = 17 + 31 * i, 1 + i % 5
            got = submission.kv_cache_bytes(config, seq_len, batch, dtype)
            want = kvlab.kv_cache_bytes(config, seq_len, batch, dtype)
            assert got == want, (f"{config.n_layers} layers, {config.n_heads} heads, "
                                 f"{config.n_kv_heads} KV heads x {config.head_dim}, "
                                 f"{seq_len} tokens x {batch} requests, {dtype}: "
                                 f"expected {want:,}, got {got!r}")


@pytest.mark.points(2)
def test_cache_bytes_int8_counts_its_scales(submission):
    """int8: one byte per value plus a float32 scale per head row"""
    for config in random_configs(10, seed=2):
        got = submission.kv_cache_bytes(config, 100, 2, "int8")
        want = kvlab.kv_cache_bytes(config, 100, 2, "int8")
        codes_only = 2 * config.n_layers * config.kv_dim * 100 * 2
        hint = " (did you forget the scales?)" if got == codes_only else ""
        assert got == want, (f"{config.n_layers} layers, {config.n_kv_heads} KV heads x "
                             f"{config.head_dim}, 100 tokens x 2 requests, int8: "
                             f"expected {want:,}, got {got!r}{hint}")


@pytest.mark.points(1)
def test_cache_bytes_match_a_real_cache(submission):
    """the formula equals what model.new_cache allocates"""
    model = kvlab.load()
    for dtype in ("fp32", "fp16", "int8"):
        cache = model.new_cache(300, dtype)
        got = submission.kv_cache_bytes(model.config, 300, 1, dtype)
        assert got == cache.nbytes, (f"the bundled model's {dtype} cache of 300 positions "
                                     f"allocates {cache.nbytes:,} B; your formula says {got!r}")


@pytest.mark.points(2)
def test_max_requests(submission):
    """requests that fit next to the weights"""
    weights = LLAMA2_7B.n_params() * 2
    per_request = kvlab.kv_cache_bytes(LLAMA2_7B, 4096, 1, "fp16")
    cases = [(80 * 10**9, 4096, "fp16", "fp16"), (24 * GiB, 4096, "fp16", "fp16"),
             (80 * 10**9, 2048, "int8", "fp16"), (40 * 10**9, 1000, "fp32", "fp32"),
             (weights + per_request - 1, 4096, "fp16", "fp16"),
             (weights + per_request, 4096, "fp16", "fp16"), (10 * 10**9, 4096, "fp16", "fp16")]
    for memory, seq_len, dtype, weights_dtype in cases:
        got = submission.max_requests(LLAMA2_7B, memory, seq_len, dtype, weights_dtype)
        left = memory - LLAMA2_7B.n_params() * {"fp16": 2, "fp32": 4}[weights_dtype]
        want = max(0, left // kvlab.kv_cache_bytes(LLAMA2_7B, seq_len, 1, dtype))
        assert got == want, (f"Llama 2 7B, {memory:,} B of memory, {weights_dtype} weights, "
                             f"{dtype} caches of {seq_len} tokens: expected {want}, got {got!r}")


@pytest.mark.points(1)
def test_max_requests_returns_a_whole_number(submission):
    """a fraction of a request does not run"""
    got = submission.max_requests(LLAMA2_7B, 20 * GiB, 4096, "fp16", "fp16")
    assert isinstance(got, (int, np.integer)), f"expected a whole number of requests, got {got!r}"


@pytest.mark.points(2)
def test_measured_growth_matches_the_formula(submission):
    """filling 24 caches of 256 tokens grows resident memory by what the formula says"""
    model = kvlab.load()
    formula = kvlab.kv_cache_bytes(model.config, 256, 24, "fp32")
    got = submission.measure_resident_growth(model, 256, 24)
    assert isinstance(got, (int, np.integer, float)), f"expected a number of bytes, got {got!r}"
    assert abs(got - formula) <= 0.1 * formula, (
        f"24 fp32 caches of 256 tokens hold {formula:,} B; you measured {got:,} B. Fill every "
        f"cache (pages are only taken when written) and read resident memory while they live.")
