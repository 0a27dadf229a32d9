"""Malformed checkpoint files, built field by field: every one is loaded whole or refused by a
kvlab error, and a file that loads has every tensor and every byte of it accounted for.

Issue 35 found two loaders that read less than the file: a GGUF whose llama.block_count is
smaller than its blocks loaded as the smaller model (F16 or Q4_K tensors alike), and
safetensors whose data_offsets overlap or leave holes loaded too. Each loader now accounts
for every tensor and byte (llama.cpp's "wrong number of tensors"; the safetensors library's
"offsets must tile the data"), and says which rule a file breaks, naming the file and tensor.

Cases tried, and what each gives now (kvlab.CheckpointError unless said otherwise):
  GGUF (tests/support/gguf_files.py and the writer below, which sets every header field):
    * block_count 1 for a 2-block file (F16, Q4_K): "wrong number of tensors ... 'llama.
      block_count' is 1 but the file has tensors for block 1" (before: a 1-layer model);
      block_count 3: "lacks tensor 'blk.2...'"; an unknown tensor (a bias, blk.0.attn_rot_embd):
      "wrong number of tensors" naming it; a tensor twice: "appears twice";
    * bytes after the last tensor beyond its alignment padding: "N bytes follow the data of
      its last tensor" (before: ignored); the padding itself: loads;
    * hypothesis (test_malformed_gguf): any header integer (counts, key/name/string lengths,
      value and item types, n_dims, dims, tensor types, offsets) set to any value; any
      llama.* or tokenizer.* metadata value replaced by a value of any GGUF type (strings,
      arrays, negative, huge, NaN, inf, bool); general.alignment of any type and value;
      tensors dropped, duplicated, added or renamed; bytes cut off or appended; data types
      F32, F16, Q8_0, Q4_K. Each loads (and then runs to finite logits, every tensor of the
      file read) or is refused by a kvlab error within 10 s and 64 MB of Python allocations.
  safetensors (a folder with config.json):
    * overlapping data_offsets: "tensors A and B overlap" (before: loaded, sharing bytes);
      a hole: "N bytes belong to no tensor" (before: loaded, skipping them); bytes after the
      last tensor: "N bytes follow the last tensor" (before: ignored);
    * a key twice in the header: "appears twice" (before: the last one won, unchecked);
      an unknown field in an entry; __metadata__ not an object of strings; a header not
      starting with '{';
    * num_hidden_layers 1 for a 2-layer file: "wrong number of tensors ... the files have
      tensors for layer 1" (before: a 1-layer model); an unknown tensor: named;
      layers' rotary_emb.inv_freq: loads (computed from rope_theta, as transformers does);
      lm_head.weight in a tied model: loads if it equals the embedding, else refused;
    * a shard index that places a tensor in the wrong shard, names one no shard has, or
      leaves one out: refused naming the tensor and index;
    * hypothesis (test_malformed_safetensors): data_offsets, dtypes, shapes (negative,
      float, bool, huge, wrong length), the header length field, header padding and JSON
      shape, entries dropped/duplicated/added, bytes cut off or appended: loads (every
      tensor used, offsets tiling the file) or a kvlab error, quickly and in bounded memory.
  llama2.c: a version-1 header with a non-zero padding byte: "byte N of the version-1 header
    is X, expected 0" (before: ignored); the byte count must match exactly (unchanged).
"""
from __future__ import annotations

import json
import math
import struct
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.errors import CheckpointError
from kvlab.loaders import load_checkpoint, save_hf_llama, save_llama2c_v1
from kvlab.loaders.huggingface import write_safetensors

gguf = pytest.importorskip("gguf")
from gguf_files import encode as encode_matrix  # noqa: E402
from gguf_files import write_llama_gguf  # noqa: E402
from time_limit import time_limit  # noqa: E402

LOAD_ERRORS = (kvlab.CheckpointError, kvlab.WeightsError, kvlab.ConfigError,
               kvlab.TokenizerError)

# rows of 32 values (Q8_0's block) and one of 256 (Q4_K's) for the K-quant case
TINY = kvlab.ModelConfig(dim=32, hidden_dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         vocab_size=20, max_seq_len=8, tied_embeddings=False)
K_QUANT = kvlab.ModelConfig(dim=256, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                            vocab_size=32, max_seq_len=16, tied_embeddings=False)
HF_TINY = TINY.replace(rope_interleaved=False)


