"""The weights of a Llama-family model as named NumPy arrays.

Every loader (llama2.c .bin, Hugging Face safetensors, GGUF) produces a `Weights`, and
both the C core and `kvlab.reference` read one. Per-layer tensors are stacked along a
leading n_layers axis, the llama2.c layout, so one pointer reaches every layer. Matrices
are stored (out_features, in_features): y = W @ x. The norm vectors are float32; each
matrix may be stored in fewer bytes (fp16, bf16, Q8_0, Q4_0, Q4_1: kvlab.weight_formats,
whose dtype says which), and `converted()` stores them so, `float32()` gives their values
back. This module checks shapes; it does not load files (kvlab.loaders) or run anything
(kvlab.model, kvlab.reference). Arrays may be views of a memory-mapped checkpoint:
check_source() says whether that file is still the one they were mapped from.

A block-format matrix (Q8_0, Q4_0, Q4_1) is refused when one of its block scales (d, and
Q4_1's m) is NaN or infinite, as soon as the Weights are made, converted or checked: with
int8 activations such a block can give finite but wrong logits, without a word. pinned()
keeps the arrays handed to the C core from being resized (ndarray.resize with refcheck=False
would free the memory the core reads).
"""
from __future__ import annotations

import dataclasses
import operator
import weakref
from typing import Dict, Iterator, List, Tuple

import numpy as np

from . import arguments, weight_formats
from .config import ModelConfig
from .errors import WeightsError
from .files import mapped_files


