"""Read Llama checkpoints in GGUF format (llama.cpp's file format).

The `gguf` package (pip install gguf) parses the container; this module maps its
metadata keys and tensor names onto kvlab's ModelConfig and Weights. Two things to know:
  * GGUF lists a tensor's dimensions fastest-varying first (ggml's `ne`), the reverse of
    a NumPy shape: a (out_features, in_features) matrix appears as [in, out].
  * llama.cpp's converter permutes q/k rows to the interleaved RoPE layout (the
    llama2.c / Meta one), so GGUF models use rope_interleaved=True.
Not here: architectures other than "llama", and RoPE scaling stored in GGUF (rope_freqs).

Tensor types. kvlab's core reads six of GGUF's types as they are (kvlab.weight_formats):
F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (fp32, fp16, bf16, q8_0, q4_0, q4_1, byte for byte). A
matrix whose layers all have one of these types keeps it: these are the types whose blocks
are 32 values with one or two half scales, which the core's kernels unpack (nibbles with an
and and a shift) and multiply against int8 activations directly. Any other type (Q5_0,
Q5_1, the K-quants Q2_K .. Q6_K, the IQ types, ...) is dequantized with the gguf package, a
few megabytes at a time, and stored in a format the core reads: `weight_format`
(kvlab.load's weights=), q8_0 when that is None, fp16 where a row is not a whole number of
Q8_0 blocks. The K-quants' 256-value super-blocks with 6-bit sub-scales (and Q5's fifth bit
kept apart) need kernels of their own, left for later. So is a matrix whose layers differ
in type (Q4_K_M files mix Q4_K and Q6_K). That costs memory (q8_0 takes 8.5 bits a weight,
Q4_K 4.5) and time (NumPy, not C), so one warning says what it cost. The norm vectors are
always float32, whatever their type in the file.

The weights are copies, never views of the file: the core wants one pointer that reaches
every layer of a matrix (Weights stacks them), and a GGUF file stores each layer as a tensor
of its own, with other tensors between them. So a kept matrix is copied, layer by layer,
from the file's bytes into one stacked array; a memory map cannot be used in place.

Every count, length, offset and size in a GGUF file is a number the file chooses, and the
`gguf` package believes them: a corrupt array length makes it loop for ever, a tensor's
dims can wrap around in uint64. So kvlab walks the header once itself first (check_header),
checking each number against the bytes that are really there, and takes the model's sizes
from the metadata only once the tensors that must match them are known to exist.

Every tensor and byte is accounted for, as llama.cpp does ("wrong number of tensors"): each
tensor of the file must be one the model its metadata describes reads (a llama.block_count
smaller than the file's blocks, or a tensor of another architecture, is refused by name, not
left unread), each tensor's data starts where the one before ends (padded to the alignment),
and the file ends with the last tensor's data or its padding: a byte more is refused.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import numpy as np

from .. import weight_formats
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, TokenizerError
from ..files import LIMITS, config_error_in, open_regular
from .. import gguf_tokenizer
from ..tokenizer import _gguf_value   # one GGUF field decoder for the package
from ..weights import MATRICES, Weights

# kvlab name -> GGUF tensor name ({i} = layer).
GGUF_LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "w1": "blk.{i}.ffn_gate.weight",
    "w2": "blk.{i}.ffn_down.weight",
    "w3": "blk.{i}.ffn_up.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embedding": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "classifier": "output.weight",
}


# GGUF tensor types the core reads as they are -> the kvlab weight format of the same bytes.
_KEPT_TYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",
               "Q4_1": "q4_1"}
# Rows are dequantized about this many bytes of float32 values at a time: the gguf package
# makes a few temporaries of that size, so a 500 MB token_embd needs no gigabytes of scratch.
_DEQUANTIZE_CHUNK_BYTES = 16 << 20


def load_gguf(path: "str | os.PathLike[str]", weight_format: Optional[str] = None
              ) -> Tuple[ModelConfig, Weights, Any]:
    """(config, weights, tokenizer or None) from a llama GGUF file.

    A matrix keeps its GGUF type where the core reads it as it is (F32, F16, BF16, Q8_0,
    Q4_0, Q4_1: fp32, fp16, bf16, q8_0, q4_0, q4_1). Any other type is dequantized and stored as `weight_format`
    (None: q8_0, or fp16 for rows that are not whole Q8_0 blocks), with one warning that
    says what it cost. The norm vectors are float32."""
    if weight_format is not None and weight_format not in weight_formats.FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(weight_formats.FORMATS)} "
                         f"or None, got {weight_format!r}")
    path = Path(path)
    reader = open_gguf(path)  # its errors name the file already
    cost = _DequantizeCost()
    try:
        tensors = {t.name: t for t in reader.tensors}
        config = config_from_gguf(reader, tensors, name=path.stem)
        weights = _gather_weights(config, tensors, weight_format, _big_endian(reader), cost)
        tokenizer = _embedded_tokenizer(reader)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except ConfigError as exc:  # a value ModelConfig refuses (rope.freq_base=1e-300 ...)
        raise config_error_in(exc, str(path), _GGUF_KEYS) from None
    if cost.tensors:
        warnings.warn(f"{path}: {cost.summary()}", stacklevel=_stacklevel_outside_kvlab())
    return config, weights, tokenizer


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader, with kvlab's errors for a missing package or a bad file."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    check_header(path)  # refuses a missing file, a FIFO or a device by name
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the walk above should leave nothing for gguf to refuse; if
        # it does (a newer gguf is stricter), it raises ValueError, KeyError ... not ours
        raise CheckpointError(f"{path}: not a readable GGUF file "
                              f"({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------------------
# The header walk: every number the file chooses, checked before gguf's reader sees it
# ---------------------------------------------------------------------------------------
# GGUF metadata value types (the spec's gguf_type, gguf.GGUFValueType), and the bytes one
# scalar of each takes. STRING (u64 length + UTF-8 bytes) and ARRAY (u32 item type,
# u64 count, items) carry their own lengths.
_STRING, _ARRAY = 8, 9
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32 = 4
_VERSIONS = (2, 3)         # version 1 had 32-bit counts; gguf reads 2 and 3 only
_MAX_DIMS = 4              # ggml tensors have at most 4 dimensions (GGML_MAX_DIMS)
_DEFAULT_ALIGNMENT = 32    # tensor data starts at a multiple of this, unless general.alignment
# The fewest bytes one entry can take, to refuse a count the rest of the file cannot hold
# before looping over it: a metadata entry is a key length (8), a key (may be empty), a
# value type (4) and a value (1 byte at least); a tensor info is a name length (8), a name,
# n_dims (4), one dim (8), a type (4) and an offset (8).
_MIN_ENTRY_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
# gguf's reader files the header's own numbers under these names: a key spelled the same
# would clash with them.
_READER_NAMES = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def check_header(path: Path) -> None:
    """Walk a GGUF file's header and tensor table, raising CheckpointError at the first
    number that does not fit the file: a count, string or array length running past the
    end, an unknown value or tensor type, a nested array, a duplicate key or tensor name,
    a bad general.alignment, tensor dims that are too many or too large, tensor data that
    is not where the layout puts it or lies (partly) past the end of the file. It reads the
    header only (the file is mapped, not loaded) and allocates nothing the file size does
    not bound."""
    with open_regular(path, "checkpoint") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for the 24-byte "
                                  "GGUF header (magic, version, tensor count, metadata count)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _HeaderWalk(data, path).check()


class _HeaderWalk:
    """A cursor over the mapped file that refuses to step past its end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0
        self.order = "<"  # little-endian, unless the version says otherwise
        self.alignment = _DEFAULT_ALIGNMENT

    def fail(self, message: str) -> NoReturn:
        raise CheckpointError(f"{self.path}: {message}")

    # ---- the primitives: each checks that its bytes are there before reading them ------
    def skip(self, n: int, what: str) -> None:
        left = len(self.data) - self.at
        if n > left:
            self.fail(f"{what} needs {n:,} bytes at offset {self.at:,}, but the file ends "
                      f"{left:,} bytes later (it is truncated, or a length in its header "
                      "is corrupt)")
        self.at += n

    def number(self, fmt: str, what: str) -> Any:
        start = self.at
        self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def text(self, what: str) -> str:
        """A GGUF string (u64 length, then UTF-8 bytes) that must decode: a key or a name."""
        n = self.number("Q", f"the length of {what}")
        start = self.at
        self.skip(n, what)
        try:
            return self.data[start:self.at].decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {start:,} is not valid UTF-8")

    # ---- the file, part by part ------------------------------------------------------
    def check(self) -> None:
        if self.data[:4] != b"GGUF":
            self.fail(f"not a GGUF file: it starts with {bytes(self.data[:4])!r}, not b'GGUF'")
        self.at = 4
        version = self.number("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine (as gguf's reader decides)
            self.order = ">"
            version = struct.unpack_from(">I", self.data, 4)[0]
        if version not in _VERSIONS:
            self.fail(f"GGUF version {version} is not supported (kvlab reads versions 2 and 3)")
        n_tensors = self.number("Q", "the tensor count")
        n_entries = self.number("Q", "the metadata count")
        # A count is checked against the bytes left before the loop over it, so that no
        # loop runs longer than the file is long.
        self.check_count(n_entries, _MIN_ENTRY_BYTES, "metadata entries")
        keys = set(_READER_NAMES)
        for i in range(n_entries):
            self.metadata_entry(i, keys)
        self.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensors")
        from gguf import GGML_QUANT_SIZES  # {type: (values per block, bytes per block)}
        type_sizes = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
        names: set = set()
        infos = [self.tensor_info(i, names, type_sizes) for i in range(n_tensors)]
        self.check_tensor_data(infos)

    def check_count(self, count: int, least: int, what: str) -> None:
        left = len(self.data) - self.at
        if count * least > left:
            self.fail(f"the header says {count:,} {what}, but they would take at least "
                      f"{count * least:,} bytes and only {left:,} remain")

    def metadata_entry(self, index: int, keys: set) -> None:
        key = self.text(f"metadata key #{index}")
        if key in keys:
            self.fail(f"metadata key {_short(key)} appears twice")
        keys.add(key)
        what = f"metadata {_short(key)}"
        kind = self.number("I", f"the value type of {what}")
        if key == "general.alignment":
            self.alignment_value(kind)
        else:
            self.value(kind, what)

    def alignment_value(self, kind: int) -> None:
        if kind != _UINT32:
            self.fail(f"metadata 'general.alignment' has value type {kind}, expected {_UINT32} "
                      "(uint32)")
        alignment = self.number("I", "metadata 'general.alignment'")
        if alignment == 0 or alignment & (alignment - 1):
            self.fail(f"metadata 'general.alignment' is {alignment}, expected a power of two")
        self.alignment = alignment

    def value(self, kind: int, what: str) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind], what)
        elif kind == _STRING:
            self.skip(self.number("Q", f"the length of {what}"), what)
        elif kind == _ARRAY:
            self.array(what)
        else:
            self.fail(f"{what} has value type {kind}, which GGUF does not define (0..12)")

    def array(self, what: str) -> None:
        item = self.number("I", f"the item type of {what}")
        count = self.number("Q", f"the length of {what}")
        if item in _SCALAR_BYTES:
            # one check for the whole array: no loop over a count the file chose
            self.skip(count * _SCALAR_BYTES[item], f"{what} ({count:,} items, "
                      f"{_SCALAR_BYTES[item]} bytes each)")
        elif item == _STRING:
            self.check_count(count, 8, f"strings in {what}")  # then the loop is bounded
            for i in range(count):
                self.skip(self.number("Q", f"the length of item {i} of {what}"),
                          f"item {i} of {what}")
        elif item == _ARRAY:
            self.fail(f"{what} is an array of arrays, which GGUF readers do not support")
        else:
            self.fail(f"{what} has item type {item}, which GGUF does not define (0..12)")

    def tensor_info(self, index: int, names: set, type_sizes: Dict[int, Tuple[int, int]]
                    ) -> Tuple[str, int, int]:
        """(name, offset of its data after the header, its size in bytes)."""
        name = self.text(f"the name of tensor #{index}")
        if name in names:
            self.fail(f"tensor {_short(name)} appears twice")
        names.add(name)
        name = _short(name)  # as the messages below quote it
        n_dims = self.number("I", f"the number of dims of tensor {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            self.fail(f"tensor {name} has {n_dims} dims, expected 1 to {_MAX_DIMS}")
        dims = [self.number("Q", f"dim {i} of tensor {name}") for i in range(n_dims)]
        kind = self.number("I", f"the type of tensor {name}")
        sizes = type_sizes.get(kind)
        if sizes is None:
            self.fail(f"tensor {name} has type {kind}, which is no GGML tensor type")
        block, block_bytes = sizes
        if dims[0] % block:
            self.fail(f"tensor {name} has a first dim of {dims[0]}, not a multiple of its "
                      f"type's block of {block} values")
        offset = self.number("Q", f"the data offset of tensor {name}")
        # Python integers: dims near 2**64 multiply to a huge number, not a wrapped small one
        return name, offset, math.prod(dims) // block * block_bytes

    def check_tensor_data(self, infos: List[Tuple[str, int, int]]) -> None:
        """Tensor data follows the header, in the order of the tensor table, each tensor
        padded to the alignment (llama.cpp requires exactly this layout too). So every
        offset is known in advance: one that differs would read another tensor's bytes (an
        overlap, a misaligned start, or an offset near 2**64 that gguf's uint64 sum wraps
        around), silently."""
        start = -(-self.at // self.alignment) * self.alignment  # data begins, aligned
        expected = 0
        end = self.at  # where the bytes the header describes end: the last tensor's data
        for name, offset, nbytes in infos:
            if offset != expected:
                self.fail(f"tensor {name} has data offset {offset:,}, expected {expected:,} "
                          f"(right after the previous tensor, padded to the alignment of "
                          f"{self.alignment})")
            if start + offset + nbytes > len(self.data):
                self.fail(f"tensor {name} has {nbytes:,} bytes of data at offset "
                          f"{start + offset:,}, past the end of the file ({len(self.data):,} "
                          "bytes): the file is truncated, or the tensor's dims are corrupt")
            end = start + offset + nbytes
            expected += -(-nbytes // self.alignment) * self.alignment
        self.check_file_end(end, infos[-1][0] if infos else None)

    def check_file_end(self, end: int, last: Optional[str]) -> None:
        """The file ends where its last tensor's data does, or after the padding to the
        alignment that writers put there (gguf's GGUFWriter and llama.cpp pad every tensor,
        the last one too): bytes beyond that are described by nothing in the header (a
        tensor the counts leave out, or another file appended), and are refused."""
        padded = -(-end // self.alignment) * self.alignment
        if len(self.data) > padded:
            after = (f"the data of its last tensor {last}" if last is not None
                     else "the header (it lists no tensors)")
            self.fail(f"{len(self.data) - end:,} bytes follow {after}, which ends at offset "
                      f"{end:,} (padded to the alignment of {self.alignment}: {padded:,}); "
                      "no tensor in the header accounts for them: the tensor count is "
                      "corrupt, or something was appended to the file")


# kvlab's ModelConfig field -> the GGUF metadata key it comes from, to name the key in errors.
_GGUF_KEYS = {"dim": "llama.embedding_length", "hidden_dim": "llama.feed_forward_length",
              "n_layers": "llama.block_count", "n_heads": "llama.attention.head_count",
              "n_kv_heads": "llama.attention.head_count_kv",
              "max_seq_len": "llama.context_length", "head_dim": "llama.attention.key_length",
              "norm_eps": "llama.attention.layer_norm_rms_epsilon",
              "rope_theta": "llama.rope.freq_base"}


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value as plain Python (str, int, float, list)."""
    value = _gguf_value(reader, key)
    return default if value is None else value


def config_from_gguf(reader: Any, tensors: Dict[str, Any], name: str = "") -> ModelConfig:
    arch = metadata(reader, "general.architecture")
    if arch is None:
        raise CheckpointError("GGUF file lacks metadata 'general.architecture'")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {_short(arch)} is not supported (only 'llama')")
    _reject_rope_scaling(reader, tensors)

    def size(suffix: str, field: str, default: Optional[int] = None) -> int:
        """A size from llama.* metadata: an integer (not a string, float or array) in
        1..LIMITS[field], so that nothing later divides by it or allocates by it blindly."""
        key = f"llama.{suffix}"
        value = metadata(reader, key, default)
        if value is None:
            raise CheckpointError(f"GGUF file lacks metadata {key!r}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"metadata {key!r} is {_short(value)}, expected an integer")
        if not 1 <= value <= LIMITS[field]:
            raise CheckpointError(f"metadata {key!r} is {value}, expected 1..{LIMITS[field]} "
                                  f"(the model's {field})")
        return value

    def number(suffix: str, default: float) -> float:
        key = f"llama.{suffix}"
        value = metadata(reader, key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"metadata {key!r} is {_short(value)}, expected a number")
        return float(value)  # ModelConfig checks it is positive and finite

    n_heads = size("attention.head_count", "n_heads")
    dim = size("embedding_length", "dim")
    # without key_length, head_dim is dim / n_heads (unless that is 0: then it is missing)
    head_dim = size("attention.key_length", "dim", dim // n_heads or None)
    rope_dims = size("rope.dimension_count", "dim", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(f"partial RoPE (rope.dimension_count={rope_dims}, "
                              f"head_dim={head_dim}) is not supported")
    return ModelConfig(
        dim=dim,
        hidden_dim=size("feed_forward_length", "hidden_dim"),
        n_layers=size("block_count", "n_layers"),
        n_heads=n_heads,
        n_kv_heads=size("attention.head_count_kv", "n_kv_heads", n_heads),
        vocab_size=_vocab_size(reader, tensors),
        max_seq_len=size("context_length", "max_seq_len", 2048),
        head_dim=head_dim,
        norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number("rope.freq_base", 10000.0),
        rope_interleaved=True,  # llama.cpp permutes q/k to the interleaved layout
        tied_embeddings=GGUF_GLOBAL_NAMES["classifier"] not in tensors,
        name=name,  # the file name; general.name is often just "llama"
    )


def _short(value: Any) -> str:
    """A value, key or name for an error message: a corrupt one can be a 10,000-item array
    or a string thousands of bytes long."""
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_rope_scaling(reader: Any, tensors: Dict[str, Any]) -> None:
    kind = metadata(reader, "llama.rope.scaling.type", "none")
    if kind != "none" or "rope_freqs.weight" in tensors:
        raise CheckpointError("RoPE scaling in GGUF files (rope.scaling.type / rope_freqs) "
                              "is not supported; load the Hugging Face checkpoint instead")


def _vocab_size(reader: Any, tensors: Dict[str, Any]) -> int:
    """Rows of token_embd (the weights decide); the token list may be shorter, not longer."""
    embd = tensors.get(GGUF_GLOBAL_NAMES["token_embedding"])
    if embd is None:
        raise CheckpointError("GGUF file lacks tensor 'token_embd.weight'")
    rows = int(embd.shape[-1])  # ne is reversed: the last entry is the row count
    if not 1 <= rows <= LIMITS["vocab_size"]:
        raise CheckpointError(f"tensor 'token_embd.weight' has {rows} rows, expected "
                              f"1..{LIMITS['vocab_size']} (one per token)")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > rows:
        raise CheckpointError(f"GGUF vocabulary has {len(tokens)} tokens but token_embd "
                              f"has only {rows} rows")
    return rows


def _gather_weights(config: ModelConfig, tensors: Dict[str, Any], fallback: Optional[str],
                    big_endian: bool, cost: "_DequantizeCost") -> Weights:
    # Every tensor is found and checked before anything is allocated: the sizes come from
    # metadata, and a corrupt block_count or embedding_length must not allocate gigabytes
    # for tensors the file does not have. Once all of them match, a kept matrix takes the
    # bytes it has in the file, a dequantized one a bounded multiple of them (at most
    # 32 / 1.125 = 28x: Q1_0 stored as fp32), and float32 norms twice their F16 bytes.
    expected = Weights.expected_shapes(config)
    found: Dict[str, List[Any]] = {}
    for key, gguf_name in GGUF_GLOBAL_NAMES.items():
        if key == "classifier" and config.tied_embeddings:
            continue
        found[key] = [_tensor(tensors, gguf_name, expected[key])]
    for key, pattern in GGUF_LAYER_NAMES.items():
        found[key] = [_tensor(tensors, pattern.format(i=i), expected[key][1:])
                      for i in range(config.n_layers)]
    _refuse_unused(tensors, {tensor.name for parts in found.values() for tensor in parts},
                   config)
    arrays: Dict[str, np.ndarray] = {}
    for key, parts in found.items():
        per_layer = key in GGUF_LAYER_NAMES
        if key in MATRICES:
            arrays[key] = _matrix(parts, expected[key], per_layer, fallback, big_endian, cost)
        else:
            norm = np.empty(expected[key], dtype=np.float32)
            for target, tensor in zip(_layers(norm, per_layer), parts):
                target[...] = _float32_values(tensor, np.asarray(tensor.data), big_endian)
            arrays[key] = norm
    if config.tied_embeddings:
        arrays["classifier"] = arrays["token_embedding"]  # one array, two names
    weights = Weights(**arrays)
    weights.check(config)
    return weights


def _refuse_unused(tensors: Dict[str, Any], used: set, config: ModelConfig) -> None:
    """Every tensor of the file must be one the model reads, as llama.cpp requires ("wrong
    number of tensors"): a file whose llama.block_count is smaller than its blocks would
    otherwise load as a smaller model, silently, and an unknown tensor (a bias, another
    architecture's weight) would be left out of the computation it belongs to."""
    unused = [name for name in tensors if name not in used]
    if not unused:
        return
    blocks = sorted({int(parts[1]) for parts in (name.split(".") for name in unused)
                     if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
                     and int(parts[1]) >= config.n_layers})
    listed = ", ".join(_short(name) for name in unused[:4])
    more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
    why = (f"; 'llama.block_count' is {config.n_layers} but the file has tensors for block "
           f"{blocks[0]}" + (f" to {blocks[-1]}" if len(blocks) > 1 else "")
           if blocks else "")
    raise CheckpointError(f"wrong number of tensors: the file has {len(tensors)}, the model "
                          f"its metadata describes reads {len(used)}; {len(unused)} would be "
                          f"left unused ({listed}{more}){why}. kvlab reads a whole file or "
                          "none of it")


def _tensor(tensors: Dict[str, Any], name: str, shape: Tuple[int, ...]) -> Any:
    """The gguf tensor `name`, checked to have NumPy shape `shape` (its type was checked to
    be a GGML type, with rows of whole blocks, by check_header)."""
    tensor = tensors.get(name)
    if tensor is None:
        raise CheckpointError(f"GGUF file lacks tensor {name!r}")
    numpy_shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml ne -> row-major
    if numpy_shape != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(numpy_shape)} (GGUF ne "
                              f"{[int(n) for n in tensor.shape]}), the metadata implies {list(shape)}")
    return tensor


def _layers(stacked: np.ndarray, per_layer: bool) -> List[np.ndarray]:
    """The views of `stacked` that the GGUF tensors of one weight fill: one per layer, or
    the whole array for a global tensor."""
    return list(stacked) if per_layer else [stacked]


def _matrix(parts: List[Any], shape: Tuple[int, ...], per_layer: bool,
            fallback: Optional[str], big_endian: bool, cost: "_DequantizeCost") -> np.ndarray:
    """A new stacked array of a matrix's GGUF tensors (one per layer, or one): in their own
    format when all have the same type the core reads, else dequantized into the fallback.
    Always a copy, so no weight points into gguf's memory map of the file once the reader
    is gone, and the file may change after loading."""
    kinds = {tensor.tensor_type.name for tensor in parts}
    kept = _KEPT_TYPES.get(next(iter(kinds))) if len(kinds) == 1 else None
    if kept is not None:
        stacked = weight_formats.empty(shape, kept)
        for target, tensor in zip(_layers(stacked, per_layer), parts):
            _copy_kept(target, tensor, kept, big_endian)
        return stacked
    fmt = _fallback_format(fallback, shape[-1])
    stacked = weight_formats.empty(shape, fmt)
    start = time.perf_counter()
    for target, tensor in zip(_layers(stacked, per_layer), parts):
        _dequantize_into(target, tensor, fmt, big_endian)
    cost.add(parts, stacked, time.perf_counter() - start)
    return stacked


def _fallback_format(requested: Optional[str], in_dim: int) -> str:
    """The format a dequantized matrix is stored in: the one asked for, else q8_0 (the
    fewest bytes the core reads), unless its rows are not whole Q8_0 blocks: then fp16."""
    fmt = requested or "q8_0"
    if fmt == "q8_0" and in_dim % weight_formats.Q8_0_BLOCK:
        return "fp16"
    return fmt


def _copy_kept(target: np.ndarray, tensor: Any, fmt: str, big_endian: bool) -> None:
    """Fill `target` (stored in `fmt`, the format of the tensor's type) with the tensor."""
    data = np.asarray(tensor.data)
    if fmt in ("fp32", "fp16"):
        # gguf gives F32 and F16 typed, in the file's byte order; assigning converts it
        target[...] = data.reshape(target.shape)
        return
    # BF16, Q8_0, Q4_0 and Q4_1 come as raw bytes, (rows, bytes a row): the format's bytes
    _refuse_big_endian(tensor, big_endian)
    target_bytes = target.view(np.uint8)
    target_bytes[...] = data.reshape(target_bytes.shape)


def _dequantize_into(target: np.ndarray, tensor: Any, fmt: str, big_endian: bool) -> None:
    """Fill `target` (stored in `fmt`) with a tensor of any type, dequantized a chunk of
    rows at a time."""
    data = np.asarray(tensor.data)
    rows_in = data.reshape(-1, data.shape[-1])             # the file's rows: values or bytes
    rows_out = target.reshape(-1, target.shape[-1])        # a view: target is contiguous
    in_dim = weight_formats.logical_shape(target)[-1]
    step = max(1, _DEQUANTIZE_CHUNK_BYTES // (4 * in_dim))
    # A corrupt block's scale can make infinities or NaNs: Weights.check_finite names the
    # weight and layer afterwards, so NumPy's overflow and cast warnings would only be noise.
    with np.errstate(over="ignore", invalid="ignore"):
        for first in range(0, len(rows_in), step):
            values = _float32_values(tensor, rows_in[first:first + step], big_endian)
            rows_out[first:first + step] = weight_formats.stored(values, fmt)


def _float32_values(tensor: Any, data: np.ndarray, big_endian: bool) -> np.ndarray:
    """The float32 values of `data` (the tensor's data, or some of its rows), whatever the
    tensor's type: always a new array."""
    if data.dtype.kind == "f":  # F32, F16, F64: typed, in the file's byte order
        return data.astype(np.float32)
    kind = tensor.tensor_type.name
    _refuse_big_endian(tensor, big_endian)
    try:
        from gguf.quants import dequantize
    except ImportError:  # gguf releases before the NumPy dequantizers (2024)
        raise CheckpointError(f"tensor {tensor.name!r} has type {kind}, and this gguf package "
                              "cannot dequantize it: pip install -U gguf") from None
    try:
        return dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"tensor {tensor.name!r} has type {kind}, which the gguf package "
                              "cannot dequantize (kvlab reads F32, F16, BF16, Q8_0, Q4_0 and "
                              "Q4_1 as they are, and dequantizes the types gguf.quants knows)") from None


def _big_endian(reader: Any) -> bool:
    """Whether the file was written big-endian: its version's low half is then 0 (the rule
    of check_header and of gguf's reader)."""
    return int.from_bytes(bytes(reader.data[4:8]), "little") & 0xFFFF == 0


def _refuse_big_endian(tensor: Any, big_endian: bool) -> None:
    # gguf gives every type but F32/F16 (and the integers) as raw bytes, with no byte order
    # applied, and its tools disagree on whether a big-endian file swaps the halves inside
    # BF16 values and quantized blocks: reading them either way could be wrong, silently.
    if big_endian:
        raise CheckpointError(f"tensor {tensor.name!r} has type {tensor.tensor_type.name} in a "
                              "big-endian GGUF file; kvlab reads only F32 and F16 tensors "
                              "from big-endian files")


class _DequantizeCost:
    """What dequantizing took, over all matrices, for the one warning that says so."""

    def __init__(self) -> None:
        self.types: Dict[str, int] = {}       # GGUF type -> tensors of it dequantized
        self.formats: List[str] = []          # kvlab formats they were stored in
        self.tensors = self.file_bytes = self.stored_bytes = 0
        self.seconds = 0.0

    def add(self, parts: List[Any], stacked: np.ndarray, seconds: float) -> None:
        for tensor in parts:
            kind = tensor.tensor_type.name
            self.types[kind] = self.types.get(kind, 0) + 1
            self.file_bytes += int(tensor.n_bytes)
        self.tensors += len(parts)
        fmt = weight_formats.format_of(stacked)
        if fmt not in self.formats:
            self.formats.append(fmt)
        self.stored_bytes += stacked.nbytes
        self.seconds += seconds

    def summary(self) -> str:
        kinds = sorted(self.types)
        if len(kinds) == 1:
            types = f"of type {kinds[0]}"
        else:
            listed = [f"{kind} ({self.types[kind]})" for kind in kinds]
            types = f"of types {', '.join(listed[:-1])} and {listed[-1]}"
        formats = " and ".join(self.formats)
        return (f"dequantized {self.tensors} GGUF tensors {types} with the gguf package "
                f"in {self.seconds:.2f} s (kvlab's core reads F32, F16, BF16, Q8_0, Q4_0 and "
                f"Q4_1 as they are, one type for all layers of a matrix); stored as {formats}, they take "
                f"{_bytes_text(self.stored_bytes)}, against {_bytes_text(self.file_bytes)} in "
                f"the file ({self.stored_bytes / max(1, self.file_bytes):.2f}x). "
                "kvlab.load(path, weights=...) chooses the format they are stored in.")


def _bytes_text(n: int) -> str:
    """1,234 bytes; 12.3 MiB"""
    if n < 1 << 20:
        return f"{n:,} bytes"
    return f"{n / (1 << 30):,.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


def _stacklevel_outside_kvlab() -> int:
    """The stacklevel that points a warning, given by the function calling this, at the
    first caller outside kvlab: the user's line, whether it called kvlab.load,
    load_checkpoint or load_gguf."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "kvlab":
        frame, level = frame.f_back, level + 1
    return level


def _embedded_tokenizer(reader: Any) -> Optional[Any]:
    """The file's own tokenizer ('llama' and 'gpt2' vocabularies, kvlab.gguf_tokenizer); None
    when it has no vocabulary, or one of a kind kvlab does not build (a one-line warning
    names it: the weights are still usable with token ids)."""
    if _gguf_value(reader, "tokenizer.ggml.model") is None:
        return None
    try:
        return gguf_tokenizer.from_gguf(reader)
    except gguf_tokenizer.UnsupportedVocabulary as exc:
        warnings.warn(f"{exc}; the model is loaded without a tokenizer",
                      stacklevel=_stacklevel_outside_kvlab())
        return None
    except TokenizerError as exc:
        raise CheckpointError(f"the GGUF file's embedded vocabulary is unusable: {exc}") from None