# ---- the guard every malformed load runs under -----------------------------------------------


def guarded_load(path: Path) -> Tuple[Any, Optional[BaseException]]:
    """(load_checkpoint's result, None) or (None, the kvlab error), within 10 s and 64 MB of
    Python allocations; any other exception fails the test (pytest shows it)."""
    tracemalloc.start()
    try:
        with time_limit(10), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # dequantizing, a vocabulary kvlab does not build
            return load_checkpoint(path), None
    except LOAD_ERRORS as error:
        return None, error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 * 2**20, f"loading allocated {peak:,} bytes"


def runs_to_finite_logits(config: kvlab.ModelConfig, weights: kvlab.Weights) -> None:
    weights.check(config)
    logits = kvlab.Model(config, weights).forward([0, 1][:config.max_seq_len])
    assert logits.shape == (config.vocab_size,) and np.isfinite(logits).all(), config


# ---- a GGUF writer that can lie in every field --------------------------------------------------
# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
           U64: "Q", I64: "q", F64: "d"}
GGUF_TOKENS = (["<unk>", "<s>", "</s>", "\u2581"] + [chr(ord("a") + i) for i in range(14)]
               + ["\u2581a", "\u2581b"])
LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
         "ffn_down", "ffn_up")
_TYPES = {"F32": 0, "F16": 1, "Q8_0": 8, "Q4_K": 12}


class Field:
    """A number in the header: where a mutation may set it to anything."""

    def __init__(self, fmt: str, value: int) -> None:
        self.fmt, self.value = fmt, value

    def encode(self) -> bytes:
        bits = 8 * struct.calcsize(self.fmt)
        return struct.pack("<" + self.fmt.upper(), self.value % (1 << bits))


def text(value: "str | bytes") -> List[Any]:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return [Field("Q", len(raw)), raw]


def encode_value(kind: int, value: Any) -> List[Any]:
    """[Field or bytes] of one GGUF value of `kind` (ARRAY: value is (item kind, items))."""
    if kind in _SCALAR:
        fmt = _SCALAR[kind]
        if fmt in "fd?":
            return [struct.pack("<" + fmt, value)]
        return [Field(fmt, int(value))]
    if kind == STRING:
        return text(value)
    item, items = value
    parts: List[Any] = [Field("I", item), Field("Q", len(items))]
    for one in items:
        parts += encode_value(item, one)
    return parts


def model_metadata(config: kvlab.ModelConfig) -> List[Tuple[str, int, Any]]:
    return [("general.architecture", STRING, "llama"),
            ("llama.context_length", U32, config.max_seq_len),
            ("llama.embedding_length", U32, config.dim),
            ("llama.feed_forward_length", U32, config.hidden_dim),
            ("llama.block_count", U32, config.n_layers),
            ("llama.attention.head_count", U32, config.n_heads),
            ("llama.attention.head_count_kv", U32, config.n_kv_heads),
            ("llama.attention.key_length", U32, config.head_dim),
            ("llama.rope.dimension_count", U32, config.head_dim),
            ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
            ("llama.rope.freq_base", F32, 10000.0),
            ("tokenizer.ggml.model", STRING, "llama"),
            ("tokenizer.ggml.tokens", ARRAY, (STRING, GGUF_TOKENS)),
            ("tokenizer.ggml.scores", ARRAY, (F32, [-float(i) for i in range(len(GGUF_TOKENS))])),
            ("tokenizer.ggml.token_type", ARRAY, (I32, [2, 3, 3] + [1] * (len(GGUF_TOKENS) - 3))),
            ("tokenizer.ggml.bos_token_id", U32, 1),
            ("tokenizer.ggml.eos_token_id", U32, 2)]


