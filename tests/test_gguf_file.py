"""kvlab's GGUF reader (kvlab.loaders.gguf_file) against the gguf package's GGUFReader, the
oracle: the same metadata values, tensor names, types, dims and bytes on every GGUF file the
tests have (stories260K, SmolLM2 where it is cached or can be fetched, files of every tensor
type and every metadata value type written with gguf's GGUFWriter, big-endian ones); and
kvlab's reader's refusals of truncated and lying files: a CheckpointError naming the problem,
never another exception, a hang or an allocation the file's size does not bound.
(The fuzzers in test_reliability.py and test_fuzz_checkpoints.py mutate whole files through
kvlab.load; here the reader is taken on alone.)
"""
import math
import os
import tracemalloc

import numpy as np
import pytest

import kvlab
from gguf_files import write_llama_gguf
from kvlab.loaders.gguf_file import _GGML_TYPES, ggml_type, read_gguf
from kvlab.loaders.gguf_writer import add_llama_config
from kvlab.tokenizer import _gguf_value

gguf = pytest.importorskip("gguf")

CONFIG = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                           vocab_size=64, max_seq_len=64, name="tiny")


def same_value(ours, theirs) -> bool:
    """Equal, of the same Python type (a bool is not an int here), NaN equal to NaN."""
    if isinstance(theirs, list):
        return (isinstance(ours, list) and len(ours) == len(theirs)
                and all(same_value(a, b) for a, b in zip(ours, theirs)))
    if type(ours) is not type(theirs):
        return False
    if isinstance(theirs, float) and math.isnan(theirs):
        return math.isnan(ours)
    return ours == theirs


def assert_same_as_gguf(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]
    assert list(ours.values) == keys
    for key in keys:
        assert same_value(ours.value(key), _gguf_value(theirs, key)), key
    assert ours.value("no such key") is None
    assert ours.big_endian == (theirs.byte_order == "S")
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors):
        assert mine.ne == tuple(int(n) for n in other.shape), mine.name
        assert (mine.kind, mine.type_name) == (int(other.tensor_type), other.tensor_type.name)
        assert mine.n_bytes == int(other.n_bytes)
        data = np.asarray(other.data)
        assert mine.data.dtype == data.dtype and mine.data.shape == data.shape, mine.name
        assert mine.data.tobytes() == data.tobytes(), mine.name
        assert not mine.data.flags.writeable


def test_stories260k_reads_as_gguf_reads_it(shared_models):
    assert_same_as_gguf(shared_models / "stories260K" / "stories260K.gguf")


def test_smollm2_reads_as_gguf_reads_it(smollm2_path):
    """A real model's file: a vocabulary of 49,152 tokens and 48,900 merges, Q4_1 matrices."""
    assert_same_as_gguf(smollm2_path)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K",
                                  "Q6_K", "I8"])
def test_every_tensor_type_reads_as_gguf_reads_it(tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, CONFIG, kvlab.Weights.random(CONFIG), default=kind)
    assert_same_as_gguf(path)


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_a_big_endian_file_reads_as_gguf_reads_it(tmp_path, kind):
    path = tmp_path / "big.gguf"
    write_llama_gguf(path, CONFIG, kvlab.Weights.random(CONFIG), default=kind, big_endian=True)
    assert read_gguf(path).big_endian
    assert_same_as_gguf(path)


def every_value_type(path, big_endian=False):
    """A file with one value of every metadata type, arrays of each, a string that is not
    UTF-8, a float32 NaN and a general.alignment of 64, and two tensors."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    types = gguf.GGUFValueType
    scalars = {"uint8": (types.UINT8, 200), "int8": (types.INT8, -100),
               "uint16": (types.UINT16, 60000), "int16": (types.INT16, -30000),
               "uint32": (types.UINT32, 4_000_000_000), "int32": (types.INT32, -2_000_000_000),
               "float32": (types.FLOAT32, 1e-5), "bool": (types.BOOL, True),
               "uint64": (types.UINT64, 2**64 - 1), "int64": (types.INT64, -2**63),
               "float64": (types.FLOAT64, 0.1)}
    for name, (kind, value) in scalars.items():
        writer.add_key_value(f"test.{name}", value, kind)
        writer.add_key_value(f"test.{name}s", [value, value], types.ARRAY, sub_type=kind)
    writer.add_key_value("test.nan", float("nan"), types.FLOAT32)
    writer.add_key_value("test.strings", ["a", "", "émoji 🙂"], types.ARRAY,
                         sub_type=types.STRING)
    writer.add_key_value("test.not_utf8", "NOTUTF8", types.STRING)
    writer.add_uint32("general.alignment", 64)
    writer.add_tensor("first", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("second", np.arange(6, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data.replace(b"NOTUTF8", b"N\xffT\xfeTF8", 1))


@pytest.mark.parametrize("big_endian", [False, True])
def test_every_metadata_value_type_reads_as_gguf_reads_it(tmp_path, big_endian):
    path = tmp_path / "values.gguf"
    every_value_type(path, big_endian)
    assert_same_as_gguf(path)
    ours = read_gguf(path)
    assert ours.value("test.float32") == 1e-05 and ours.value("test.bool") is True
    assert ours.value("test.not_utf8") == "N\ufffdT\ufffdTF8" and ours.alignment == 64
    assert ours.value("test.uint64s") == [2**64 - 1] * 2


def test_kvlabs_type_table_is_ggmls():
    """The types kvlab knows itself have gguf's names and sizes; every other type gguf knows
    is found in gguf's table, and a number that is no type is None."""
    for kind, (name, block, block_bytes, _) in _GGML_TYPES.items():
        ggml = gguf.GGMLQuantizationType(kind)
        assert (name, (block, block_bytes)) == (ggml.name, gguf.GGML_QUANT_SIZES[ggml])
    for ggml, sizes in gguf.GGML_QUANT_SIZES.items():
        assert ggml_type(int(ggml))[:3] == (ggml.name, *sizes)
    assert ggml_type(10_000) is None


