"""kvlab.generate: the cache is exact (same tokens with and without it), sampling, errors."""
import numpy as np
import pytest

import kvlab
from kvlab.sampling import sample


@pytest.fixture(scope="module")
def model():
    config = kvlab.ModelConfig(dim=48, hidden_dim=64, n_layers=2, n_heads=6, n_kv_heads=2,
                               vocab_size=40, max_seq_len=96)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=11, scale=0.3))


def test_cached_and_uncached_generation_give_identical_tokens(model):
    cached = kvlab.generate(model, [1, 2, 3], max_new_tokens=40, use_cache=True)
    uncached = kvlab.generate(model, [1, 2, 3], max_new_tokens=40, use_cache=False)
    assert cached.tokens == uncached.tokens
    assert len(cached.tokens) == 40
    assert cached.step_seconds.shape == (40,) and np.all(cached.step_seconds > 0)
    assert cached.cache_nbytes > 0 and uncached.cache_nbytes == 0


def test_sampling_is_reproducible_with_a_seed(model):
    a = kvlab.generate(model, [4], 30, temperature=1.0, top_k=10, seed=5)
    b = kvlab.generate(model, [4], 30, temperature=1.0, top_k=10, seed=5, use_cache=False)
    c = kvlab.generate(model, [4], 30, temperature=1.0, top_k=10, seed=6)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_sampler_filters():
    logits = np.array([0.0, 5.0, 4.0, -3.0, 4.5], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits) == 1
    assert {sample(logits, 1.0, top_k=2, rng=rng) for _ in range(200)} == {1, 4}
    assert {sample(logits, 1.0, top_p=0.01, rng=rng) for _ in range(50)} == {1}
    assert {sample(logits, 100.0, rng=rng) for _ in range(500)} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kwargs, error", [
    ({"max_new_tokens": 0}, ValueError),
    ({"temperature": -1.0}, ValueError),
    ({"top_k": 0}, ValueError),
    ({"top_p": 1.5}, ValueError),
    ({"max_new_tokens": 200}, kvlab.CacheFullError),
])
def test_bad_generation_arguments(model, kwargs, error):
    with pytest.raises(error):
        kvlab.generate(model, [1, 2], **{"max_new_tokens": 5, **kwargs})


def test_text_prompt_needs_a_tokenizer(model):
    with pytest.raises(kvlab.TokenizerError, match="without a tokenizer"):
        kvlab.generate(model, "hello", 3)


class _StopAt:
    """Just enough of a tokenizer for generate(): an end-of-sequence id, and text."""
    def __init__(self, eos_id):
        self.eos_id = eos_id

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("progress", [False, True])
def test_greedy_generation_stops_at_eos_without_keeping_it(model, use_cache, progress):
    """Greedy over a cache runs its token loop in C (Model.decode_greedy), in chunks when a
    progress bar shows; the Python loop (no cache) must stop at the same place."""
    run = kvlab.generate(model, [1, 2, 3], max_new_tokens=40, stop_at_eos=False).tokens
    eos = run[25]
    stopping = kvlab.Model(model.config, model.weights, tokenizer=_StopAt(eos))
    out = kvlab.generate(stopping, [1, 2, 3], max_new_tokens=40, use_cache=use_cache,
                         progress=progress)
    assert out.tokens == run[:run.index(eos)]
    assert len(out.step_seconds) == len(out.tokens) + 1     # the step that chose EOS counts
    assert out.counts.calls == len(out.step_seconds)


def test_greedy_generation_with_a_progress_bar_gives_the_same_tokens(model):
    quiet = kvlab.generate(model, [7, 8], max_new_tokens=50)
    shown = kvlab.generate(model, [7, 8], max_new_tokens=50, progress=True)
    assert quiet.tokens == shown.tokens and len(shown.step_seconds) == 50
    assert quiet.counts.flops == shown.counts.flops