def model_tensors(config: kvlab.ModelConfig, kind: str, seed: int = 0
                  ) -> List[Tuple[str, int, bytes, List[int]]]:
    """(name, GGML type, data, ne dims) of every tensor of a random model, matrices in
    `kind`, norms F32."""
    weights = kvlab.Weights.random(config, seed=seed)
    rng = np.random.default_rng(seed)

    def matrix(values: np.ndarray) -> Tuple[int, bytes]:
        if kind == "F32":
            return 0, values.astype("<f4").tobytes()
        if kind == "F16":
            return 1, values.astype("<f2").tobytes()
        return _TYPES[kind], np.ascontiguousarray(encode_matrix(values, kind, rng)).tobytes()

    out = []

    def add(name: str, values: np.ndarray, norm: bool = False) -> None:
        kind_id, data = (0, values.astype("<f4").tobytes()) if norm else matrix(values)
        out.append((name, kind_id, data, list(reversed(values.shape))))

    add("token_embd.weight", weights.token_embedding)
    add("output_norm.weight", weights.final_norm, norm=True)
    add("output.weight", weights.classifier)
    keys = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")
    for i in range(config.n_layers):
        for key, gguf_name in zip(keys, LAYER):
            add(f"blk.{i}.{gguf_name}.weight", getattr(weights, key)[i], norm="norm" in key)
    return out


class GGUFFile:
    """A GGUF file as parts, each Field of which a mutation may change: the header's counts,
    every key, value type, value, array item type and length, string length, tensor name,
    n_dims, dim, type and offset."""

    def __init__(self, metadata, tensors, alignment: int = 32) -> None:
        self.alignment = alignment
        self.version = Field("I", 3)
        self.n_tensors, self.n_entries = Field("Q", len(tensors)), Field("Q", len(metadata))
        self.entries = [text(key) + [Field("I", kind)] + encode_value(kind, value)
                        for key, kind, value in metadata]
        self.infos, self.data, offset = [], b"", 0
        for name, kind, data, dims in tensors:
            self.infos.append(text(name) + [Field("I", len(dims))] + [Field("Q", d) for d in dims]
                              + [Field("I", kind), Field("Q", offset)])
            padded = data + b"\0" * (-len(data) % alignment)
            self.data += padded
            offset += len(padded)
        self.trailer = b""

    def fields(self) -> List[Field]:
        parts = [self.version, self.n_tensors, self.n_entries]
        for entry in self.entries + self.infos:
            parts += [p for p in entry if isinstance(p, Field)]
        return parts

    def encode(self) -> bytes:
        out = b"GGUF" + self.version.encode() + self.n_tensors.encode() + self.n_entries.encode()
        for entry in self.entries + self.infos:
            out += b"".join(p.encode() if isinstance(p, Field) else p for p in entry)
        out += b"\0" * (-len(out) % self.alignment)
        return out + self.data + self.trailer


def tiny_gguf(kind: str = "F32", config: kvlab.ModelConfig = TINY, metadata=None, tensors=None
              ) -> GGUFFile:
    return GGUFFile(metadata if metadata is not None else model_metadata(config),
                    tensors if tensors is not None else model_tensors(config, kind))


def test_the_writer_makes_a_file_that_loads(tmp_path: Path) -> None:
    """The fuzzer's starting point loads, with its vocabulary, for every tensor type."""
    for kind in ("F32", "F16", "Q8_0"):
        path = tmp_path / f"{kind}.gguf"
        path.write_bytes(tiny_gguf(kind).encode())
        (config, weights, tokenizer), error = guarded_load(path)
        assert error is None and config.replace(name="") == TINY.replace(rope_interleaved=True)
        assert tokenizer.vocab_size == len(GGUF_TOKENS)
        runs_to_finite_logits(config, weights)


# ---- GGUF: the finding, and the other ways to leave a tensor or byte unread ------------
def set_block_count(path: Path, value: int) -> None:
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.block_count"].parts[-1][0] = value
    del reader


@pytest.mark.parametrize("kind", ["F16", "Q4_K"])
def test_a_block_count_smaller_than_the_blocks_is_refused(tmp_path: Path, kind: str) -> None:
    """Before issue 35 this loaded as a 1-layer model, block 1 unread; llama.cpp refuses it
    ("wrong number of tensors"). A count larger than the blocks names the missing tensor."""
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, K_QUANT, kvlab.Weights.random(K_QUANT), default=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # Q4_K is dequantized, with a warning
        assert kvlab.load(path).config.n_layers == 2    # as written: it loads
    set_block_count(path, 1)
    with pytest.raises(CheckpointError, match=r"wrong number of tensors.*'llama\.block_count' "
                       r"is 1 but the file has tensors for block 1") as caught:
        load_checkpoint(path)
    assert str(path) in str(caught.value) and "blk.1." in str(caught.value)
    set_block_count(path, 3)
    with pytest.raises(CheckpointError, match=r"lacks tensor 'blk\.2\."):
        load_checkpoint(path)


