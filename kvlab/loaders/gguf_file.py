"""kvlab's reader of the GGUF container (llama.cpp's file format): the header, the metadata as
plain Python values, and the tensor table, each tensor's bytes a NumPy view of the mapped file.

The layout, as the GGUF specification gives it (all numbers little-endian, unless the file
was written on a big-endian machine):
  magic "GGUF", version (u32), tensor count (u64), metadata count (u64)
  metadata entries: key (a string), value type (u32), value
  tensor infos: name (a string), n_dims (u32), dims (u64 each, fastest-varying first),
                GGML type (u32), data offset (u64, from the start of the data)
  padding to the alignment (general.alignment, else 32), then the tensors' data
A string is a u64 length and that many UTF-8 bytes; an array an item type (u32), a count (u64)
and the items. One pass reads it all: a vocabulary of 49,152 tokens and 48,900 merges
(SmolLM2's) takes about 0.1 s, where the gguf package's GGUFReader makes a NumPy view of
every string and number and took about 1.7 s.

Every count, length, offset and size in the file is a number the file chooses, and each is
checked against the bytes really there before it is used: no loop runs longer than the file
is long, nothing is allocated that the file's size does not bound, a length near 2**64 is a
Python integer that no sum wraps. A file that breaks a rule is a CheckpointError naming the
file, the entry and the offset.

Not here: what the metadata and tensors mean for a model (kvlab.loaders.gguf), and the
GGML types kvlab's core does not read, whose sizes and names come from the gguf package
(which dequantizes them: kvlab.loaders.gguf). The tests hold this reader equal to the gguf
package's GGUFReader on every GGUF file they have (tests/test_gguf_file.py).
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import numpy as np

from ..errors import CheckpointError
from ..files import open_regular

# Metadata value types (the specification's gguf_type) whose values are one number, and
# their struct codes. STRING (8) and ARRAY (9) carry their own lengths.
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}
_FLOAT32, _STRING, _ARRAY, _UINT32 = 6, 8, 9, 4
_VERSIONS = (2, 3)         # version 1 had 32-bit counts; gguf reads 2 and 3 only
_MAX_DIMS = 4              # ggml tensors have at most 4 dimensions (GGML_MAX_DIMS)
_DEFAULT_ALIGNMENT = 32    # tensor data starts at a multiple of this, unless general.alignment
# The fewest bytes one entry can take, to refuse a count the rest of the file cannot hold
# before looping over it: a metadata entry is a key length (8), a key (may be empty), a
# value type (4) and a value (1 byte at least); a tensor info is a name length (8), a name,
# n_dims (4), one dim (8), a type (4) and an offset (8).
_MIN_ENTRY_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
# The gguf package files the header's own numbers under these names: a key spelled the same
# would clash with them there, so such a file is refused (gguf's tools would read it
# otherwise than kvlab).
_RESERVED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

# The GGML tensor types kvlab knows itself: id -> (name, values per block, bytes per block,
# NumPy type of the values, for the types stored as plain numbers). The core reads F32, F16,
# BF16, Q8_0, Q4_0 and Q4_1 as they are; the others here are the plain number types. Any
# other id is looked up in the gguf package's tables (only a file with such a type needs it).
_GGML_TYPES: Dict[int, Tuple[str, int, int, Optional[str]]] = {
    0: ("F32", 1, 4, "f4"), 1: ("F16", 1, 2, "f2"), 2: ("Q4_0", 32, 18, None),
    3: ("Q4_1", 32, 20, None), 8: ("Q8_0", 32, 34, None), 24: ("I8", 1, 1, "i1"),
    25: ("I16", 1, 2, "i2"), 26: ("I32", 1, 4, "i4"), 27: ("I64", 1, 8, "i8"),
    28: ("F64", 1, 8, "f8"), 30: ("BF16", 1, 2, None),
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. data: a read-only view of the file's bytes, NumPy shape the
    reverse of ne; plain numbers (F32, F16, F64, the integers) typed, in the file's byte
    order; every other type as uint8, its last axis the bytes of a row of blocks."""
    name: str
    kind: int                   # the GGML type id
    type_name: str              # "F32", "Q8_0", "Q4_K" ...
    ne: Tuple[int, ...]         # dims, fastest-varying first (ggml's ne)
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file read and checked: `values` (key -> str, int, float, bool or list),
    `tensors` in file order, `big_endian`, `alignment`. The tensors' data are views of a
    read-only map of the file, which stays open while any of them is referenced."""

    def __init__(self, path: Path, values: Dict[str, Any], tensors: List[GGUFTensor],
                 big_endian: bool, alignment: int) -> None:
        self.path, self.values, self.tensors = path, values, tensors
        self.big_endian, self.alignment = big_endian, alignment

    def value(self, key: str) -> Any:
        """One metadata value as plain Python, None if the file does not have it."""
        return self.values.get(key)


def read_gguf(path: "str | os.PathLike[str]") -> GGUFFile:
    """The GGUF file at `path`, every number in its header checked (see the module text),
    or a CheckpointError naming what is wrong: a missing or irregular file, a truncated one,
    a count, string or array length running past the end, an unknown value or tensor type,
    a nested array, a duplicate key or tensor name, a bad general.alignment, tensor dims that
    are too many or too large, tensor data not where the layout puts it, or bytes past the
    last tensor's data."""
    path = Path(path)
    with open_regular(path, "checkpoint") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for the 24-byte "
                                  "GGUF header (magic, version, tensor count, metadata count)")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # (outlives the descriptor)
    try:
        return _Reader(data, path).read()
    except BaseException:
        _close_unless_exported(data)
        raise


