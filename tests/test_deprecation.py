"""Old names keep working for one release, each with a warning that names its replacement
(kvlab/deprecation.py), and the one "too long" error is raised everywhere a request can be
too long. pyproject.toml turns these warnings into errors elsewhere in the suite, so no part
of the kit itself still uses an old name."""
import numpy as np
import pytest

import kvlab
from kvlab import SamplingParams


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def test_generate_cache_dtype_is_now_dtype(model):
    want = kvlab.generate(model, [1, 2, 3], 6, dtype="int8").tokens
    with pytest.warns(DeprecationWarning, match=r"generate\(cache_dtype=...\) is deprecated.*"
                                                r"use generate\(dtype=...\)"):
        assert kvlab.generate(model, [1, 2, 3], 6, cache_dtype="int8").tokens == want


def test_sampling_params_max_tokens_is_now_max_new_tokens():
    with pytest.warns(DeprecationWarning, match=r"SamplingParams\(max_tokens=...\)"):
        old = SamplingParams(max_tokens=7, temperature=0.5)
    assert old == SamplingParams(max_new_tokens=7, temperature=0.5)
    with pytest.warns(DeprecationWarning, match=r"SamplingParams.max_tokens is deprecated"):
        assert old.max_tokens == 7
    with pytest.raises(TypeError, match="max_tokens is its old name"):
        SamplingParams(max_new_tokens=7, max_tokens=7)
    assert SamplingParams().max_new_tokens == 16 and SamplingParams(5).max_new_tokens == 5


def test_forward_with_all_logits_second_still_means_all_logits(model):
    tokens = [5, 6, 7, 8]
    want = model.forward(tokens, all_logits=True)
    with pytest.warns(DeprecationWarning, match=r"all_logits second"):
        got = model.forward(tokens, True)
    np.testing.assert_array_equal(got, want)


def test_forward_is_the_one_entry_and_prefill_and_decode_are_its_names(model):
    tokens = [9, 10, 11, 12, 13]
    a, b = model.new_cache(16), model.new_cache(16)
    np.testing.assert_array_equal(model.forward(tokens[:4], a), model.prefill(tokens[:4], b))
    np.testing.assert_array_equal(model.forward([tokens[4]], a), model.decode(tokens[4], b))
    np.testing.assert_array_equal(a.keys, b.keys)
    # with a cache the new tokens continue it; without one they are the whole sequence
    np.testing.assert_array_equal(model.forward(tokens), model.forward(tokens, None))
    np.testing.assert_array_equal(model.forward(tokens, all_logits=True)[-1],
                                  model.forward(tokens))


def test_request_outputs_old_shape_reads_with_a_warning(model):
    engine = kvlab.Engine(model, num_blocks=16)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, n=2, temperature=0.7,
                                                       seed=3))
    out = engine.run(progress=False)[rid]
    tokens = [o.tokens for o in out.outputs]
    with pytest.warns(DeprecationWarning, match=r"RequestOutput.texts"):
        assert out.texts == [o.completion for o in out.outputs]
    with pytest.warns(DeprecationWarning, match=r"RequestOutput.finish_reasons"):
        assert out.finish_reasons == ["length", "length"]
    with pytest.warns(DeprecationWarning, match=r"outputs\[i\] as a token list.*outputs\[i\].tokens"):
        assert out.outputs[0] == tokens[0]
    with pytest.warns(DeprecationWarning):
        assert list(out.outputs[1]) == tokens[1] and len(out.outputs[1]) == 4
    with pytest.warns(DeprecationWarning):
        assert out.outputs[1][0] == tokens[1][0]