@pytest.mark.parametrize("extra", ["blk.0.attn_q.bias", "blk.0.attn_rot_embd",
                                   "token_types.weight"])
def test_a_tensor_the_model_does_not_read_is_refused(tmp_path: Path, extra: str) -> None:
    tensors = model_tensors(TINY, "F32")
    tensors.append((extra, 0, b"\0" * 128, [32]))
    path = tmp_path / "extra.gguf"
    path.write_bytes(tiny_gguf(tensors=tensors).encode())
    with pytest.raises(CheckpointError, match=rf"{path}.*wrong number of tensors: the file has "
                       rf"{len(tensors)}, .* reads {len(tensors) - 1}; 1 would be left unused "
                       rf"\('{extra}'\)"):
        load_checkpoint(path)


def test_bytes_after_the_last_tensor_are_refused_its_padding_is_not(tmp_path: Path) -> None:
    """GGUFWriter and llama.cpp pad every tensor to the alignment, the last one too: a file
    ends at its last tensor's data or after that padding, and loads either way. A byte
    beyond was ignored before issue 35 and is refused now."""
    metadata = model_metadata(TINY) + [("general.alignment", U32, 256)]
    tensors = model_tensors(TINY, "F32")
    tensors.append(tensors.pop(-4))              # blk.1.ffn_norm (128 bytes) last
    raw = GGUFFile(metadata, tensors, alignment=256).encode()
    path = tmp_path / "m.gguf"
    for data in (raw, raw[:-128]):               # padded to 256, or not padded
        path.write_bytes(data)
        result, error = guarded_load(path)
        assert error is None and result[0].n_layers == 2
    for data, extra in ((raw + b"\0", 129), (raw[:-128] + b"\0" * 300, 300)):
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=rf"{path}: {extra} bytes follow the data of "
                           r"its last tensor 'blk\.1\.ffn_norm\.weight'.*alignment of 256.*no "
                           "tensor in the header accounts for them"):
            load_checkpoint(path)
    path.write_bytes(tiny_gguf().encode() + b"\x01")   # 4,096-byte last tensor: no padding
    with pytest.raises(CheckpointError, match="1 bytes follow the data of its last tensor"):
        load_checkpoint(path)


# ---- GGUF: hypothesis over every field -------------------------------------------------------
ANY_INTEGER = st.one_of(st.integers(0, 20), st.integers(0, 300),
                        st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
                                         2**64 - 1, 2**64 - 32]),
                        st.integers(0, 2**64 - 1), st.integers(-2**63, -1))


def any_value(depth: int = 0) -> st.SearchStrategy:
    """(GGUF value type, value) of any type."""
    scalars = st.one_of(
        st.tuples(st.sampled_from([U8, U16, U32, U64]), st.integers(0, 2**64 - 1)),
        st.tuples(st.sampled_from([I8, I16, I32, I64]), st.integers(-2**63, 2**63 - 1)),
        st.tuples(st.just(F32), st.floats(width=32)),
        st.tuples(st.just(F64), st.floats()),
        st.tuples(st.just(BOOL), st.booleans()),
        st.tuples(st.just(STRING), st.text(max_size=20)),
        st.tuples(st.just(U32), st.integers(0, 40)))
    if depth:
        return scalars
    arrays = st.one_of(
        st.tuples(st.just(ARRAY), st.tuples(st.just(STRING), st.lists(st.text(max_size=6), max_size=30))),
        st.tuples(st.just(ARRAY), st.tuples(st.sampled_from([I32, U32, I8, F32]),
                                            st.lists(st.integers(-3, 40), max_size=30))),
        st.tuples(st.just(ARRAY), st.tuples(st.just(F64), st.lists(st.floats(), max_size=25))))
    return st.one_of(scalars, arrays)


