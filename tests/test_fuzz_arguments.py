"""The Python API's arguments (issue 35, items 1-4): token ids and integer, flag and float
arguments of kvlab.generate, Model, Engine, Scheduler, SamplingParams, sampling, PagedPool,
ModelConfig, kvlab.measure and kvlab.chat, checked by kvlab.arguments.

Cases tried, and what each now gives (before: what it gave):
- token ids given as floats (1.0), bools (True), strings ('1'), arrays of floats, to
  generate, Model.forward/prefill/decode/decode_text, Engine.add_request,
  PagedPool.reuse_prefix: ArgumentTypeError (a TypeError and a ValueError) naming the id
  and its index. Before: generate ran [1.0, 2.0], [True, 5] and ['1'] as [1, 2], [1, 5] and
  [1] (int()); add_request and forward ran [True, 5] as [1, 5] (np.asarray); decode_text
  read True as byte 1. An id too large for any integer (2**70) is a ValueError (out of
  range), not "an array of object".
- every integer argument (max_new_tokens, max_steps, top_k, seed, draft_tokens, stop_token,
  max_seq_len, num_blocks, block_size, max_seqs, max_blocks_per_seq, max_batch_tokens,
  max_batch_seqs, swap_space, n, Chat's max_seq_len and max_new_tokens, PagedPool.truncate's
  length, reserve/blocks_needed's n_tokens, reuse_prefix's max_tokens, ModelConfig's sizes
  and sliding_window, kvlab.measure's counts) given True, 2.0, 2.5, '3', -1, 0, 2**31,
  2**63, 10**30: TypeError/ValueError naming the argument. Before: 2**31, 2**63 and 10**30
  gave OverflowError in C's words ("signed integer is greater than maximum", "Python int
  too large to convert to C long") for max_seq_len, num_blocks, block_size, max_seqs,
  max_blocks_per_seq, max_steps, top_k, truncate, reuse_prefix; max_blocks_per_seq took
  True, 2.0, 2.5, '3' and 0 silently; seed and stop_token took True, 2.0 and '3' (or failed
  in NumPy's words); SamplingParams(seed=True/2.0/'3') was accepted;
  ModelConfig(max_seq_len=10**30) was accepted; kv_cache_bytes(config, 10**30) computed.
- flags (use_cache, stop_at_eos, fast, progress, all_logits, prefix_cache,
  add_generation_prompt, SamplingParams.stop_at_eos) given 0, 1, 'yes', None: TypeError.
- floats: temperature and top_p given True or '0.5' (before: True ran as 1.0; '0.5' failed
  comparing str and float), NaN, infinities: ValueError/TypeError naming them;
  arrival_time -inf (before: accepted, every latency infinite) and NaN: ValueError.
- decode_steps(max_steps=2**31-1) with sampling over a cache of 8 positions: draws no more
  numbers than steps can run (before: asked NumPy for 16 GiB of them).
The hypothesis tests below draw such values for every argument and hold each call to
"works, or TypeError/ValueError, and the object it was called on is unchanged and usable"."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import arguments, measure
from kvlab.chat import Chat
from kvlab.engine import Engine
from kvlab.generate import generate
from kvlab.scheduler import SamplingParams, Scheduler
from kvlab.speculative import PromptLookup
from kvlab.tokenizer import ByteTokenizer

HUGE = [2**31, 2**63, 10**30]
NOT_INTEGERS = [True, np.bool_(False), 2.0, 2.5, "3", math.nan]
BAD_SIZES = NOT_INTEGERS + HUGE + [-1, 0]


class TemplatedBytes(ByteTokenizer):
    chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}A:{% endif %}")
    eos_id = 10


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def chat_model():
    m = kvlab.load()
    m.tokenizer = TemplatedBytes()
    return m


def refused(call, name=None):
    """The call raises a TypeError or ValueError (naming `name`), never OverflowError."""
    with pytest.raises((TypeError, ValueError)) as error:
        call()
    assert not isinstance(error.value, OverflowError)
    if name is not None:
        assert name in str(error.value), str(error.value)
    return error.value


# ---- the finding: token ids ---------------------------------------------------------------

@pytest.mark.parametrize("ids", [[1.0, 2.0], [True, 5], [5, np.bool_(True)], ["1"],
                                 np.array([1.0]), [1, 2.5], (3, "a")])
def test_token_ids_that_are_not_integers_are_refused_everywhere(model, ids):
    """generate converted them with int(); forward and add_request took [True, 5]."""
    for call in (lambda: generate(model, ids, 2), lambda: model.forward(ids),
                 lambda: model.prefill(ids, model.new_cache(8)),
                 lambda: Engine(model, num_blocks=8).add_request(ids),
                 lambda: model.decode_text(ids)):
        error = refused(call, "token id")
        assert isinstance(error, TypeError) and isinstance(error, ValueError)


def test_token_ids_too_large_for_any_integer_are_out_of_range(model):
    for call in (lambda: generate(model, [1, 2**70], 2), lambda: model.forward([2**70]),
                 lambda: Engine(model, num_blocks=8).add_request([1, 10**30])):
        assert "out of range" in str(refused(call))


def test_a_paged_prefix_lookup_refuses_bools_among_ids(model):
    pool = model.new_paged_pool(8, 4)
    seq = pool.new_sequence()
    refused(lambda: pool.reuse_prefix(seq, [True, 1, 2, 3]), "token id")
    assert pool.reuse_prefix(seq, [1, 2, 3, 4]) == 0


# ---- integers: type, range, C's sizes -----------------------------------------------------

@pytest.mark.parametrize("value", BAD_SIZES)
@pytest.mark.parametrize("name, call", [
    ("max_new_tokens", lambda m, v: generate(m, [1, 2], v)),
    ("max_seq_len", lambda m, v: m.new_cache(v)),
    ("num_blocks", lambda m, v: m.new_paged_pool(v)),
    ("block_size", lambda m, v: m.new_paged_pool(4, v)),
    ("max_seqs", lambda m, v: m.new_paged_pool(4, 16, max_seqs=v)),
    ("max_blocks_per_seq", lambda m, v: m.new_paged_pool(4, 16, max_blocks_per_seq=v)),
    ("max_steps", lambda m, v: m.decode_steps(1, m.new_cache(8), v)),
    ("top_k", lambda m, v: generate(m, [1], 2, temperature=1.0, top_k=v)),
    ("draft_tokens", lambda m, v: generate(m, [1], 2, speculate=PromptLookup(), draft_tokens=v)),
    ("n", lambda m, v: SamplingParams(n=v)),
    ("max_new_tokens", lambda m, v: SamplingParams(max_new_tokens=v)),
    ("max_batch_tokens", lambda m, v: Engine(m, num_blocks=8, max_batch_tokens=v)),
    ("max_batch_seqs", lambda m, v: Engine(m, num_blocks=8, max_batch_seqs=v)),
    ("num_blocks", lambda m, v: Engine(m, num_blocks=v)),
    ("block_size", lambda m, v: Engine(m, num_blocks=8, block_size=v)),
    ("draft_tokens", lambda m, v: Engine(m, num_blocks=8, speculate=PromptLookup(), draft_tokens=v)),
    ("block_size", lambda m, v: Scheduler(v)),
    ("max_seq_len", lambda m, v: m.config.replace(max_seq_len=v)),
    ("dim", lambda m, v: m.config.replace(dim=v)),
    ("vocab_size", lambda m, v: m.config.replace(vocab_size=v)),
    ("sliding_window", lambda m, v: m.config.replace(sliding_window=v)),
    ("n_tokens", lambda m, v: measure.forward_counts(m.config, v)),
    ("n_threads", lambda m, v: measure.scratch_bytes(m.config, 4, v)),
    ("new_tokens", lambda m, v: measure.generation_counts(m.config, 4, v)),
    ("repeats", lambda m, v: measure.memory_bandwidth(1 << 20, v)),
    ("context", lambda m, v: measure.measure_memory(m, v)),
])
def test_every_size_refuses_bools_floats_strings_and_sizes_c_cannot_hold(model, name, call, value):
    """Before: 2**31, 2**63 and 10**30 were OverflowErrors in C's words for the sizes that
    reach C; max_blocks_per_seq took anything; ModelConfig took sizes past a C int."""
    refused(lambda: call(model, value), name)


@pytest.mark.parametrize("value", NOT_INTEGERS + [2**63, 10**30, -1, 0])
def test_a_swap_space_is_a_byte_count_of_an_int64(model, value):
    refused(lambda: Engine(model, num_blocks=8, preemption="swap", swap_space=value), "swap_space")


@pytest.mark.parametrize("value", NOT_INTEGERS + [2**63, 10**30, -2])
def test_counts_of_a_pool_and_the_stop_token_are_checked_as_integers(model, value):
    pool = model.new_paged_pool(8, 4)
    seq = pool.new_sequence()
    model.prefill([1, 2, 3], seq)
    refused(lambda: pool.truncate(seq, value), "length")
    refused(lambda: pool.blocks_needed(seq, value), "n_tokens")
    refused(lambda: pool.reserve(seq, value), "n_tokens")
    refused(lambda: pool.reuse_prefix(pool.new_sequence(), [1, 2, 3, 4], value), "max_tokens")
    refused(lambda: model.decode_steps(1, model.new_cache(8), 2, stop_token=value), "stop_token")
    assert seq.length == 3
    pool.check()


@pytest.mark.parametrize("value", [True, 2.0, "3", -1])
def test_a_seed_is_an_integer_of_at_least_0(model, value):
    refused(lambda: generate(model, [1], 2, temperature=1.0, seed=value), "seed")
    refused(lambda: SamplingParams(seed=value), "seed")


@pytest.mark.parametrize("value", BAD_SIZES)
def test_a_chat_checks_its_sizes(chat_model, value):
    refused(lambda: Chat(chat_model, max_seq_len=value), "max_seq_len")
    chat = Chat(chat_model, max_seq_len=64)
    refused(lambda: chat.send("hi", max_new_tokens=value), "max_new_tokens")
    assert chat.messages == [] and chat.cache.length == 0


@pytest.mark.parametrize("name, call", [
    ("use_cache", lambda m, v: generate(m, [1], 2, use_cache=v)),
    ("stop_at_eos", lambda m, v: generate(m, [1], 2, stop_at_eos=v)),
    ("fast", lambda m, v: generate(m, [1], 2, fast=v)),
    ("all_logits", lambda m, v: m.forward([1, 2], all_logits=v)),
    ("prefix_cache", lambda m, v: m.new_paged_pool(4, prefix_cache=v)),
    ("stop_at_eos", lambda m, v: SamplingParams(stop_at_eos=v)),
])
@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_flags_are_true_or_false(model, name, call, value):
    refused(lambda: call(model, value), name)


# ---- floats -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "0.5", -1.0])
def test_temperature_and_top_p_refuse_nan_infinities_bools_and_strings(model, value):
    refused(lambda: generate(model, [1], 2, temperature=value), "temperature")
    refused(lambda: generate(model, [1], 2, temperature=1.0, top_p=value), "top_p")
    refused(lambda: kvlab.sampling.sample(np.zeros(4, np.float32), value), "temperature")
    refused(lambda: SamplingParams(temperature=value), "temperature")


@pytest.mark.parametrize("value", [-math.inf, math.nan, math.inf, True, "0"])
def test_an_arrival_time_is_a_finite_time(model, value):
    """Before: -inf was accepted (its latencies infinite)."""
    engine = Engine(model, num_blocks=8)
    refused(lambda: engine.add_request([1, 2], arrival_time=value), "arrival_time")
    assert engine.requests == {} and not engine.has_work


def test_many_decode_steps_over_a_small_cache_draw_no_more_numbers_than_can_run(model):
    """Before: rng.random(2**31 - 1) before the first step: 16 GiB."""
    cache = model.new_cache(8)
    rng = np.random.default_rng(0)
    with pytest.raises(kvlab.CacheFullError):        # as for any max_steps past its room
        model.decode_steps(1, cache, arguments.C_INT_MAX, 1.0, rng=rng)
    assert cache.length == 0


# ---- the fuzzer ---------------------------------------------------------------------------

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

bad_numbers = st.one_of(st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
                        st.text(max_size=3), st.none(),
                        st.integers(-2**70, 2**70),
                        st.sampled_from(HUGE + [-1, 0, 2**31 - 1, -2**63]),
                        st.just(np.float32(1.0)), st.just(np.int64(3)), st.just([1]))
# values for arguments that allocate or loop by their size: anything but a large valid one
small_or_bad = st.one_of(st.integers(-4, 48), bad_numbers.filter(
    lambda v: not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 48 < v < 2**31)))
token_lists = st.lists(st.one_of(st.integers(-3, 300), st.booleans(), st.floats(-1, 300),
                                 st.text(max_size=1), st.integers(2**31, 2**70)),
                       min_size=0, max_size=6)


def works_or_refused(call):
    """The call works or raises TypeError/ValueError (kvlab's own errors are ValueErrors);
    an OverflowError, MemoryError, or any other error fails the test."""
    try:
        return call()
    except OverflowError:
        raise
    except (TypeError, ValueError):
        return None


def model_state(model):
    return (model.config, model.weights.nbytes, model.counters)


GENERATE_ARGUMENTS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "use_cache",
                      "stop_at_eos", "fast", "draft_tokens", "progress"]


@FUZZ
@given(name=st.sampled_from(GENERATE_ARGUMENTS), value=small_or_bad)
def test_fuzz_generate_arguments(model, name, value):
    kwargs = {"temperature": 1.0} if name in ("top_k", "top_p") else {}
    if name == "draft_tokens":
        kwargs["speculate"] = PromptLookup()
    config = model.config
    works_or_refused(lambda: generate(model, [1, 2], **{"max_new_tokens": 3, **kwargs,
                                                        name: value}))
    assert model.config == config
    assert len(generate(model, [1, 2], 3).tokens) == 3          # usable


@FUZZ
@given(ids=token_lists)
def test_fuzz_token_ids(model, ids):
    """Only lists of in-range Python or NumPy integers (not bools) run, everywhere alike."""
    valid = all(type(t) is int and 0 <= t < model.config.vocab_size for t in ids)
    assert (works_or_refused(lambda: model.decode_text(ids)) is not None) == valid
    valid = valid and bool(ids)                      # text may be empty, a prompt not
    results = [works_or_refused(lambda: generate(model, ids, 1)),
               works_or_refused(lambda: model.forward(ids))]
    engine = Engine(model, num_blocks=8)
    results.append(works_or_refused(lambda: engine.add_request(ids, SamplingParams(max_new_tokens=1))))
    assert all((r is not None) == valid for r in results), (ids, results)
    engine.run(progress=False)
    assert not engine.has_work


POOL_CALLS = {
    "truncate": lambda pool, seq, v: pool.truncate(seq, v),
    "blocks_needed": lambda pool, seq, v: pool.blocks_needed(seq, v),
    "reuse_prefix": lambda pool, seq, v: pool.reuse_prefix(pool.empty, [1, 2, 3, 4, 5], v),
    "decode_steps": lambda pool, seq, v: pool.model.decode_steps(1, seq, v),
    "stop_token": lambda pool, seq, v: pool.model.decode_steps(1, seq, 1, stop_token=v),
    "top_k": lambda pool, seq, v: pool.model.decode_steps(1, seq, 1, 1.0, top_k=v),
    "top_p": lambda pool, seq, v: pool.model.decode_steps(1, seq, 1, 1.0, top_p=v),
    "temperature": lambda pool, seq, v: pool.model.decode_steps(1, seq, 1, v),
    "decode": lambda pool, seq, v: pool.model.decode(v, seq),
}


@FUZZ
@given(name=st.sampled_from(sorted(POOL_CALLS)), value=small_or_bad)
def test_fuzz_paged_pool_and_decoding_arguments(model, name, value):
    """A refused call leaves the pool's books and the sequence as they were."""
    pool = model.new_paged_pool(16, 4)
    pool.model, pool.empty = model, pool.new_sequence()
    seq = pool.new_sequence()
    model.prefill([1, 2, 3, 4, 5, 6], seq)
    before = (pool.stats(), seq.length, list(seq.block_table))
    if works_or_refused(lambda: POOL_CALLS[name](pool, seq, value)) is None:
        assert (pool.stats(), seq.length, list(seq.block_table)) == before
    pool.check()
    model.decode(1, pool.new_sequence())                       # usable


ENGINE_ARGUMENTS = ["max_batch_tokens", "max_batch_seqs", "num_blocks", "block_size",
                    "draft_tokens", "swap_space"]


@FUZZ
@given(name=st.sampled_from(ENGINE_ARGUMENTS), value=small_or_bad)
def test_fuzz_engine_construction(model, name, value):
    kwargs = {"num_blocks": 8}
    if name == "draft_tokens":
        kwargs["speculate"] = PromptLookup()
    if name == "swap_space":
        kwargs["preemption"] = "swap"
    engine = works_or_refused(lambda: Engine(model, **{**kwargs, name: value}))
    if engine is not None:
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        engine.run(progress=False)


PARAMS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop_at_eos"]


@FUZZ
@given(name=st.sampled_from(PARAMS), value=small_or_bad, arrival=st.one_of(st.none(), bad_numbers))
def test_fuzz_requests(model, name, value, arrival):
    """A refused request leaves the engine's requests and queues as they were."""
    engine = Engine(model, num_blocks=16, block_size=4)
    params = works_or_refused(lambda: SamplingParams(**{name: value}))
    if params is None:
        return
    if isinstance(arrival, float) and math.isfinite(arrival):
        arrival = min(arrival, 0.0)
    rid = works_or_refused(lambda: engine.add_request([1, 2, 3], params, arrival_time=arrival))
    if rid is None:
        assert engine.requests == {} and not engine.has_work
    engine.add_request([4, 5], SamplingParams(max_new_tokens=2))
    engine.run(progress=False)


CONFIG_FIELDS = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                 "max_seq_len", "head_dim", "sliding_window", "norm_eps", "rope_theta",
                 "rope_interleaved", "tied_embeddings"]


