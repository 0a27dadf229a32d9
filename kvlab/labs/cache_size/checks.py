"""Public self-checks for lab 3 (cache size): `kvlab check cache_size cache_size.py`.

The course's worked example, and a small measurement. The grade comes from hidden tests on
shapes drawn at grading time, and from a measurement on a model that adds memory of its own
to every cache it fills (a size chosen at grading time, so only a real measurement fits).
"""
import kvlab
from kvlab.grading.handouts import LabModel
from kvlab.grading.testkit import (bundled_model, config_record, described, number, points,
                                   whole_number)

GiB = 1024 ** 3


@points(1)
def test_bytes_per_token_worked_example(sub, rng):
    """Llama 2 7B in fp16: 2 x 32 layers x 32 KV heads x 128 x 2 B = 524,288 B per token"""
    got = sub.kv_bytes_per_token(32, 32, 128, 2)
    assert got == 524_288, f"expected 524,288, got {described(got)}"


@points(1)
def test_cache_bytes_worked_example(sub, rng):
    """Llama 2 7B, fp16, 4,096 tokens: 2 GiB"""
    got = sub.kv_cache_bytes(config_record(kvlab.ModelConfig.llama2_7b()), 4096, 1, "fp16")
    assert got == 2 * GiB, f"expected {2 * GiB:,} B (2 GiB), got {described(got)}"


@points(1)
def test_gqa_caches_only_the_kv_heads(sub, rng):
    """Llama 3 8B (32 query heads on 8 KV heads of 128), bf16, 8,192 tokens: 1 GiB"""
    config = kvlab.ModelConfig.llama3_8b()
    got = sub.kv_cache_bytes(config_record(config), 8192, 1, "bf16")
    want = kvlab.kv_cache_bytes(config, 8192, 1, "bf16")
    assert got == want, (f"expected {want:,} B, got {described(got)} (the cache holds the "
                         f"{config.n_kv_heads} KV heads, not the {config.n_heads} query heads)")


@points(1)
def test_requests_that_fit_in_80_gb(sub, rng):
    """Llama 2 7B (fp16 weights) in 80 GB: whole requests of 4,096 fp16 tokens"""
    config = kvlab.ModelConfig.llama2_7b()
    got = sub.max_requests(config_record(config), 80 * 10**9, 4096, "fp16", "fp16")
    want = (80 * 10**9 - 2 * config.n_params()) // (2 * GiB)
    assert whole_number(got, "max_requests") == want, (
        f"80,000,000,000 B of memory, {2 * config.n_params():,} B of fp16 weights, requests "
        f"of 4,096 tokens ({2 * GiB:,} B of fp16 cache each): expected {want}, got {described(got)}")


@points(1)
def test_a_small_measurement(sub, rng):
    """16 fp32 caches of 192 tokens of the bundled model, filled: within 20 % of the formula"""
    want = kvlab.kv_cache_bytes(bundled_model().config, 192, 16, "fp32")
    got = number(sub.measure_resident_growth(LabModel(), 192, 16),
                 "measure_resident_growth")
    assert abs(got - want) <= 0.2 * want, (
        f"16 caches of 192 tokens hold {want:,} B once filled; you measured {got:,.0f} B. Fill "
        f"every cache (pages are only taken when written) and read resident memory before and "
        f"while they live.")