def fix_value(kind: int, value: Any) -> Any:
    """`value` made encodable as `kind` (a drawn integer wrapped to the type's width)."""
    if kind == ARRAY:
        item, items = value
        return item, [fix_value(item, v) for v in items]
    if kind in (F32, F64):
        return float(value)
    if kind in _SCALAR and _SCALAR[kind] not in "?":
        bits = 8 * struct.calcsize(_SCALAR[kind])
        v = int(value) % (1 << bits)
        return v - (1 << bits) if _SCALAR[kind].islower() and v >= 1 << (bits - 1) else v
    return value


METADATA_KEYS = [key for key, _, _ in model_metadata(TINY)] + [
    "general.alignment", "llama.rope.scaling.type", "tokenizer.ggml.merges",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_space_prefix"]

GGUF_MUTATIONS = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 10**6), ANY_INTEGER),
    st.tuples(st.just("value"), st.sampled_from(METADATA_KEYS), any_value()),
    st.tuples(st.just("drop key"), st.sampled_from(METADATA_KEYS), st.none()),
    st.tuples(st.sampled_from(["drop tensor", "duplicate tensor", "rename tensor"]),
              st.integers(0, 10**6), st.text(max_size=30)),
    st.tuples(st.just("add tensor"), st.sampled_from(["blk.2.attn_q.weight", "blk.0.attn_q.bias",
                                                      "rope_freqs.weight", "x"]),
              st.integers(1, 40)),
    st.tuples(st.just("block count"), st.integers(0, 5), st.none()),
    st.tuples(st.sampled_from(["truncate", "append"]), st.integers(1, 5000), st.none()))


def mutate_gguf(model_kind: str, mutations) -> bytes:
    metadata = model_metadata(TINY)
    tensors = model_tensors(TINY, model_kind)
    fields: List[Tuple[int, int]] = []         # (mutation index, value) after building
    cut = extra = 0
    for what, where, value in mutations:
        if what == "value":
            metadata = [m for m in metadata if m[0] != where] + [(where, value[0],
                                                                  fix_value(*value))]
        elif what == "drop key":
            metadata = [m for m in metadata if m[0] != where]
        elif what == "block count":
            metadata = [m if m[0] != "llama.block_count" else (m[0], U32, where)
                        for m in metadata]
        elif what in ("drop tensor", "duplicate tensor", "rename tensor") and tensors:
            i = where % len(tensors)
            if what == "drop tensor":
                tensors.pop(i)
            elif what == "duplicate tensor":
                tensors.insert(i, tensors[i])
            else:
                tensors[i] = (value,) + tensors[i][1:]
        elif what == "add tensor":
            tensors.append((where, 0, b"\0" * 4 * value, [value]))
        elif what == "field":
            fields.append((where, value))
        elif what == "truncate":
            cut += where
        elif what == "append":
            extra += where
    model = GGUFFile(metadata, tensors)
    parts = model.fields()
    for where, value in fields:
        parts[where % len(parts)].value = value
    model.trailer = b"\x5a" * extra
    raw = model.encode()
    return raw[:max(0, len(raw) - cut)]


def gguf_tensor_count(path: Path) -> int:
    return len(gguf.GGUFReader(path).tensors)


@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["F32", "F16", "Q8_0"]),
       mutations=st.lists(GGUF_MUTATIONS, min_size=1, max_size=3))
def test_malformed_gguf(tmp_path_factory, kind: str, mutations) -> None:
    """Any GGUF field set to anything: loads, every tensor read, or a kvlab error."""
    path = tmp_path_factory.mktemp("gguf") / "bad.gguf"
    path.write_bytes(mutate_gguf(kind, mutations))
    result, error = guarded_load(path)
    event("refused" if error is not None else "loaded")  # --hypothesis-show-statistics
    if error is not None:
        assert str(path) in str(error), error                 # it names the file
        return
    config, weights, _ = result
    tensors = 2 + (not config.tied_embeddings) + 9 * config.n_layers
    assert gguf_tensor_count(path) == tensors   # every tensor of the file was read
    runs_to_finite_logits(config, weights)


# ---- safetensors: the finding and the rest of the header -------------------------------
def hf_folder(folder: Path, config: kvlab.ModelConfig = HF_TINY, seed: int = 0) -> Path:
    save_hf_llama(folder, config, kvlab.Weights.random(config, seed=seed))
    return folder / "model.safetensors"


