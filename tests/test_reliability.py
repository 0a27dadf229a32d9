"""Leaks: thousands of models, caches, pools, engines and failed calls in one process leave
its memory where it was.

Every C object the binding makes (caches, pools, sequences, views, scratch of a forward
call) must be freed when Python lets go of it, on the error paths too. The soak below
makes and drops each kind of object thousands of times, then compares the process's
resident memory and Python's count of allocated blocks with a warmed-up baseline.
"""
from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import kvlab
from kvlab.loaders.gguf_writer import add_llama_config
from kvlab.measure import release_freed_memory, resident_bytes


def churn(model: kvlab.Model, rounds: int) -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]
    formats = [dict(), dict(dtype="int8"), dict(dtype="int4", window=3),
               dict(key_format="fp8", value_format="bf16")]
    for i in range(rounds):
        # a contiguous cache in some format, its views, and a failed call on it
        cache = model.new_cache(16, **formats[i % len(formats)])
        model.prefill(prompt, cache)
        model.decode(9, cache)
        _ = cache.key_codes, cache.value_scales, cache.dequantized()
        with pytest.raises(ValueError):
            model.prefill([model.config.vocab_size], cache)
        with pytest.raises(kvlab.CacheFullError):
            model.prefill(list(range(10)), cache)
        # a paged pool: sequences, a fork with copy-on-write, a prefix hit, a full pool
        pool = model.new_paged_pool(num_blocks=6, block_size=4, max_seqs=4)
        seq = pool.new_sequence()
        model.prefill(prompt + [8], seq)
        child = pool.fork(seq)
        model.decode(3, child)
        pool.free(seq)
        again = pool.new_sequence()
        pool.reuse_prefix(again, np.array(prompt + [8], dtype=np.int32))
        _ = pool.gather(child), pool.key_codes, pool.stats(), child.block_table
        with pytest.raises(kvlab.OutOfBlocks):
            model.prefill(list(range(40)), again)
        model.forward_batch([child, again], [[1], [2]])
        # the no-cache path, generation and a small engine run now and then
        model.forward(prompt, all_logits=(i % 2 == 0))
        if i % 25 == 0:
            kvlab.generate(model, prompt, max_new_tokens=5, dtype="int8")
            engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=8, block_size=4))
            engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=4, n=2, seed=i,
                                                            temperature=0.7))
            engine.run(progress=False)


def settled():
    gc.collect()
    release_freed_memory()
    return resident_bytes(), sys.getallocatedblocks()


def test_thousands_of_objects_leave_memory_flat():
    model = kvlab.load()
    churn(model, 100)                        # warm up: imports, caches, allocator arenas
    rss_before, blocks_before = settled()
    churn(model, 1500)
    rss_after, blocks_after = settled()
    # a leak of one 16-position cache (6 KiB) per round would be 9 MB; one Python object
    # per round 1,500 blocks
    assert rss_after - rss_before < 2 * 2**20, f"resident memory grew {rss_after - rss_before:,} B"
    assert blocks_after - blocks_before < 300, f"{blocks_after - blocks_before} Python blocks kept"


# ---- fuzzing the public API: a result or a clear exception, never a crash ----------------------

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from time_limit import time_limit  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

CLEAR_ERRORS = (ValueError, TypeError, IndexError, kvlab.KVLabError)
DTYPES = [np.float32, np.float32, np.float32, np.float64, np.int32, np.float16]


def odd_array(data, shape, dtype):
    """Usually the array a call wants; sometimes a wrong dtype, shape or memory order."""
    shape = list(shape)
    if data.draw(st.integers(0, 5)) == 0 and shape:
        shape[data.draw(st.integers(0, len(shape) - 1))] += data.draw(st.sampled_from([-1, 1, 3]))
        shape = [max(0, n) for n in shape]
    array = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal(shape)
    array = array.astype(data.draw(st.sampled_from(DTYPES)))
    if data.draw(st.integers(0, 6)) == 0 and array.ndim >= 2:
        array = np.swapaxes(array, 0, 1)          # not C-contiguous (and a changed shape)
    return array