PER_LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")
MATRICES = ("token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "classifier")


@dataclasses.dataclass
class Weights:
    # shapes of the float32 values; a block-format matrix's array has in_dim / 32 blocks a row
    token_embedding: np.ndarray  # (vocab_size, dim)
    attn_norm: np.ndarray        # (n_layers, dim)            RMSNorm before attention
    wq: np.ndarray               # (n_layers, n_heads * head_dim, dim)
    wk: np.ndarray               # (n_layers, n_kv_heads * head_dim, dim)
    wv: np.ndarray               # (n_layers, n_kv_heads * head_dim, dim)
    wo: np.ndarray               # (n_layers, dim, n_heads * head_dim)
    ffn_norm: np.ndarray         # (n_layers, dim)            RMSNorm before the MLP
    w1: np.ndarray               # (n_layers, hidden_dim, dim) gate projection
    w2: np.ndarray               # (n_layers, dim, hidden_dim) down projection
    w3: np.ndarray               # (n_layers, hidden_dim, dim) up projection
    final_norm: np.ndarray       # (dim,)
    classifier: np.ndarray       # (vocab_size, dim); the same array as token_embedding when tied

    def __post_init__(self) -> None:
        # a block-format matrix with a NaN or infinite scale is refused when it is made
        # (and when converted: converted() makes new Weights); arrays of other kinds are
        # check()'s to judge
        self.check_block_scales()

    @staticmethod
    def expected_shapes(c: ModelConfig) -> Dict[str, Tuple[int, ...]]:
        L = c.n_layers
        return {
            "token_embedding": (c.vocab_size, c.dim),
            "attn_norm": (L, c.dim),
            "wq": (L, c.q_dim, c.dim),
            "wk": (L, c.kv_dim, c.dim),
            "wv": (L, c.kv_dim, c.dim),
            "wo": (L, c.dim, c.q_dim),
            "ffn_norm": (L, c.dim),
            "w1": (L, c.hidden_dim, c.dim),
            "w2": (L, c.dim, c.hidden_dim),
            "w3": (L, c.hidden_dim, c.dim),
            "final_norm": (c.dim,),
            "classifier": (c.vocab_size, c.dim),
        }

    def items(self) -> Iterator[Tuple[str, np.ndarray]]:
        for field in dataclasses.fields(self):
            yield field.name, getattr(self, field.name)

    @property
    def mapped_files(self) -> tuple:
        """The checkpoint files these arrays are memory-mapped from (kvlab.files.
        MappedFile), () when every array has memory of its own."""
        arrays = _all_arrays(self)
        cached = self.__dict__.get("_mapped")
        # found once; again if an array is replaced, or in a copy of this object (whose
        # arrays copy.deepcopy copied out of the map)
        if cached is None or cached[0] != id(self) or not all(map(operator.is_, cached[1],
                                                                  arrays)):
            cached = (id(self), arrays, mapped_files(arrays))
            self.__dict__["_mapped"] = cached
        return cached[2]

    def check_source(self) -> None:
        """Raise CheckpointError if a file these weights are memory-mapped from has been
        truncated or rewritten in place since it was mapped: reading the weights
        then would crash the process (SIGBUS) or silently use other numbers. One os.fstat
        per mapped file, cheap enough for every forward call; nothing for weights in memory
        of their own (Hugging Face, GGUF, kvlab.load(..., mmap=False))."""
        for source in self.mapped_files:
            source.check()

    @property
    def nbytes(self) -> int:
        """Bytes of weight memory, counting a tied classifier once."""
        seen, total = set(), 0
        for _, array in self.items():
            if id(array) not in seen:
                seen.add(id(array))
                total += array.nbytes
        return total

    @property
    def formats(self) -> Dict[str, str]:
        """Each matrix's format ('fp32', 'fp16', 'bf16', 'q8_0', 'q4_0', 'q4_1'), by name."""
        return {name: weight_formats.format_of(getattr(self, name)) for name in MATRICES}

    @property
    def format(self) -> str:
        """The matrices' format when they share one, else 'mixed'."""
        formats = set(self.formats.values())
        return formats.pop() if len(formats) == 1 else "mixed"

    def converted(self, fmt: str) -> "Weights":
        """These weights with every matrix stored in `fmt` (from its float32 values; one
        already in fmt is kept as it is, a tied classifier stays tied). The norm vectors
        stay float32."""
        for name in MATRICES:   # every matrix checked before any is converted
            try:
                in_dim = weight_formats.logical_shape(getattr(self, name))[-1]
                weight_formats.check_format(fmt, in_dim)
            except ValueError as exc:
                blocks = fmt in weight_formats.BLOCK_FORMATS
                hint = " (fp16 or bf16 store any row)" if blocks else ""
                raise WeightsError(f"weight {name!r} cannot be stored as {fmt}: {exc}{hint}"
                                   ) from None
        done: Dict[int, np.ndarray] = {}
        arrays = {}
        for name, array in self.items():
            if name not in MATRICES or weight_formats.format_of(array) == fmt:
                arrays[name] = array
            elif id(array) in done:
                arrays[name] = done[id(array)]
            else:
                arrays[name] = done[id(array)] = weight_formats.stored(
                    weight_formats.values(array), fmt)
        return Weights(**arrays)

    def float32(self) -> "Weights":
        """These weights with every matrix as its float32 values (self if all are)."""
        if all(fmt == "fp32" for fmt in self.formats.values()):
            return self
        return self.converted("fp32")

    def check(self, config: ModelConfig) -> None:
        """Raise WeightsError unless every array is C-contiguous and shaped for config: the
        norm vectors float32, each matrix float32 or stored in a kvlab.weight_formats format."""
        for name, shape in self.expected_shapes(config).items():
            array = getattr(self, name)
            if not isinstance(array, np.ndarray):
                raise WeightsError(f"weight {name!r} must be a numpy array, got {type(array).__name__}")
            if name in MATRICES:
                try:
                    fmt = weight_formats.format_of(array)
                    weight_formats.check_format(fmt, shape[-1])
                except ValueError as exc:
                    raise WeightsError(f"weight {name!r}: {exc}") from None
                got = weight_formats.logical_shape(array)
            else:
                if array.dtype != np.float32:
                    raise WeightsError(f"weight {name!r} must be float32, got {array.dtype}")
                got = array.shape
            if got != shape:
                raise WeightsError(f"weight {name!r} has shape {got}, expected {shape}")
            if not array.flags.c_contiguous:
                raise WeightsError(f"weight {name!r} must be C-contiguous")
        self.check_block_scales()

    def check_block_scales(self, source: str = "") -> None:
        """Raise WeightsError naming the first block-format matrix (Q8_0, Q4_0, Q4_1), and
        its layer or row, that holds a NaN or infinite block scale (d, or Q4_1's m). Its
        codes are integers, so these are the only numbers of such a matrix that can be
        non-finite; with int8 activations a NaN scale does not always reach the logits as
        NaN, it can change them silently. Reads only the scales (a sixteenth of a Q8_0
        matrix's bytes, or less), so every Weights made, converted or checked pays it."""
        seen = set()
        for name, array in self.items():
            if name not in MATRICES or id(array) in seen or not isinstance(array, np.ndarray) \
                    or array.ndim == 0:          # not a matrix at all: check() says so
                continue
            seen.add(id(array))
            try:
                fmt = weight_formats.format_of(array)
            except ValueError:           # not a weight format: check() says so
                continue
            if fmt in weight_formats.BLOCK_FORMATS:
                _check_finite_array(name, array, source, fmt)

    def check_finite(self, source: str = "") -> None:
        """Raise WeightsError naming the first tensor (and layer) holding a NaN or an
        infinity: a corrupt checkpoint would otherwise give NaN logits, silently. Reads
        every weight once, a few megabytes at a time."""
        seen = set()
        for name, array in self.items():
            if id(array) in seen:
                continue
            seen.add(id(array))
            _check_finite_array(name, array, source)

    def pinned(self) -> List[weakref.ref]:
        """Weak references to every array of these weights and every array whose memory
        they view (a view's base, its base's base, ...). NumPy refuses to resize an array
        that has a weak reference ("cannot resize an array that references or is referenced
        by another array"), even with refcheck=False, so while the list is kept, none of
        that memory can be freed or moved under a reader that holds its address: the C core
        (kvlab.Model keeps the list for as long as it lives). Nothing is copied. Memory that
        is not an array's (a memory map, bytes, a bytearray) cannot be resized while NumPy
        holds a view of it either."""
        return pin(array for _, array in self.items())

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, scale: float = 0.08) -> "Weights":
        """Random weights for tests and benchmarks (norm weights near 1, matrices small).
        seed: an integer of at least 0; scale: a finite number of at least 0."""
        rng = np.random.default_rng(arguments.integer(seed, "seed", 0, None))
        scale = arguments.real(scale, "scale", low=0.0)
        arrays = {}
        for name, shape in cls.expected_shapes(config).items():
            if name == "classifier" and config.tied_embeddings:
                continue
            if name.endswith("norm"):
                arrays[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                arrays[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
        if config.tied_embeddings:
            arrays["classifier"] = arrays["token_embedding"]
        return cls(**arrays)


def pin(arrays) -> List[weakref.ref]:
    """Weak references to each array in `arrays` and to every array it views (see
    Weights.pinned): NumPy will not resize any of them while a reference lives."""
    pins, seen = [], set()
    for array in arrays:
        while isinstance(array, np.ndarray) and id(array) not in seen:
            seen.add(id(array))
            pins.append(weakref.ref(array))
            array = array.base
    return pins


def _check_finite_array(name: str, array: np.ndarray, source: str = "",
                        fmt: str = "") -> None:
    """WeightsError naming the weight and its first layer (or row) holding a NaN or an
    infinity among the numbers that are its own (_finite_view), a few megabytes at a time."""
    rows = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return
    step = max(1, (4 << 20) // max(1, rows.shape[1] * array.itemsize))
    for first in range(0, rows.shape[0], step):
        chunk = _finite_view(rows[first:first + step])
        finite = np.isfinite(chunk).all(axis=1)
        if not finite.all():
            bad = first + int(np.flatnonzero(~finite)[0])
            where = (f" (layer {bad})" if name in PER_LAYER else
                     f" (row {bad})" if array.ndim > 1 else "")
            prefix = f"{source + ': ' if source else ''}weight {name!r}{where}"
            if not fmt:
                raise WeightsError(f"{prefix} holds NaN or infinite values: the checkpoint "
                                   "is corrupt")
            scales = "d or m" if fmt == "q4_1" else "d"
            raise WeightsError(f"{prefix} holds a NaN or infinite block scale ({fmt}'s "
                               f"{scales}): the weights are corrupt (the block's values would "
                               "be NaN, and with int8 activations the logits finite and "
                               "silently wrong)")


def _finite_view(rows: np.ndarray) -> np.ndarray:
    """Numbers of a chunk of stored rows whose finiteness is theirs: the values of float
    formats, a block's scales (its codes are integers): Q8_0's and Q4_0's d, Q4_1's d and m."""
    fmt = weight_formats.format_of(rows) if rows.dtype != np.float32 else "fp32"
    if fmt in ("q8_0", "q4_0"):
        return rows["d"]
    if fmt == "q4_1":
        return np.concatenate([rows["d"], rows["m"]], axis=-1)
    if fmt == "bf16":
        return weight_formats.values(rows)
    return rows


_all_arrays = operator.attrgetter(*(field.name for field in dataclasses.fields(Weights)))
