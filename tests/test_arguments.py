"""kvlab/arguments.py: the one argument-checking layer of the Python API."""
import math
import re

import numpy as np
import pytest

from kvlab import arguments as a


@pytest.mark.parametrize("value", [True, np.bool_(False), 2.0, 2.5, "3", None, [1], np.float32(1)])
def test_an_integer_argument_refuses_what_is_not_an_integer(value):
    with pytest.raises(TypeError, match="n_blocks must be an integer") as error:
        a.integer(value, "n_blocks")
    assert isinstance(error.value, ValueError)          # except ValueError still catches it


@pytest.mark.parametrize("value, says", [(0, "at least 1"), (-5, "at least 1"),
                                         (2**31, "at most 2,147,483,647"),
                                         (10**30, "at most 2,147,483,647")])
def test_an_integer_out_of_range_or_too_large_for_c_is_a_value_error(value, says):
    with pytest.raises(ValueError, match=says):
        a.positive(value, "max_seqs")


def test_integers_come_back_as_python_ints():
    assert type(a.integer(np.int64(7), "n")) is int and a.count(0, "n") == 0
    assert a.integer(-3, "offset", low=None) == -3


@pytest.mark.parametrize("value, says", [(math.nan, "finite"), (math.inf, "finite"),
                                         (-math.inf, "finite"), (True, "must be a number"),
                                         ("0.5", "must be a number"), (-1.0, "at least 0")])
def test_a_real_argument_refuses_nan_infinities_and_non_numbers(value, says):
    with pytest.raises(ValueError, match=says):
        a.real(value, "rate", low=0.0)


def test_real_arguments_with_open_bounds_and_infinity_where_it_makes_sense():
    assert a.real(np.float32(0.5), "p", above=0.0, high=1.0) == 0.5
    with pytest.raises(ValueError, match="more than 0.0"):
        a.real(0, "temperature", above=0.0)
    assert a.real(math.inf, "deadline", finite=False) == math.inf
    with pytest.raises(ValueError, match="finite"):
        a.real(math.nan, "deadline", finite=False)                # NaN never


def test_a_flag_is_a_truth_value():
    assert a.flag(np.bool_(True), "all_logits") is True
    for value in (1, 0, "yes", None):
        with pytest.raises(TypeError, match="all_logits must be True or False"):
            a.flag(value, "all_logits")


def test_thread_counts_and_tokenizer_ids_refuse_bools_too():
    import kvlab
    with pytest.raises(TypeError, match="n must be an integer"):
        kvlab.set_num_threads(True)
    with pytest.raises(ValueError, match="at most 2,147,483,647"):
        kvlab.set_num_threads(2**63)                    # was an OverflowError in C's words
    with pytest.raises(kvlab.TokenizerError, match="must be an integer"):
        kvlab.load().tokenizer.decode([True])           # operator.index took True as 1


@pytest.mark.parametrize("value, error, says", [
    (True, TypeError, "n must be an integer, got True"), (2.0, TypeError, "got 2.0 (float)"),
    ("2", TypeError, "got '2'"), (2**63, ValueError, "beyond any length"),
    (-2**70, ValueError, "beyond any length"), (5, ValueError, "between 0 and the current length 4")])
def test_a_caches_truncate_names_a_bad_length_in_python_words(value, error, says):
    """cache.truncate is the C class's own method: True used to cut to 1, 2**63 to raise an
    OverflowError in C's words."""
    import kvlab
    model = kvlab.load()
    cache = model.new_cache(16)
    model.prefill([1, 2, 3, 4], cache)
    with pytest.raises(error, match=re.escape(says)):
        cache.truncate(value)
    assert cache.length == 4
    cache.truncate(np.int64(2))
    assert cache.length == 2


@pytest.mark.parametrize("arguments, error, says", [
    ((True, 2, 16, 8), TypeError, "n_layers must be an integer, got True"),
    ((2, 2, 16, 2.0), TypeError, "capacity must be an integer, got 2.0"),
    ((2, 2, "16", 8), TypeError, "head_dim must be an integer"),
    ((2, 2, 16, 2**31), ValueError, "capacity must be at most 2147483647"),
    ((2, 2, 16, 2**63), ValueError, "capacity is 9223372036854775808, beyond any length")])
def test_the_c_classes_name_a_bad_size_too(arguments, error, says):
    """kvlab.KVCache and kvlab.PagedPool made directly (their C constructors): a size given
    as True used to be 1, one past a C int an OverflowError in C's words."""
    import kvlab
    with pytest.raises(error, match=re.escape(says)):
        kvlab.KVCache(*arguments)
    with pytest.raises(TypeError, match="window must be an integer"):
        kvlab.KVCache(2, 2, 16, 8, window=True)
    assert kvlab.KVCache(2, 2, 16, np.int64(8)).capacity == 8


def test_a_decode_loop_refused_by_a_full_cache_draws_no_number():
    """A failed call changes nothing: the C loop refuses a full cache before its first step,
    so the generator is where it was (it used to move one draw on)."""
    import kvlab
    model = kvlab.load()
    cache = model.new_cache(4)
    model.prefill([1, 2, 3, 4], cache)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    with pytest.raises(kvlab.CacheFullError):
        model.decode_steps(5, cache, 3, temperature=0.8, rng=rng)
    assert rng.bit_generator.state == state and cache.length == 4