def split(path: Path) -> Tuple[Dict[str, Any], bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: Any, data: bytes, raw_header: Optional[bytes] = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def with_offsets(path: Path, change: Callable[[Dict[str, Any]], None], data_change=None) -> None:
    header, data = split(path)
    change(header)
    path.write_bytes(join(header, data_change(data) if data_change else data))


Q = "model.layers.0.self_attn.q_proj.weight"


def test_overlapping_offsets_are_refused(tmp_path: Path) -> None:
    """Two tensors sharing bytes loaded before issue 35 (each had the right size)."""
    path = hf_folder(tmp_path / "m")
    header, _ = split(path)
    k = "model.layers.0.self_attn.k_proj.weight"
    start = header[k]["data_offsets"][0]

    def overlap(h):  # q takes k's place (same size for this config? no: move k onto q)
        size = h[k]["data_offsets"][1] - h[k]["data_offsets"][0]
        h[k]["data_offsets"] = [h[Q]["data_offsets"][0], h[Q]["data_offsets"][0] + size]

    with_offsets(path, overlap)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensors '.*' and '.*' "
                       r"overlap.*data_offsets must cover the data section exactly"):
        load_checkpoint(tmp_path / "m")
    assert start >= 0


def test_a_hole_in_the_data_is_refused(tmp_path: Path) -> None:
    """A tensor moved later, leaving bytes no tensor reads: loaded before issue 35."""
    path = hf_folder(tmp_path / "m")
    header, data = split(path)
    last = max((h for n, h in header.items() if n != "__metadata__"),
               key=lambda h: h["data_offsets"][1])
    last["data_offsets"] = [o + 8 for o in last["data_offsets"]]
    begin = last["data_offsets"][0] - 8
    path.write_bytes(join(header, data[:begin] + b"\0" * 8 + data[begin:]))
    with pytest.raises(CheckpointError, match=r"8 bytes belong to no tensor: tensor '.*' ends "
                       r"at byte [\d,]+, tensor '.*' begins at byte"):
        load_checkpoint(tmp_path / "m")


def test_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    path = hf_folder(tmp_path / "m")
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"4 bytes follow the last tensor, '.*', which "
                       r"ends at byte"):
        load_checkpoint(tmp_path / "m")


@pytest.mark.parametrize("raw, match", [
    (lambda text: text.replace(b'{"__metadata__"', b'{"' + Q.encode() + b'": {"dtype": "F32", '
                               b'"shape": [0], "data_offsets": [0, 0]}, "__metadata__"', 1),
     "appears twice"),
    (lambda text: text.replace(b'"dtype"', b'"extra": 1, "dtype"', 1), "unknown field 'extra'"),
    (lambda text: text.replace(b'{"format":"pt"}', b'{"format":7}', 1),
     "'__metadata__' must be an object of strings"),
    (lambda text: b" " + text, "must be a JSON object starting with '{'"),
])
def test_header_rules(tmp_path: Path, raw, match: str) -> None:
    path = hf_folder(tmp_path / "m")
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    text = raw(data[8:8 + n].rstrip(b" "))
    assert text != data[8:8 + n].rstrip(b" ")
    path.write_bytes(join(None, data[8 + n:], text))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path / "m")


def test_a_num_hidden_layers_smaller_than_the_layers_is_refused(tmp_path: Path) -> None:
    """Before issue 35 this loaded as a 1-layer model, layer 1 unread."""
    hf_folder(tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    hf = json.loads(config_path.read_text())
    hf["num_hidden_layers"] = 1
    config_path.write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"wrong number of tensors.*'num_hidden_layers' "
                       r"is 1 but the files have tensors for layer 1"):
        load_checkpoint(tmp_path / "m")


