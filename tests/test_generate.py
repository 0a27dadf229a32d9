"""kvlab.generate: the cache is exact (same tokens with and without it), sampling, errors."""
import dataclasses
import sys

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


@pytest.mark.parametrize("use_cache, fast", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("progress", [False, True])
def test_greedy_generation_stops_at_eos_without_keeping_it(model, use_cache, fast, progress):
    """Greedy over a cache runs its token loop in C (Model.decode_steps), in chunks when a
    progress bar shows; the Python loop (no cache) must stop at the same place."""
    run = kvlab.generate(model, [1, 2, 3], max_new_tokens=40, stop_at_eos=False).tokens
    eos = run[25]
    stopping = kvlab.Model(model.config, model.weights, tokenizer=_StopAt(eos))
    out = kvlab.generate(stopping, [1, 2, 3], max_new_tokens=40, use_cache=use_cache,
                         progress=progress, fast=fast)
    assert out.tokens == run[:run.index(eos)]
    assert out.finish_reason == "eos"            # as the Engine's RequestOutput says it
    full = kvlab.generate(model, [1, 2, 3], max_new_tokens=40, use_cache=use_cache, fast=fast)
    assert full.finish_reason == "length" and len(full.tokens) == 40
    assert len(out.step_seconds) == len(out.tokens) + 1     # the step that chose EOS counts
    assert out.counts.calls == len(out.step_seconds)


def test_greedy_generation_with_a_progress_bar_gives_the_same_tokens(model):
    quiet = kvlab.generate(model, [7, 8], max_new_tokens=50)
    shown = kvlab.generate(model, [7, 8], max_new_tokens=50, progress=True)
    assert quiet.tokens == shown.tokens and len(shown.step_seconds) == 50
    assert quiet.counts.flops == shown.counts.flops


@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.8), (12, 0.95)])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_the_c_sampler_agrees_with_the_numpy_reference(temperature, top_k, top_p):
    """kvlab.sampling.sample (the C core's kv_sample, which the generation loop in C calls)
    against kvlab.reference.sample, the same steps in NumPy, for the same random number."""
    from kvlab import reference

    class Draw:   # a generator whose next number is u
        def random(self):
            return u

    rng = np.random.default_rng(int(temperature * 10) + (top_k or 0))
    for _ in range(300):
        logits = (rng.standard_normal(50) * 3).astype(np.float32)
        logits[rng.integers(0, 50, 5)] = logits.max()          # ties at the top
        u = rng.random()
        assert sample(logits, temperature, top_k, top_p, Draw()) == \
            reference.sample(logits, temperature, top_k, top_p, u)


def test_sample_takes_float_logits_as_float32_and_refuses_nan():
    with pytest.raises(ValueError, match="not numbers"):
        sample(np.array([0.0, np.nan, 1.0], dtype=np.float32), 1.0, rng=np.random.default_rng(0))
    assert sample(np.array([0.0, 2.0, 1.0], dtype=np.float32)) == 1    # greedy: the arg-max
    # other number types are taken as float32, as the model's logits are
    as_float64 = sample(np.array([0.0, 2.0, 1.0]), 1.0, rng=np.random.default_rng(4))
    assert as_float64 == sample(np.array([0.0, 2.0, 1.0], np.float32), 1.0,
                                rng=np.random.default_rng(4))
    with pytest.raises(ValueError):
        sample(np.zeros((2, 3), np.float32), 1.0, rng=np.random.default_rng(0))


def test_sampled_generation_draws_one_number_per_step_on_every_path(model):
    """With a cache the C loop draws the tokens; without one Python does, with the same
    numbers from the same seed: the same tokens, with and without a progress bar."""
    kwargs = dict(max_new_tokens=40, temperature=0.9, top_k=20, top_p=0.9, seed=3)
    cached = kvlab.generate(model, [5, 6], **kwargs).tokens
    assert cached == kvlab.generate(model, [5, 6], use_cache=False, **kwargs).tokens
    assert cached == kvlab.generate(model, [5, 6], progress=True, **kwargs).tokens
    assert cached != kvlab.generate(model, [5, 6], max_new_tokens=40).tokens   # it sampled


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3}])
def test_the_loop_as_written_and_the_c_loop_give_the_same_generation(model, sampling):
    """generate(fast=False) runs the loop the chapter shows; the default runs its decode
    steps in C: the same tokens, greedy or seeded sampling, with or without a progress bar."""
    plain = kvlab.generate(model, [5, 6], max_new_tokens=40, fast=False, **sampling)
    assert plain.tokens == kvlab.generate(model, [5, 6], max_new_tokens=40, **sampling).tokens
    assert plain.tokens == kvlab.generate(model, [5, 6], max_new_tokens=40, progress=True,
                                          **sampling).tokens
    assert len(plain.step_seconds) == 40