def _close_unless_exported(data: mmap.mmap) -> None:
    """Closes the map now, unless a view of it is still alive (a traceback's frame may hold
    one): then it closes when that goes."""
    try:
        data.close()
    except BufferError:
        pass


class _Reader:
    """A cursor over the mapped file that refuses to step past its end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0
        self.order = "<"  # little-endian, unless the version says otherwise
        self.alignment = _DEFAULT_ALIGNMENT

    def fail(self, message: str) -> NoReturn:
        raise CheckpointError(f"{self.path}: {message}")

    # ---- the primitives: each checks that its bytes are there before reading them ------
    def skip(self, n: int, what: str) -> int:
        """Steps over n bytes; returns where they start."""
        start, left = self.at, len(self.data) - self.at
        if n > left:
            self.fail(f"{what} needs {n:,} bytes at offset {self.at:,}, but the file ends "
                      f"{left:,} bytes later (it is truncated, or a length in its header "
                      "is corrupt)")
        self.at += n
        return start

    def number(self, code: str, what: str) -> Any:
        start = self.skip(struct.calcsize(code), what)
        return struct.unpack_from(self.order + code, self.data, start)[0]

    def raw_string(self, what: str) -> bytes:
        n = self.number("Q", f"the length of {what}")
        start = self.skip(n, what)
        return self.data[start:self.at]

    def name(self, what: str) -> str:
        """A string that must be valid UTF-8: a key or a tensor name."""
        start = self.at + 8
        try:
            return self.raw_string(what).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {start:,} is not valid UTF-8")

    def check_count(self, count: int, least: int, what: str) -> None:
        left = len(self.data) - self.at
        if count * least > left:
            self.fail(f"the header says {count:,} {what}, but they would take at least "
                      f"{count * least:,} bytes and only {left:,} remain (the file is "
                      "truncated, or the count is corrupt)")

    # ---- the file, part by part ------------------------------------------------------
    def read(self) -> GGUFFile:
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
        values: Dict[str, Any] = {}
        for i in range(n_entries):
            self.metadata_entry(i, values)
        self.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensors")
        names: set = set()
        infos = [self.tensor_info(i, names) for i in range(n_tensors)]
        tensors = self.tensor_data(infos)
        return GGUFFile(self.path, values, tensors, self.order == ">", self.alignment)

    def metadata_entry(self, index: int, values: Dict[str, Any]) -> None:
        key = self.name(f"metadata key #{index}")
        if key in values or key in _RESERVED_KEYS:
            self.fail(f"metadata key {_short(key)} appears twice")
        what = f"metadata {_short(key)}"
        kind = self.number("I", f"the value type of {what}")
        if key == "general.alignment":
            values[key] = self.alignment_value(kind)
        else:
            values[key] = self.value(kind, what)

    def alignment_value(self, kind: int) -> int:
        if kind != _UINT32:
            self.fail(f"metadata 'general.alignment' has value type {kind}, expected {_UINT32} "
                      "(uint32)")
        alignment = self.number("I", "metadata 'general.alignment'")
        if alignment == 0 or alignment & (alignment - 1):
            self.fail(f"metadata 'general.alignment' is {alignment}, expected a power of two")
        self.alignment = alignment
        return alignment

    def value(self, kind: int, what: str) -> Any:
        """One value as plain Python: a float32 as the shortest decimal that gives the same
        float32 (1e-05, not 9.999999747378752e-06: a setting reads better so), a string
        decoded with U+FFFD for bytes that are not UTF-8."""
        if kind == _FLOAT32:
            return float(str(np.float32(self.number("f", what))))
        if kind in _SCALAR_CODES:
            return self.number(_SCALAR_CODES[kind], what)
        if kind == _STRING:
            return self.raw_string(what).decode("utf-8", errors="replace")
        if kind == _ARRAY:
            return self.array(what)
        self.fail(f"{what} has value type {kind}, which GGUF does not define (0..12)")

    def array(self, what: str) -> list:
        item = self.number("I", f"the item type of {what}")
        count = self.number("Q", f"the length of {what}")
        if item in _SCALAR_CODES:
            dtype = np.dtype(self.order + _SCALAR_CODES[item])
            # one check for the whole array, then one read: no loop over a count the file chose
            start = self.skip(count * dtype.itemsize, f"{what} ({count:,} items, "
                              f"{dtype.itemsize} bytes each)")
            return np.frombuffer(self.data, dtype, count, start).tolist()
        if item == _STRING:
            self.check_count(count, 8, f"strings in {what}")  # then the loop is bounded
            return self.strings(count, what)
        if item == _ARRAY:
            self.fail(f"{what} is an array of arrays, which GGUF readers do not support")
        self.fail(f"{what} has item type {item}, which GGUF does not define (0..12)")

    def strings(self, count: int, what: str) -> List[str]:
        """count strings, as raw_string reads them one by one, in one loop with the same
        checks: a vocabulary is 10,000s of strings, and this loop is most of the reading."""
        data, at, end = self.data, self.at, len(self.data)
        length = struct.Struct(self.order + "Q").unpack_from
        items = []
        for i in range(count):
            if at + 8 > end or length(data, at)[0] > end - at - 8:
                self.at = at                    # raw_string then says what runs past the end
                self.raw_string(f"item {i} of {what}")
            n = length(data, at)[0]
            items.append(data[at + 8:at + 8 + n].decode("utf-8", errors="replace"))
            at += 8 + n
        self.at = at
        return items

    def tensor_info(self, index: int, names: set) -> Tuple[str, Tuple[int, ...], int, int]:
        """(name, ne, GGML type, data offset after the header)."""
        name = self.name(f"the name of tensor #{index}")
        if name in names:
            self.fail(f"tensor {_short(name)} appears twice")
        names.add(name)
        quoted = _short(name)  # as the messages below quote it
        n_dims = self.number("I", f"the number of dims of tensor {quoted}")
        if not 1 <= n_dims <= _MAX_DIMS:
            self.fail(f"tensor {quoted} has {n_dims} dims, expected 1 to {_MAX_DIMS}")
        ne = tuple(self.number("Q", f"dim {i} of tensor {quoted}") for i in range(n_dims))
        kind = self.number("I", f"the type of tensor {quoted}")
        try:
            sizes = ggml_type(kind)
        except ImportError:
            self.fail(f"tensor {quoted} has GGML type {kind}, which kvlab reads only with the "
                      "gguf package (it dequantizes the types kvlab's core does not read): "
                      "pip install gguf")
        if sizes is None:
            self.fail(f"tensor {quoted} has type {kind}, which is no GGML tensor type")
        if ne[0] % sizes[1]:
            self.fail(f"tensor {quoted} has a first dim of {ne[0]}, not a multiple of its "
                      f"type's block of {sizes[1]} values")
        offset = self.number("Q", f"the data offset of tensor {quoted}")
        return name, ne, kind, offset

    def tensor_data(self, infos: List[Tuple[str, Tuple[int, ...], int, int]]) -> List[GGUFTensor]:
        """Tensor data follows the header, in the order of the tensor table, each tensor
        padded to the alignment (llama.cpp requires exactly this layout too). So every
        offset is known in advance: one that differs would read another tensor's bytes (an
        overlap, a misaligned start, or an offset near 2**64 that a uint64 sum wraps
        around), silently."""
        start = -(-self.at // self.alignment) * self.alignment  # data begins, aligned
        expected, end, tensors = 0, self.at, []
        for name, ne, kind, offset in infos:
            quoted = _short(name)
            type_name, block, block_bytes, numbers = ggml_type(kind)
            # Python integers: dims near 2**64 multiply to a huge number, not a wrapped one
            n_bytes = math.prod(ne) // block * block_bytes
            if offset != expected:
                self.fail(f"tensor {quoted} has data offset {offset:,}, expected {expected:,} "
                          f"(right after the previous tensor, padded to the alignment of "
                          f"{self.alignment})")
            if start + offset + n_bytes > len(self.data):
                self.fail(f"tensor {quoted} has {n_bytes:,} bytes of data at offset "
                          f"{start + offset:,}, past the end of the file ({len(self.data):,} "
                          "bytes): the file is truncated, or the tensor's dims are corrupt")
            shape = tuple(reversed(ne))
            if numbers is not None:
                dtype = np.dtype(self.order + numbers)
                data = np.frombuffer(self.data, dtype, n_bytes // dtype.itemsize, start + offset)
            else:  # rows of blocks, as bytes: (..., bytes a row)
                data = np.frombuffer(self.data, np.uint8, n_bytes, start + offset)
                shape = shape[:-1] + (ne[0] // block * block_bytes,)
            tensors.append(GGUFTensor(name, kind, type_name, ne, n_bytes, data.reshape(shape)))
            end = start + offset + n_bytes
            expected += -(-n_bytes // self.alignment) * self.alignment
        self.check_file_end(end, _short(infos[-1][0]) if infos else None)
        return tensors

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


def ggml_type(kind: int) -> Optional[Tuple[str, int, int, Optional[str]]]:
    """(name, values per block, bytes per block, NumPy type of plain numbers or None) of a
    GGML tensor type id, or None if it is none: kvlab's own table, else the gguf package's
    (ImportError without it)."""
    if kind in _GGML_TYPES:
        return _GGML_TYPES[kind]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # a type kvlab only dequantizes
    try:
        ggml = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[ggml]
    except (ValueError, KeyError):
        return None
    return ggml.name, block, block_bytes, None


def _short(value: Any) -> str:
    """A key or name for an error message: a corrupt one can be thousands of bytes long."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
