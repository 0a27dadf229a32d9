"""Read Llama checkpoints in GGUF format (llama.cpp's file format).

kvlab's own reader parses the container (kvlab.loaders.gguf_file); this module maps its
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

Every count, length, offset and size in a GGUF file is a number the file chooses (the
gguf package's reader believes them: a corrupt array length made it loop for ever, a
tensor's dims wrap around in uint64). kvlab's reader checks each number against the bytes
that are really there as it reads it, and this module takes the model's sizes from the
metadata only once the tensors that must match them are known to exist.

Every tensor and byte is accounted for, as llama.cpp does ("wrong number of tensors"): each
tensor of the file must be one the model its metadata describes reads (a llama.block_count
smaller than the file's blocks, or a tensor of another architecture, is refused by name, not
left unread), each tensor's data starts where the one before ends (padded to the alignment),
and the file ends with the last tensor's data or its padding: a byte more is refused.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import weight_formats
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, TokenizerError
from ..files import LIMITS, config_error_in
from .. import gguf_tokenizer
from ..tokenizer import _gguf_value   # one GGUF field decoder for the package
from ..weights import MATRICES, Weights
from .gguf_file import GGUFFile, GGUFTensor, read_gguf

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
        weights = _gather_weights(config, tensors, weight_format, reader.big_endian, cost)
        tokenizer = _embedded_tokenizer(reader)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except ConfigError as exc:  # a value ModelConfig refuses (rope.freq_base=1e-300 ...)
        raise config_error_in(exc, str(path), _GGUF_KEYS) from None
    if cost.tensors:
        warnings.warn(f"{path}: {cost.summary()}", stacklevel=_stacklevel_outside_kvlab())
    return config, weights, tokenizer


def open_gguf(path: Path) -> GGUFFile:
    """The file read by kvlab's GGUF reader (kvlab.loaders.gguf_file), every number in its
    header checked; its errors name the file."""
    return read_gguf(path)


# kvlab's ModelConfig field -> the GGUF metadata key it comes from, to name the key in errors.
_GGUF_KEYS = {"dim": "llama.embedding_length", "hidden_dim": "llama.feed_forward_length",
              "n_layers": "llama.block_count", "n_heads": "llama.attention.head_count",
              "n_kv_heads": "llama.attention.head_count_kv",
              "max_seq_len": "llama.context_length", "head_dim": "llama.attention.key_length",
              "norm_eps": "llama.attention.layer_norm_rms_epsilon",
              "rope_theta": "llama.rope.freq_base"}


def metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value as plain Python (str, int, float, list)."""
    value = _gguf_value(reader, key)
    return default if value is None else value


def config_from_gguf(reader: GGUFFile, tensors: Dict[str, GGUFTensor],
                     name: str = "") -> ModelConfig:
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


def _reject_rope_scaling(reader: GGUFFile, tensors: Dict[str, GGUFTensor]) -> None:
    kind = metadata(reader, "llama.rope.scaling.type", "none")
    if kind != "none" or "rope_freqs.weight" in tensors:
        raise CheckpointError("RoPE scaling in GGUF files (rope.scaling.type / rope_freqs) "
                              "is not supported; load the Hugging Face checkpoint instead")


def _vocab_size(reader: GGUFFile, tensors: Dict[str, GGUFTensor]) -> int:
    """Rows of token_embd (the weights decide); the token list may be shorter, not longer."""
    embd = tensors.get(GGUF_GLOBAL_NAMES["token_embedding"])
    if embd is None:
        raise CheckpointError("GGUF file lacks tensor 'token_embd.weight'")
    rows = embd.ne[-1]  # ne is reversed: the last entry is the row count
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


def _tensor(tensors: Dict[str, GGUFTensor], name: str, shape: Tuple[int, ...]) -> GGUFTensor:
    """The GGUF tensor `name`, checked to have NumPy shape `shape` (its type was checked to
    be a GGML type, with rows of whole blocks, by the reader)."""
    tensor = tensors.get(name)
    if tensor is None:
        raise CheckpointError(f"GGUF file lacks tensor {name!r}")
    numpy_shape = tuple(reversed(tensor.ne))  # ggml ne -> row-major
    if numpy_shape != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(numpy_shape)} (GGUF ne "
                              f"{list(tensor.ne)}), the metadata implies {list(shape)}")
    return tensor


def _layers(stacked: np.ndarray, per_layer: bool) -> List[np.ndarray]:
    """The views of `stacked` that the GGUF tensors of one weight fill: one per layer, or
    the whole array for a global tensor."""
    return list(stacked) if per_layer else [stacked]


def _matrix(parts: List[GGUFTensor], shape: Tuple[int, ...], per_layer: bool,
            fallback: Optional[str], big_endian: bool, cost: "_DequantizeCost") -> np.ndarray:
    """A new stacked array of a matrix's GGUF tensors (one per layer, or one): in their own
    format when all have the same type the core reads, else dequantized into the fallback.
    Always a copy, so no weight points into the reader's memory map of the file once it
    is gone, and the file may change after loading."""
    kinds = {tensor.type_name for tensor in parts}
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


def _copy_kept(target: np.ndarray, tensor: GGUFTensor, fmt: str, big_endian: bool) -> None:
    """Fill `target` (stored in `fmt`, the format of the tensor's type) with the tensor."""
    data = np.asarray(tensor.data)
    if fmt in ("fp32", "fp16"):
        # the reader gives F32 and F16 typed, in the file's byte order; assigning converts it
        target[...] = data.reshape(target.shape)
        return
    # BF16, Q8_0, Q4_0 and Q4_1 come as raw bytes, (rows, bytes a row): the format's bytes
    _refuse_big_endian(tensor, big_endian)
    target_bytes = target.view(np.uint8)
    target_bytes[...] = data.reshape(target_bytes.shape)


def _dequantize_into(target: np.ndarray, tensor: GGUFTensor, fmt: str, big_endian: bool) -> None:
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


def _float32_values(tensor: GGUFTensor, data: np.ndarray, big_endian: bool) -> np.ndarray:
    """The float32 values of `data` (the tensor's data, or some of its rows), whatever the
    tensor's type: always a new array."""
    if data.dtype.kind == "f":  # F32, F16, F64: typed, in the file's byte order
        return data.astype(np.float32)
    kind = tensor.type_name
    _refuse_big_endian(tensor, big_endian)
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:  # gguf releases before the NumPy dequantizers (2024)
        raise CheckpointError(f"tensor {tensor.name!r} has type {kind}, and this gguf package "
                              "cannot dequantize it: pip install -U gguf") from None
    try:
        return dequantize(data, GGMLQuantizationType(tensor.kind))
    except NotImplementedError:
        raise CheckpointError(f"tensor {tensor.name!r} has type {kind}, which the gguf package "
                              "cannot dequantize (kvlab reads F32, F16, BF16, Q8_0, Q4_0 and "
                              "Q4_1 as they are, and dequantizes the types gguf.quants knows)") from None


def _refuse_big_endian(tensor: GGUFTensor, big_endian: bool) -> None:
    # gguf gives every type but F32/F16 (and the integers) as raw bytes, with no byte order
    # applied, and its tools disagree on whether a big-endian file swaps the halves inside
    # BF16 values and quantized blocks: reading them either way could be wrong, silently.
    if big_endian:
        raise CheckpointError(f"tensor {tensor.name!r} has type {tensor.type_name} in a "
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
            kind = tensor.type_name
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


def _embedded_tokenizer(reader: GGUFFile) -> Optional[Any]:
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