def test_the_c_loop_takes_from_rng_exactly_the_numbers_its_steps_use(model):
    """decode_steps over a KVCache draws its numbers ahead in C; over a paged sequence it
    steps in Python, one number per step. After a stop token ends both early, both have
    taken the same numbers: the next draw is the same."""
    stop = None
    for seed in range(20):              # a seed whose run stops early on some token
        probe = model.new_cache(40)
        first = int(np.argmax(model.prefill([1, 2, 3], probe)))
        picks, _ = model.decode_steps(first, probe, 30, temperature=1.0,
                                      rng=np.random.default_rng(seed))
        if len(set(picks.tolist())) > 3:
            stop, at = int(picks[5]), seed
            break
    assert stop is not None
    results = []
    for cache in (model.new_cache(40), model.new_paged_pool(num_blocks=16, block_size=4).new_sequence()):
        rng = np.random.default_rng(at)
        first = int(np.argmax(model.prefill([1, 2, 3], cache)))
        picks, _ = model.decode_steps(first, cache, 30, temperature=1.0, rng=rng, stop_token=stop)
        results.append((picks.tolist(), rng.random()))
    assert results[0] == results[1]
    assert results[0][0][-1] == stop and len(results[0][0]) <= 6


def test_sampling_params_and_their_shorthand_generate_the_same(model):
    """generate takes a kvlab.SamplingParams as the Engine does; temperature=, seed= and the
    other sampling keywords are its shorthand: the same tokens, drawn from the same numbers."""
    shorthand = dict(max_new_tokens=30, temperature=0.9, top_k=20, top_p=0.9, seed=3,
                     stop_at_eos=False)
    params = kvlab.SamplingParams(**shorthand)
    for way in ({}, {"fast": False}, {"use_cache": False}):
        want = kvlab.generate(model, [5, 6], **shorthand, **way)
        got = kvlab.generate(model, [5, 6], params=params, **way)
        assert got.tokens == want.tokens and len(got.tokens) == 30
    assert kvlab.generate(model, [5, 6], params=kvlab.SamplingParams(max_new_tokens=7)).tokens \
        == kvlab.generate(model, [5, 6], 7).tokens


def test_sampling_params_and_a_shorthand_together_are_refused(model):
    params = kvlab.SamplingParams(max_new_tokens=5, temperature=0.5, seed=1)
    with pytest.raises(TypeError, match=r"params or its shorthand \(temperature\), not both"):
        kvlab.generate(model, [1, 2], params=params, temperature=0.7)
    with pytest.raises(TypeError, match=r"max_new_tokens"):
        kvlab.generate(model, [1, 2], 9, params=params)
    with pytest.raises(TypeError, match="kvlab.SamplingParams"):
        kvlab.generate(model, [1, 2], params={"temperature": 0.5})
    with pytest.raises(ValueError, match="one sequence"):
        kvlab.generate(model, [1, 2], params=kvlab.SamplingParams(max_new_tokens=5, n=2))


def test_the_shorthand_defaults_are_generates_defaults():
    """Leaving a sampling keyword out is what lets params= stand alone: the table generate
    compares against must say what its signature says."""
    import inspect
    from kvlab.generate import SHORTHAND_DEFAULTS, generate
    signature = inspect.signature(generate).parameters
    assert {name: signature[name].default for name in SHORTHAND_DEFAULTS} == SHORTHAND_DEFAULTS
    fields = {field.name for field in dataclasses.fields(kvlab.SamplingParams)}
    assert set(SHORTHAND_DEFAULTS) <= fields


@pytest.mark.parametrize("kwargs, way", [
    ({}, "CachedInC"), ({"fast": False}, "Cached"), ({"use_cache": False}, "Uncached"),
    ({"cache_policy": kvlab.cache_policy.SlidingWindow(8)}, "WithCachePolicy"),
    ({"cache_policy": kvlab.cache_policy.SlidingWindow(64)}, "CachedInC"),   # never drops a row
    ({"speculate": kvlab.speculative.PromptLookup()}, "Speculative"),
])
def test_generate_chooses_its_way_of_running_steps_before_the_loop(model, kwargs, way,
                                                                  monkeypatch):
    """The loop is one loop; which Steps class runs each step follows from the arguments."""
    module = sys.modules["kvlab.generate"]        # kvlab.generate is the function
    chosen = []
    original = module._choose_steps

    def spy(*args, **kw):
        chosen.append(original(*args, **kw))
        return chosen[-1]
    monkeypatch.setattr(module, "_choose_steps", spy)
    out = kvlab.generate(model, [1, 2, 3], 20, **kwargs)
    assert [type(steps).__name__ for steps in chosen] == [way]
    assert (out.speculation is not None) == (way == "Speculative")


@pytest.mark.parametrize("keyword, hint", [("max_tokens", "the length is max_new_tokens"),
                                           ("n", "kvlab.Engine's"), ("top_K", "")])
def test_an_unknown_keyword_is_named_as_generates_not_a_cache_formats(model, keyword, hint):
    # **cache_options took every other keyword and Model.cache_format refused it in its
    # own name, as if the student had asked for a cache format
    with pytest.raises(TypeError, match=rf"generate\(\) got an unexpected keyword argument "
                                        rf"'{keyword}'.*{hint}"):
        kvlab.generate(model, [1, 2, 3], 5, **{keyword: 2})
    assert kvlab.generate(model, [1, 2, 3], 5, key_format="int8").tokens    # options still work