class CacheAndPoolFuzz(RuleBasedStateMachine):
    """Random calls with random (often wrong) arguments on a cache and a pool of the
    bundled model's shape. Each call either works or raises one of the clear errors;
    whatever happens, the objects stay usable and their invariants hold."""

    model = None

    @initialize(fmt=st.sampled_from(["fp32", "fp16", "int8", "int4", "fp8"]),
                window=st.sampled_from([0, 0, 3]), block_size=st.sampled_from([1, 4, 16]))
    def make(self, fmt, window, block_size):
        if CacheAndPoolFuzz.model is None:
            CacheAndPoolFuzz.model = kvlab.load()
        self.cache = self.model.new_cache(24, fmt, window=window)
        self.pool = self.model.new_paged_pool(num_blocks=10, block_size=block_size, dtype=fmt,
                                              max_seqs=4, window=window)
        self.seqs = [self.pool.new_sequence()]
        self.length = 0

    def attempt(self, call):
        """(True, result) if the call worked, (False, None) if it raised a clear error;
        anything else (another exception, a crash) fails the test."""
        try:
            return True, call()
        except CLEAR_ERRORS:
            return False, None

    # the invariant checks that the cache's length moved exactly as the calls that
    # worked say: a failed call must change nothing
    @rule(tokens=st.lists(st.integers(-3, 300), min_size=0, max_size=12))
    def prefill(self, tokens):
        if self.attempt(lambda: self.model.prefill(tokens, self.cache))[0]:
            self.length += len(tokens)

    @rule(data=st.data(), n=st.integers(0, 6))
    def append(self, data, n):
        c = self.model.config
        shape = (n, c.n_layers, c.n_kv_heads, c.head_dim)
        keys, values = odd_array(data, shape, np.float32), odd_array(data, shape, np.float32)
        if self.attempt(lambda: self.cache.append(keys, values))[0]:
            self.length += len(keys)

    @rule(n=st.integers(-2, 30))
    def truncate(self, n):
        if self.attempt(lambda: self.cache.truncate(n))[0]:
            self.length = n

    @rule(data=st.data())
    def attend(self, data):
        q = odd_array(data, (self.model.config.n_heads, self.model.config.head_dim), np.float32)
        layer = data.draw(st.integers(-1, self.model.config.n_layers))
        worked, out = self.attempt(lambda: self.cache.attend(q, layer))
        assert not worked or np.all(np.isfinite(out))

    @rule()
    def look(self):
        self.attempt(lambda: self.cache.dequantized())
        self.attempt(lambda: self.cache.keys)
        _ = self.cache.key_codes, self.cache.value_scales, repr(self.cache)

    @rule(which=st.integers(0, 3), tokens=st.lists(st.integers(-1, 260), max_size=9))
    def pool_prefill(self, which, tokens):
        seq = self.seqs[which % len(self.seqs)]
        self.attempt(lambda: self.model.prefill(tokens, seq))

    @rule(which=st.integers(0, 3), action=st.sampled_from(["fork", "free", "new", "reuse"]))
    def pool_action(self, which, action):
        seq = self.seqs[which % len(self.seqs)]
        if action == "fork":
            worked, child = self.attempt(lambda: self.pool.fork(seq))
            if worked:
                self.seqs.append(child)
        elif action == "free" and len(self.seqs) > 1:
            self.attempt(lambda: self.pool.free(seq))
            self.seqs.remove(seq)
        elif action == "new":
            worked, fresh = self.attempt(self.pool.new_sequence)
            if worked:
                self.seqs.append(fresh)
        else:
            self.attempt(lambda: self.pool.reuse_prefix(seq, np.arange(8, dtype=np.int32)))

    @rule(data=st.data())
    def batch(self, data):
        live = [s for s in self.seqs if s.alive]
        chosen = data.draw(st.lists(st.sampled_from(live), max_size=3)) if live else []
        chunks = [data.draw(st.lists(st.integers(-1, 260), max_size=4)) for _ in chosen]
        self.attempt(lambda: self.model.forward_batch(chosen, chunks))

    @invariant()
    def consistent(self):
        if hasattr(self, "cache"):
            assert self.cache.length == self.length
            self.pool.check()