def rewrite(folder: Path, change: Callable[[Dict[str, np.ndarray]], None],
            config: kvlab.ModelConfig = HF_TINY) -> None:
    from kvlab.loaders.huggingface import _hf_tensors
    weights = kvlab.Weights.random(config, seed=0)
    save_hf_llama(folder, config, weights)
    tensors = {n: np.asarray(a, dtype=np.float32) for n, a in _hf_tensors(config, weights).items()}
    change(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def test_unknown_missing_and_explained_tensors(tmp_path: Path) -> None:
    rewrite(tmp_path / "extra", lambda t: t.update({"model.layers.0.foo.weight": np.ones(3)}))
    with pytest.raises(CheckpointError, match=r"1 would be left unused "
                       r"\('model\.layers\.0\.foo\.weight'\)"):
        load_checkpoint(tmp_path / "extra")
    rewrite(tmp_path / "missing", lambda t: t.pop(Q))
    with pytest.raises(CheckpointError, match=rf"lacks tensor '{Q}'"):
        load_checkpoint(tmp_path / "missing")
    # what transformers also ignores loads: older checkpoints' RoPE tables
    rewrite(tmp_path / "inv_freq", lambda t: t.update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(4) for i in range(2)}))
    assert load_checkpoint(tmp_path / "inv_freq")[0].n_layers == 2
    rewrite(tmp_path / "inv_freq9", lambda t: t.update(
        {"model.layers.9.self_attn.rotary_emb.inv_freq": np.ones(4)}))
    with pytest.raises(CheckpointError, match="tensors for layer 9"):
        load_checkpoint(tmp_path / "inv_freq9")


def test_a_tied_models_lm_head_must_equal_the_embedding(tmp_path: Path) -> None:
    tied = HF_TINY.replace(tied_embeddings=True)
    rewrite(tmp_path / "same", lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].copy()}), tied)
    assert load_checkpoint(tmp_path / "same")[0].tied_embeddings
    rewrite(tmp_path / "differs", lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + 1}), tied)
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from"):
        load_checkpoint(tmp_path / "differs")


def sharded(folder: Path) -> Dict[str, str]:
    from kvlab.loaders.huggingface import _hf_tensors
    weights = kvlab.Weights.random(HF_TINY, seed=0)
    save_hf_llama(folder, HF_TINY, weights)
    (folder / "model.safetensors").unlink()
    tensors = _hf_tensors(HF_TINY, weights)
    names = list(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        write_safetensors(folder / shard, {n: tensors[n] for n in shard_names})
    return {n: shard for shard, shard_names in shards.items() for n in shard_names}


@pytest.mark.parametrize("change, match", [
    (lambda m: m.update({Q: "b.safetensors" if m[Q] == "a.safetensors" else "a.safetensors"}),
     "places tensor .* but it is in"),
    (lambda m: m.update({"model.layers.0.foo.weight": "a.safetensors"}), "which has no such tensor"),
    (lambda m: m.pop(Q), "is not in the weight_map"),
])
def test_the_shard_index_and_the_shards_agree(tmp_path: Path, change, match: str) -> None:
    weight_map = sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert load_checkpoint(tmp_path)[0].n_layers == 2
    change(weight_map)
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


# ---- safetensors: hypothesis over the header ----------------------------------------------
ANY_JSON_NUMBER = st.one_of(st.integers(-5, 5000), st.integers(-2**70, 2**70), st.floats(),
                            st.booleans(), st.none(), st.text(max_size=4))
SAFETENSORS_MUTATIONS = st.one_of(
    st.tuples(st.just("offset"), st.integers(0, 10**6), st.integers(0, 1), ANY_JSON_NUMBER),
    st.tuples(st.just("shift"), st.integers(0, 10**6), st.integers(-64, 64), st.none()),
    st.tuples(st.just("offsets"), st.integers(0, 10**6), st.none(),
              st.one_of(st.lists(ANY_JSON_NUMBER, max_size=3), ANY_JSON_NUMBER)),
    st.tuples(st.just("dtype"), st.integers(0, 10**6), st.none(),
              st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL",
                                         "F8_E4M3", "I64", "Q4", "", "f32"]), ANY_JSON_NUMBER)),
    st.tuples(st.just("shape"), st.integers(0, 10**6), st.none(),
              st.one_of(st.lists(ANY_JSON_NUMBER, max_size=4),
                        st.lists(st.integers(0, 2**64), max_size=3), ANY_JSON_NUMBER)),
    st.tuples(st.sampled_from(["drop", "duplicate name", "swap offsets", "entry"]),
              st.integers(0, 10**6), st.integers(0, 10**6), ANY_JSON_NUMBER),
    st.tuples(st.just("header length"), st.none(), st.none(),
              st.one_of(st.integers(0, 2**64 - 1), st.integers(-16, 16))),
    st.tuples(st.just("padding"), st.integers(0, 16), st.none(), st.none()),
    st.tuples(st.just("metadata"), st.none(), st.none(), ANY_JSON_NUMBER),
    st.tuples(st.sampled_from(["truncate", "append"]), st.integers(1, 3000), st.none(),
              st.none()))