@FUZZ
@given(name=st.sampled_from(CONFIG_FIELDS), value=bad_numbers)
def test_fuzz_model_config_fields(model, name, value):
    config = works_or_refused(lambda: model.config.replace(**{name: value}))
    if config is not None:
        assert getattr(config, name) <= arguments.C_INT_MAX or name in ("norm_eps", "rope_theta")


MEASURE_CALLS = {
    "kv_cache_bytes": lambda c, v: measure.kv_cache_bytes(c, v, dtype="fp32"),
    "kv_cache_bytes batch": lambda c, v: measure.kv_cache_bytes(c, 8, v, dtype="fp32"),
    "forward_counts": lambda c, v: measure.forward_counts(c, 4, v),
    "scratch_bytes": lambda c, v: measure.scratch_bytes(c, v),
    "per_token_saving": lambda c, v: measure.per_token_saving(c, v),
    "chunk_length": lambda c, v: measure.chunk_length(c, v, 4),
    "generation_counts": lambda c, v: measure.generation_counts(c, 4, v),
}


@FUZZ
@given(name=st.sampled_from(sorted(MEASURE_CALLS)), value=small_or_bad)
def test_fuzz_measure_arguments(model, name, value):
    works_or_refused(lambda: MEASURE_CALLS[name](model.config, value))


@FUZZ
@given(name=st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p", "seed"]),
       value=small_or_bad)
def test_fuzz_chat_turns(chat_model, name, value):
    """A refused turn leaves the conversation and its cache as they were."""
    chat = Chat(chat_model, max_seq_len=128)
    chat.send("hi", max_new_tokens=2)
    before = (list(chat.messages), list(chat.tokens), chat.cache.length)
    kwargs = {"temperature": 1.0} if name in ("top_k", "top_p") else {}
    if works_or_refused(lambda: chat.send("yo", **{"max_new_tokens": 2, **kwargs, name: value})) is None:
        assert (list(chat.messages), list(chat.tokens), chat.cache.length) == before
    chat.send("ok", max_new_tokens=1)