CacheAndPoolFuzz.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                              deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestCacheAndPoolFuzz = CacheAndPoolFuzz.TestCase


# ---- fuzzing the loaders: a mutated checkpoint loads or is refused, never crashes ---------------

import functools  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

from hypothesis import given  # noqa: E402

from kvlab.loaders import load_checkpoint, save_hf_llama, save_llama2c_v1  # noqa: E402

LOAD_ERRORS = (kvlab.CheckpointError, kvlab.WeightsError, kvlab.ConfigError,
               kvlab.TokenizerError)
SMALL = kvlab.ModelConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=2, n_kv_heads=1,
                          vocab_size=20, max_seq_len=8)


def mutate(data: bytes, kind: str, position: int, value: int) -> bytes:
    if kind == "truncate":
        return data[:position % (len(data) + 1)]
    if kind == "append":
        return data + bytes([value % 256]) * (1 + position % 300)
    if kind == "byte":                                 # any byte, often a header field
        at = position % min(len(data), 64 if value % 2 else len(data))
        return data[:at] + bytes([value % 256]) + data[at + 1:]
    if kind == "int32":                                # a header integer set to anything
        at = 4 * (position % 16)
        return data[:at] + struct.pack("<i", value) + data[at + 4:]
    # "float": a weight becomes NaN or infinity
    at = len(data) - 4 * (1 + position % 200)
    return data[:at] + struct.pack("<f", [float("nan"), float("inf")][value % 2]) + data[at + 4:]


def assert_loads_or_refuses(path):
    tracemalloc.start()
    try:
        with time_limit(10):
            config, weights, _ = load_checkpoint(path)
    except LOAD_ERRORS:
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # never an absurd allocation from a header's numbers (the weights are mapped)
        assert peak < 64 * 2**20, f"loading allocated {peak:,} bytes"
    # what loads is well formed (a mutated byte inside a weight can still make a huge but
    # finite number: the file cannot tell, and the model simply runs on it)
    weights.check(config)
    weights.check_finite()
    model = kvlab.Model(config, weights)
    assert model.forward([0, 1]).shape == (config.vocab_size,)


@settings(max_examples=120, deadline=None)
@given(kind=st.sampled_from(["truncate", "append", "byte", "int32", "float"]),
       position=st.integers(0, 10**6), value=st.integers(-2**31, 2**31 - 1))
def test_mutated_llama2c_checkpoints(tmp_path_factory, kind, position, value):
    folder = tmp_path_factory.mktemp("llama2c")
    good = folder / "good.bin"
    save_llama2c_v1(good, SMALL, kvlab.Weights.random(SMALL))
    bad = folder / "bad.bin"
    bad.write_bytes(mutate(good.read_bytes(), kind, position, value))
    assert_loads_or_refuses(bad)


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(["truncate", "append", "byte", "int32", "float"]),
       position=st.integers(0, 10**6), value=st.integers(-2**31, 2**31 - 1))
def test_mutated_safetensors_checkpoints(tmp_path_factory, kind, position, value):
    folder = tmp_path_factory.mktemp("hf")
    save_hf_llama(folder, SMALL, kvlab.Weights.random(SMALL))
    tensors = folder / "model.safetensors"
    data = tensors.read_bytes()
    if kind in ("byte", "int32"):      # aim at the 8-byte header length and the JSON header
        position %= 8 + struct.unpack("<Q", data[:8])[0]
    tensors.write_bytes(mutate(data, kind, position, value))
    assert_loads_or_refuses(folder)