# ---- files that lie or end early -------------------------------------------------------------
@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """A small llama file with a vocabulary (strings, floats and integers in arrays): its
    bytes, and where its header ends (where the tensors' data begins)."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_config(writer, CONFIG)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(CONFIG.vocab_size)])
    writer.add_token_scores([float(-i) for i in range(CONFIG.vocab_size)])
    writer.add_token_types([1] * CONFIG.vocab_size)
    writer.add_tensor("token_embd.weight", np.ones((CONFIG.vocab_size, CONFIG.dim), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(CONFIG.dim, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes(), gguf.GGUFReader(path).data_offset


def test_a_file_cut_anywhere_in_its_header_is_refused_by_name(small_file, tmp_path):
    data, header_end = small_file
    cut = tmp_path / "cut.gguf"
    for length in list(range(0, header_end + 1)) + [header_end + 100, len(data) - 1]:
        cut.write_bytes(data[:length])
        with pytest.raises(kvlab.CheckpointError,
                           match="too short|truncated|past the end"):
            read_gguf(cut)


def lie(data: bytes, at: int, value: int, size: int = 8) -> bytes:
    return data[:at] + value.to_bytes(size, "little") + data[at + size:]


def test_lying_counts_are_refused_without_allocating_by_them(small_file, tmp_path):
    """Counts and lengths near 2**64, in the header and in an array of numbers and one of
    strings: each is refused, before any loop over it or allocation by it."""
    data, _ = small_file
    tokens = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    scores = data.index(b"tokenizer.ggml.scores") + len(b"tokenizer.ggml.scores")
    first_token = tokens + 4 + 4 + 8                 # value type, item type, count
    lies = {"tensor count": (8, 2**63), "metadata count": (16, 2**62),
            "string array length": (tokens + 8, 2**61),
            "number array length": (scores + 8, 2**60),
            "a string's length": (first_token, 2**64 - 1)}
    bad = tmp_path / "bad.gguf"
    for what, (at, value) in lies.items():
        bad.write_bytes(lie(data, at, value))
        tracemalloc.start()
        try:
            with pytest.raises(kvlab.CheckpointError, match="remain|file ends"):
                read_gguf(bad)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * len(data) + (1 << 20), (what, peak)


def test_other_corruptions_name_what_is_wrong(small_file, tmp_path):
    data, _ = small_file
    bad = tmp_path / "bad.gguf"
    model_type = data.index(b"tokenizer.ggml.model") + len(b"tokenizer.ggml.model")
    cases = {"not a GGUF file": b"GGUX" + data[4:],
             "GGUF version 1 is not supported": lie(data, 4, 1, 4),
             "value type 13, which GGUF does not define": lie(data, model_type, 13, 4),
             "is not valid UTF-8": data.replace(b"tokenizer.ggml.model",
                                                b"tokenizer.ggml.mod\xff\xfe", 1)}
    for message, corrupt in cases.items():
        bad.write_bytes(corrupt)
        with pytest.raises(kvlab.CheckpointError, match=message):
            read_gguf(bad)


def test_a_missing_file_and_a_fifo_are_refused_by_name(tmp_path):
    with pytest.raises(kvlab.CheckpointError, match="not found"):
        read_gguf(tmp_path / "none.gguf")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.gguf")
        with pytest.raises(kvlab.CheckpointError, match="named pipe"):
            read_gguf(tmp_path / "pipe.gguf")


def test_the_tensor_views_keep_the_file_mapped_and_read_only(tmp_path):
    path = tmp_path / "values.gguf"
    every_value_type(path)
    first = read_gguf(path).tensors[0].data       # the GGUFFile itself is gone
    np.testing.assert_array_equal(first, np.arange(12, dtype=np.float32).reshape(3, 4))
    with pytest.raises(ValueError):
        first[0, 0] = 1