def test_too_long_is_one_error_from_generate_the_engine_and_forward(model):
    context = model.config.max_seq_len
    with pytest.raises(kvlab.ContextLengthError, match=r"prompt \(500 tokens\) \+ "
                                                       r"max_new_tokens \(13\) exceeds"):
        kvlab.generate(model, [1] * 500, 13)
    engine = kvlab.Engine(model, num_blocks=64)
    with pytest.raises(kvlab.ContextLengthError, match=r"request rejected: prompt \(500 tokens\) "
                                                       r"\+ max_new_tokens \(13\) exceeds"):
        engine.add_request([1] * 500, SamplingParams(max_new_tokens=13))
    with pytest.raises(kvlab.ContextLengthError, match=f"exceed the model's context of {context}"):
        model.forward([1] * (context + 1))
    # code that caught what each raised before still catches it
    assert issubclass(kvlab.ContextLengthError, kvlab.CacheFullError)
    assert issubclass(kvlab.ContextLengthError, ValueError)
    assert not engine.has_work


def test_engine_makes_its_own_pool_or_takes_one_not_both(model):
    engine = kvlab.Engine(model, num_blocks=12, block_size=4, dtype="int8")
    assert (engine.pool.num_blocks, engine.pool.block_size, engine.pool.key_format) == (12, 4, "int8")
    with pytest.raises(TypeError, match="not both"):
        kvlab.Engine(model, model.new_paged_pool(8), num_blocks=8)
    with pytest.raises(TypeError, match="needs a pool, or num_blocks"):
        kvlab.Engine(model)


def test_old_and_new_names_together_are_refused_not_merged(model):
    with pytest.raises(TypeError, match="give dtype only"):
        kvlab.generate(model, [1, 2], 3, dtype="fp16", cache_dtype="int8")


def test_a_sampling_params_pickled_with_the_old_name_keeps_its_length_limit():
    import pickle
    params = SamplingParams(max_new_tokens=5, temperature=0.5)
    state = dict(params.__dict__)
    state["max_tokens"] = state.pop("max_new_tokens")    # as the previous release pickled it
    restored = SamplingParams.__new__(SamplingParams)
    restored.__setstate__(state)
    assert restored == params and restored.max_new_tokens == 5
    assert pickle.loads(pickle.dumps(params)) == params


def test_key_dtype_and_value_dtype_are_now_key_format_and_value_format(model):
    """Issue 36: a cache's parts are spelled as formats, as KVCache(key_format=) always was
    and as the chapters say; the old names read and make the same thing, with a warning
    pointing at the caller's line, however deep in kvlab the argument is read."""
    new = dict(key_format="int8", value_format="int4", group=8)
    old = dict(key_dtype="int8", value_dtype="int4", group=8)
    want = model.cache_format(**new)
    makers = [model.cache_format, lambda **o: kvlab.measure.cache_format(model.config, **o),
              lambda **o: model.new_cache(16, **o).nbytes,
              lambda **o: model.new_paged_pool(4, 4, **o).nbytes,
              lambda **o: kvlab.kv_bytes_per_token(model.config, **o),
              lambda **o: kvlab.generate(model, [1, 2, 3], 4, **o).tokens]
    for make in makers:
        expected = make(**new)
        with pytest.warns(DeprecationWarning) as caught:
            assert make(**old) == expected
        assert sorted(str(w.message) for w in caught) == [
            f"the cache-format argument {side}_dtype=... is deprecated and goes in the next "
            f"release: use {side}_format=..." for side in ("key", "value")]
        assert {w.filename for w in caught} == {__file__}       # the caller's line, not kvlab's
    assert model.cache_format(**new) == want
    with pytest.raises(TypeError, match=r"give key_format only \(key_dtype is its old name\)"):
        model.new_cache(16, key_format="int8", key_dtype="int8")

    cache, pool = model.new_cache(8, **new), model.new_paged_pool(4, 4, **new)
    for thing, name in [(cache, "KVCache"), (pool, "PagedPool")]:
        assert (thing.key_format, thing.value_format) == ("int8", "int4")
        with pytest.warns(DeprecationWarning, match=rf"{name}\.key_dtype is deprecated.*"
                                                    rf"use {name}\.key_format") as caught:
            assert thing.key_dtype == "int8"
        assert caught[0].filename == __file__
        with pytest.warns(DeprecationWarning, match=rf"{name}\.value_dtype is deprecated"):
            assert thing.value_dtype == "int4"
    assert "key_format=int8, value_format=int4" in repr(cache)