# GGUF: a tiny llama model written with the gguf package, as llama.cpp's converter lays one
# out (metadata, an embedded SentencePiece vocabulary, F32 norms, F16 matrices). Besides the
# mutations above, "field" sets one integer of the header (a count, a string or array length,
# a value type, a tensor's dims, type or offset, the alignment, the magic, the version, ...)
# to an absurd value: those are the numbers a reader must not trust.
GGUF_SMALL = SMALL.replace(tied_embeddings=False)
# <unk> <s> </s>, then SentencePiece's space "\u2581", 14 letters and two merges
GGUF_TOKENS = (["<unk>", "<s>", "</s>", "\u2581"] + [chr(ord("a") + i) for i in range(14)]
               + ["\u2581a", "ab"])
ABSURD = [0, 1, 2, 3, 5, 31, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
          2**62, 2**63 - 1, 2**63, 2**64 - 1]


def write_small_gguf(path, config: kvlab.ModelConfig, weights: kvlab.Weights) -> None:
    """A llama GGUF file of `config` and `weights`, with the GGUF_TOKENS vocabulary."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(32)    # the default, written out so that it can be mutated
    writer.add_name("small")
    add_llama_config(writer, config)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_scores([-float(i) for i in range(len(GGUF_TOKENS))])
    writer.add_token_types([2, 3, 3] + [1] * (len(GGUF_TOKENS) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", weights.token_embedding)
    writer.add_tensor("output_norm.weight", weights.final_norm)
    writer.add_tensor("output.weight", weights.classifier.astype(np.float16))
    for i in range(config.n_layers):
        for key, name in [("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"),
                          ("wv", "attn_v"), ("wo", "attn_output"), ("ffn_norm", "ffn_norm"),
                          ("w1", "ffn_gate"), ("w2", "ffn_down"), ("w3", "ffn_up")]:
            array = getattr(weights, key)[i]
            writer.add_tensor(f"blk.{i}.{name}.weight",
                              array if array.ndim == 1 else array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_header_integers(path):
    """{name: (offset, size)} of every integer and float in a GGUF file's header. Names:
    "magic", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"; for a metadata key K,
    "K:key length", "K:type", then "K" (a scalar's value), or "K:length" (a string's), or
    "K:item type", "K:length" and "K[i]" or "K[i]:length" (an array's); for a tensor T,
    "T:name length", "T:n_dims", "T:dims[i]", "T:type", "T:offset". (gguf's reader maps the
    file, so each part it parses is a view into it, whose address gives its offset.)"""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part, i=0):
        return part.ctypes.data - base + i * part.dtype.itemsize, part.dtype.itemsize

    places = {"magic": (0, 4)}
    for key, field in reader.fields.items():
        parts, kind = field.parts, field.types[0]
        if key.startswith("GGUF."):                   # the reader's names for the counts
            places[key] = at(parts[0])
            continue
        places[f"{key}:key length"], places[f"{key}:type"] = at(parts[0]), at(parts[2])
        if kind == gguf.GGUFValueType.ARRAY:
            places[f"{key}:item type"], places[f"{key}:length"] = at(parts[3]), at(parts[4])
            if field.types[-1] == gguf.GGUFValueType.STRING:   # (length, bytes) per item
                places.update({f"{key}[{i}]:length": at(part)
                               for i, part in enumerate(parts[5::2])})
            else:
                places.update({f"{key}[{i}]": at(part) for i, part in enumerate(parts[5:])})
        elif kind == gguf.GGUFValueType.STRING:
            places[f"{key}:length"] = at(parts[3])
        else:
            places[key] = at(parts[3])
    for tensor in reader.tensors:
        name_length, _, n_dims, dims, kind, offset = tensor.field.parts
        places.update({f"{tensor.name}:name length": at(name_length),
                       f"{tensor.name}:n_dims": at(n_dims), f"{tensor.name}:type": at(kind),
                       f"{tensor.name}:offset": at(offset)})
        places.update({f"{tensor.name}:dims[{i}]": at(dims, i) for i in range(dims.size)})
    return places, reader.data_offset


@functools.lru_cache(maxsize=None)
def small_gguf():
    """The good file's bytes, where its header integers are and where its header ends."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "small.gguf"
        write_small_gguf(path, GGUF_SMALL, kvlab.Weights.random(GGUF_SMALL))
        places, header_end = gguf_header_integers(path)
        return path.read_bytes(), places, header_end


def set_gguf_integer(data: bytes, place, value: int) -> bytes:
    at, size = place
    return data[:at] + (value % 2**(8 * size)).to_bytes(size, "little") + data[at + size:]


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["truncate", "append", "byte", "field", "field", "float"]),
       position=st.integers(0, 10**6), value=st.integers(-2**31, 2**31 - 1),
       # small numbers are other value and tensor types (and plausible counts and sizes)
       absurd=st.one_of(st.integers(0, 40), st.sampled_from(ABSURD), st.integers(0, 2**64 - 1)))