def mutate_safetensors(header: Dict[str, Any], data: bytes, mutations) -> bytes:
    header = json.loads(json.dumps(header))
    names = [n for n in header if n != "__metadata__"]
    length_delta, length_set, padding, cut, extra = 0, None, 0, 0, 0
    for what, a, b, value in mutations:
        name = names[a % len(names)] if isinstance(a, int) and names else None
        if what == "offset" and isinstance(header.get(name), dict):
            offsets = header[name].get("data_offsets")
            if isinstance(offsets, list) and len(offsets) > b:
                offsets[b] = value
        elif what == "shift" and isinstance(header.get(name), dict):
            offsets = header[name].get("data_offsets")
            if isinstance(offsets, list) and all(isinstance(o, int) for o in offsets):
                header[name]["data_offsets"] = [o + b for o in offsets]
        elif what in ("offsets", "dtype", "shape") and isinstance(header.get(name), dict):
            header[name]["data_offsets" if what == "offsets" else what] = value
        elif what == "drop" and name in header:
            del header[name]
        elif what == "swap offsets" and isinstance(header.get(name), dict):
            other = names[b % len(names)]
            if isinstance(header.get(other), dict):
                header[name]["data_offsets"], header[other]["data_offsets"] = (
                    header[other].get("data_offsets"), header[name].get("data_offsets"))
        elif what == "entry" and name in header:
            header[name] = value
        elif what == "duplicate name" and isinstance(header.get(name), dict):
            header[f"model.layers.{b % 4}.self_attn.q_proj.weight"] = dict(header[name])
        elif what == "header length":
            length_set, length_delta = (value, 0) if value >= 16 else (None, value)
        elif what == "padding":
            padding = a
        elif what == "metadata":
            header["__metadata__"] = value
        elif what == "truncate":
            cut += a
        elif what == "append":
            extra += a
    text = json.dumps(header).encode() + b" " * padding
    length = length_set if length_set is not None else max(0, len(text) + length_delta)
    raw = struct.pack("<Q", length % 2**64) + text + data + b"\x5a" * extra
    return raw[:max(0, len(raw) - cut)]


@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(mutations=st.lists(SAFETENSORS_MUTATIONS, min_size=1, max_size=3))
def test_malformed_safetensors(tmp_path_factory, mutations) -> None:
    """Any safetensors header field set to anything: loads, every tensor read and every
    byte in a tensor, or a kvlab error."""
    folder = tmp_path_factory.mktemp("st") / "m"
    path = hf_folder(folder)
    header, data = split(path)
    path.write_bytes(mutate_safetensors(header, data, mutations))
    result, error = guarded_load(folder)
    event("refused" if error is not None else "loaded")  # --hypothesis-show-statistics
    if error is not None:
        assert str(folder) in str(error), error               # it names the file (or folder)
        return
    config, weights, _ = result
    header, data = split(path)
    entries = {n: h for n, h in header.items() if n != "__metadata__"}
    assert len(entries) == 2 + (not config.tied_embeddings) + 9 * config.n_layers
    spans = sorted(h["data_offsets"] for h in entries.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    runs_to_finite_logits(config, weights)


# ---- llama2.c --------------------------------------------------------------------------------
def test_a_version_1_header_with_a_non_zero_padding_byte_is_refused(tmp_path: Path) -> None:
    config = TINY.replace(rope_interleaved=True, tied_embeddings=True)
    path = tmp_path / "m.bin"
    save_llama2c_v1(path, config, kvlab.Weights.random(config))
    assert load_checkpoint(path)[0].dim == config.dim
    data = bytearray(path.read_bytes())
    data[200] = 7
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"byte 200 of the version-1 header is 7, "
                       "expected 0"):
        load_checkpoint(path)
    path.write_bytes(bytes(data[:200]) + b"\0" + bytes(data[201:]) + b"\0")
    with pytest.raises(CheckpointError, match="1 unexpected bytes after the weights"):
        load_checkpoint(path)
