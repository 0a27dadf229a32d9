"""Cache-size arithmetic: the course's worked example, exactly, and real caches agree."""
import pytest

import kvlab
from kvlab.measure import kv_bytes_per_token, kv_cache_bytes, weights_bytes

GiB = 1024 ** 3


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
    assert kv_bytes_per_token(mha) == 8 * kv_bytes_per_token(big)


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


def test_bad_arguments():
    config = kvlab.ModelConfig.stories260k()
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_bytes(config, 10, dtype="fp64")
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(config, -1)