def test_mutated_gguf_checkpoints(tmp_path_factory, kind, position, value, absurd):
    data, places, header_end = small_gguf()
    if kind == "field":
        data = set_gguf_integer(data, list(places.values())[position % len(places)], absurd)
    else:
        if kind == "byte":             # aim at the header (metadata and tensor infos)
            position %= header_end
        data = mutate(data, kind, position, value)
    bad = tmp_path_factory.mktemp("gguf") / "bad.gguf"
    bad.write_bytes(data)
    assert_loads_or_refuses(bad)


def test_small_gguf_loads_as_written(tmp_path):
    """The fuzzer's starting point is a good file: it loads, with its own vocabulary."""
    data, _, _ = small_gguf()
    (tmp_path / "small.gguf").write_bytes(data)
    config, weights, tokenizer = load_checkpoint(tmp_path / "small.gguf")
    assert config.replace(name="") == GGUF_SMALL
    written = kvlab.Weights.random(GGUF_SMALL)
    assert np.array_equal(weights.wq, written.wq.astype(np.float16).astype(np.float32))
    assert np.array_equal(weights.final_norm, written.final_norm)
    assert tokenizer.vocab_size == len(GGUF_TOKENS) and tokenizer.encode("a b") == [1, 18, 3, 5]


# Each found by the fuzzer (or by aiming it at the field) in the loader as it was, with what
# it did then: (header fields and the values they are set to, or a function of the value
# there, what the error must name).
GGUF_REGRESSIONS = {
    # a string value re-read as an array: its length (from the string's bytes) runs past the
    # end, and gguf's reader then loops for ever over empty reads, growing a list
    "hang: string becomes an array": ({"tokenizer.ggml.model:type": 9},
                                      "'tokenizer.ggml.model'.*file ends"),
    "hang: array length past the end": ({"tokenizer.ggml.scores:item type": 0,
                                         "tokenizer.ggml.scores:length": 2**63},
                                        "'tokenizer.ggml.scores'.*file ends"),
    # np.empty((n_layers, ...)) before any tensor was looked at: 128 GiB, then MemoryError
    "128 GiB: block_count": ({"llama.block_count": 2**31 - 1}, "'llama.block_count'.*1..4096"),
    "256 GiB: feed_forward_length": ({"llama.feed_forward_length": 2**31},
                                     "'llama.feed_forward_length'"),
    # loaded, but no model could be built from it (the core refuses a context over 2**30)
    "loads unusable: context_length": ({"llama.context_length": 2**31 - 1},
                                       "'llama.context_length'"),
    # Tensor offsets that read other bytes than the tensor's own, silently: gguf adds the
    # offset to the data start in uint64, so one near 2**64 wraps around to the bytes before;
    # a smaller one reads the previous tensor's; a misaligned one shifts the values.
    "wrong weights: offset wraps": ({"token_embd.weight:offset": 2**64 - 32},
                                    "'token_embd.weight' has data offset .*, expected 0"),
    "wrong weights: overlap": ({"blk.0.attn_q.weight:offset": lambda old: old - 64},
                               "'blk.0.attn_q.weight' has data offset .*, expected"),
    "wrong weights: misaligned offset": ({"output.weight:offset": lambda old: old + 4},
                                         "'output.weight' has data offset .*, expected"),
    # a token id stored as a float NaN: int(nan) raised a bare ValueError
    "ValueError: NaN token id": ({"tokenizer.ggml.bos_token_id:type": 6,
                                 "tokenizer.ggml.bos_token_id": 0x7FC00000},
                                "bos_token_id is nan, expected an integer"),
    # refused before, but by an error that did not say what was wrong: "tensor ... has shape
    # [0, 0, 39307540692993, 24, 16]" (5 dims, ggml has at most 4), and "not a readable GGUF
    # file (ValueError: cannot reshape array of size 0 ...)" (dims whose product wraps to 0)
    "5 dims": ({"blk.1.ffn_up.weight:n_dims": 5}, "'blk.1.ffn_up.weight' has 5 dims"),
    "dims overflow uint64": ({"token_embd.weight:dims[0]": 2**32,
                              "token_embd.weight:dims[1]": 2**32},
                             "'token_embd.weight'.*past the end"),
}


@pytest.mark.parametrize("case", list(GGUF_REGRESSIONS))
def test_gguf_regressions(tmp_path, case):
    changes, message = GGUF_REGRESSIONS[case]
    data, places, _ = small_gguf()
    for name, value in changes.items():
        at, size = places[name]
        old = int.from_bytes(data[at:at + size], "little")
        data = set_gguf_integer(data, places[name], value(old) if callable(value) else value)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(kvlab.CheckpointError, match=message):
        with time_limit(10):
            load_checkpoint(tmp_path / "bad.gguf")
    assert_loads_or_refuses(tmp_path / "bad.gguf")


class EngineFuzz(RuleBasedStateMachine):
    """Requests with random (often impossible) prompts and parameters arrive between steps
    of an engine on a small pool: add_request accepts or refuses them with a clear error;
    step() never fails; the pool stays consistent; whatever finished is well formed."""

    model = None

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]),
                budget=st.integers(1, 40), fmt=st.sampled_from(["fp32", "int8"]))
    def make(self, num_blocks, block_size, budget, fmt):
        if EngineFuzz.model is None:
            EngineFuzz.model = kvlab.load()
        self.pool = self.model.new_paged_pool(num_blocks, block_size, dtype=fmt, max_seqs=6)
        self.engine = kvlab.Engine(self.model, self.pool, max_batch_tokens=budget)
        self.accepted = {}

    @rule(prompt=st.one_of(st.lists(st.integers(-2, 258), max_size=40),
                           st.text(max_size=20), st.lists(st.floats(0, 5), max_size=3)),
          max_tokens=st.integers(-1, 30), n=st.integers(0, 4),
          temperature=st.sampled_from([0.0, 0.0, 0.7, -1.0]), seed=st.integers(0, 9))
    def add(self, prompt, max_tokens, n, temperature, seed):
        try:
            params = kvlab.SamplingParams(max_new_tokens=max_tokens, n=n, temperature=temperature,
                                          seed=seed)
            rid = self.engine.add_request(prompt, params)
        except (ValueError, TypeError):
            return
        self.accepted[rid] = params

    @rule(steps=st.integers(1, 5))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    @invariant()
    def consistent(self):
        if not hasattr(self, "engine"):
            return
        self.pool.check()
        for rid, out in self.engine.outputs.items():
            params = self.accepted[rid]
            assert len(out.outputs) == params.n
            for sample in out.outputs:
                tokens = sample.tokens
                assert len(tokens) <= params.max_new_tokens
                assert all(0 <= t < self.model.config.vocab_size for t in tokens)

    def teardown(self):
        if hasattr(self, "engine"):           # and everything accepted can finish
            for _ in range(2000):
                if not self.engine.has_work:
                    break
                self.engine.step()
            assert not self.engine.has_work, "the engine did not finish (deadlock?)"
            assert len(self.engine.outputs) == len(self.accepted)
            assert self.pool.stats().blocks_used == 0


EngineFuzz.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestEngineFuzz = EngineFuzz.TestCase
