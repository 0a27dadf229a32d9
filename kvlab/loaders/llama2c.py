"""Read and write llama2.c checkpoints (.bin): the legacy format and "version 1".

Both are a small header followed by raw little-endian float32 arrays, so we can hand out
NumPy views of a read-only memory map: loading is instant and nothing is copied (or, with
mmap=False, read each array into memory of its own). Every size is checked against the
header *before* anything is mapped or read, so a corrupt header cannot make us allocate or
read gigabytes; only regular files are opened. Every byte is accounted for: the file must
be exactly as long as its header says (a byte short or a byte extra is refused by count),
and a version-1 header's padding must be zeros. Not here: int8 "version 2" files (refused
with a clear error), tokenizers (kvlab.tokenizer), format detection (kvlab.loaders).

Legacy layout ("version 0"):
    7 x int32   dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
                (vocab_size < 0 means an untied classifier is stored at the end)
    float32     token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final,
                freq_cis_real, freq_cis_imag (precomputed RoPE tables; skipped), [wcls]
Version 1 layout:
    uint32 magic 0x616b3432 ("ak42"), int32 version = 1, the same 7 x int32,
    uint8 shared_classifier, zero padding to 256 bytes (a non-zero byte there is refused)
    float32     rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo, w1, w2, w3, [wcls]
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Tuple

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, WeightsError
from ..weights import Weights
from ..files import (GUARD_ATTRIBUTE, LIMITS, MappedFile, config_error_in, open_regular,
                     read_json_object, signature)

MAGIC_V1 = 0x616B3432          # "ak42" read as a little-endian uint32
HEADER_V1_BYTES = 256
HEADER_LEGACY_BYTES = 7 * 4
GGUF_MAGIC = b"GGUF"

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                 "vocab_size", "max_seq_len")

# Order of the float32 arrays after each header ("rope_tables" is skipped when reading).
LEGACY_ORDER = ("token_embedding", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm",
                "w1", "w2", "w3", "final_norm", "rope_tables")
V1_ORDER = ("attn_norm", "ffn_norm", "final_norm", "token_embedding",
            "wq", "wk", "wv", "wo", "w1", "w2", "w3")


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def load_llama2c(path: "str | os.PathLike[str]", name: Optional[str] = None,
                 mmap: bool = True, **overrides: object) -> Tuple[ModelConfig, Weights]:
    """Config and weights of a llama2.c .bin (legacy or version 1).

    mmap=True hands out read-only views of a memory map of the file (nothing is copied;
    the weights remember the file's identity, see Weights.check_source); mmap=False reads
    the weights into arrays of their own, so later changes to the file cannot reach them.
    `overrides` replace ModelConfig fields the format does not store (norm_eps,
    rope_theta, rope_interleaved, name), e.g. from a JSON sidecar.
    """
    path = Path(path)
    with open_regular(path, "checkpoint") as f:
        st = os.fstat(f.fileno())
        header, version = _read_header(f, path, st.st_size)
        shared, fields = header
        config = _config_from_header(path, fields, shared, name or path.stem, overrides)
        order = V1_ORDER if version == 1 else LEGACY_ORDER
        offset = HEADER_V1_BYTES if version == 1 else HEADER_LEGACY_BYTES
        shapes = _array_shapes(config, order)
        _check_size(path, st.st_size, offset, shapes)
        if mmap:
            return config, _map_weights(f, path, st, offset, shapes, config)
        return config, _read_weights(f, path, st, offset, shapes, config)


def _read_header(f: BinaryIO, path: Path, file_size: int
                 ) -> Tuple[Tuple[bool, Dict[str, int]], int]:
    """((shared_classifier, the 7 header ints), version) without trusting any of them yet."""
    head = f.read(HEADER_V1_BYTES)
    if len(head) < HEADER_LEGACY_BYTES:
        raise CheckpointError(f"{path}: file is {file_size} bytes, too short for even the "
                              f"{HEADER_LEGACY_BYTES}-byte llama2.c header")
    if head[:4] == GGUF_MAGIC:
        raise CheckpointError(f"{path} is a GGUF file, not a llama2.c checkpoint "
                              "(use kvlab.loaders.load_checkpoint or kvlab.loaders.gguf)")
    (magic,) = struct.unpack_from("<I", head, 0)
    if magic == MAGIC_V1:
        return _read_v1_header(path, head), 1
    values = struct.unpack_from("<7i", head, 0)
    fields = dict(zip(HEADER_FIELDS, values))
    # Legacy files say "untied" by a negative vocab_size.
    shared = fields["vocab_size"] > 0
    fields["vocab_size"] = abs(fields["vocab_size"])
    _check_header_values(path, fields, legacy=True)
    return (shared, fields), 0


def _read_v1_header(path: Path, head: bytes) -> Tuple[bool, Dict[str, int]]:
    if len(head) < HEADER_V1_BYTES:
        raise CheckpointError(f"{path}: truncated header: version-1 files start with a "
                              f"{HEADER_V1_BYTES}-byte header, found only {len(head)} bytes")
    (version,) = struct.unpack_from("<i", head, 4)
    if version != 1:
        what = " (int8-quantized Q8_0)" if version == 2 else ""
        raise CheckpointError(f"{path}: unsupported llama2.c checkpoint version {version}{what}; "
                              "kvlab reads the legacy format and version 1 (float32)")
    fields = dict(zip(HEADER_FIELDS, struct.unpack_from("<7i", head, 8)))
    flag = head[36]
    if flag not in (0, 1):
        raise CheckpointError(f"{path}: shared_classifier byte is {flag}, expected 0 or 1; "
                              "the header is corrupt")
    padding = head[37:HEADER_V1_BYTES]
    if padding.strip(b"\0"):
        first = 37 + next(i for i, byte in enumerate(padding) if byte)
        raise CheckpointError(f"{path}: byte {first} of the version-1 header is "
                              f"{head[first]}, expected 0: bytes 37..255 are zero padding, "
                              "which holds nothing (the header is corrupt, or this is "
                              "another format)")
    _check_header_values(path, fields, legacy=False)
    return bool(flag), fields


def _check_header_values(path: Path, fields: Dict[str, int], legacy: bool) -> None:
    for key, value in fields.items():
        if not 0 < value <= LIMITS[key]:
            hint = (" The first 4 bytes are not the version-1 magic 'ak42' either, so this is "
                    "probably not a llama2.c checkpoint." if legacy else "")
            raise CheckpointError(f"{path}: implausible header value {key}={value} "
                                  f"(expected 1..{LIMITS[key]}).{hint}")
    if fields["dim"] % fields["n_heads"] != 0:
        raise CheckpointError(f"{path}: dim={fields['dim']} is not a multiple of "
                              f"n_heads={fields['n_heads']}; llama2.c needs head_size = dim / n_heads")


def _config_from_header(path: Path, fields: Dict[str, int], shared: bool, name: str,
                        overrides: Dict[str, object]) -> ModelConfig:
    settings = dict(norm_eps=1e-5, rope_theta=10000.0, rope_interleaved=True, name=name)
    settings.update(overrides)
    try:
        return ModelConfig(**fields, tied_embeddings=shared, **settings)
    except ConfigError as exc:  # sizes that clash, or a setting from overrides
        raise config_error_in(exc, str(path), {}) from None


def _array_shapes(config: ModelConfig, order: Tuple[str, ...]) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every float32 array in file order, the classifier last if untied."""
    expected = Weights.expected_shapes(config)
    # Two RoPE tables (real, imaginary), seq_len x head_size/2 each, in legacy files only.
    expected["rope_tables"] = (2, config.max_seq_len, config.head_dim // 2)
    shapes = [(name, expected[name]) for name in order]
    if not config.tied_embeddings:
        shapes.append(("classifier", expected["classifier"]))
    return shapes


def _check_size(path: Path, file_size: int, offset: int,
                shapes: List[Tuple[str, Tuple[int, ...]]]) -> None:
    expected = offset + 4 * sum(int(np.prod(shape, dtype=object)) for _, shape in shapes)
    if file_size < expected:
        raise CheckpointError(f"{path}: truncated checkpoint: the header promises "
                              f"{expected:,} bytes but the file has {file_size:,} "
                              f"({expected - file_size:,} missing)")
    if file_size > expected:
        raise CheckpointError(f"{path}: {file_size - expected:,} unexpected bytes after the "
                              f"weights (expected {expected:,} bytes, found {file_size:,}); "
                              "the header does not describe this file")


def _map_weights(f: BinaryIO, path: Path, st: os.stat_result, offset: int,
                 shapes: List[Tuple[str, Tuple[int, ...]]], config: ModelConfig) -> Weights:
    """Read-only float32 views into one memory map of the file: nothing is copied. The map
    carries a MappedFile, so that the model can tell when the file changes under it."""
    total = sum(math.prod(shape) for _, shape in shapes)
    floats = np.memmap(f, dtype="<f4", mode="r", offset=offset, shape=(total,))
    floats.filename = path.resolve()  # as np.memmap(path) would say (f is a descriptor)
    setattr(floats, GUARD_ATTRIBUTE, MappedFile(path, f))
    arrays: Dict[str, np.ndarray] = {}
    start = 0
    for name, shape in shapes:
        count = math.prod(shape)
        # np.asarray drops the memmap subclass (so arithmetic gives plain arrays) but
        # keeps it as .base, which keeps the mapping alive as long as the view lives.
        arrays[name] = np.asarray(floats[start:start + count]).reshape(shape)
        start += count
    return _weights(arrays, config)


def _read_weights(f: BinaryIO, path: Path, st: os.stat_result, offset: int,
                  shapes: List[Tuple[str, Tuple[int, ...]]], config: ModelConfig) -> Weights:
    """Each weight read into an array of its own (mmap=False): the file can change or go
    away afterwards without touching the model."""
    arrays: Dict[str, np.ndarray] = {}
    f.seek(offset)
    for name, shape in shapes:
        if name == "rope_tables":  # not used: skip its bytes
            f.seek(4 * math.prod(shape), os.SEEK_CUR)
            continue
        array = np.empty(shape, dtype="<f4")
        view = memoryview(array).cast("B")
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
        if done != len(view):
            raise CheckpointError(f"{path}: the file shrank while weight {name!r} was being "
                                  f"read ({done:,} of {len(view):,} bytes)")
        arrays[name] = array
    if signature(os.fstat(f.fileno())) != signature(st):
        raise CheckpointError(f"{path} changed while it was being read; load it again")
    return _weights(arrays, config)


def _weights(arrays: Dict[str, np.ndarray], config: ModelConfig) -> Weights:
    arrays.pop("rope_tables", None)
    if config.tied_embeddings:
        arrays["classifier"] = arrays["token_embedding"]
    weights = Weights(**arrays)
    weights.check(config)
    return weights


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------
_DEFAULTS = {"norm_eps": 1e-5, "rope_theta": 10000.0, "rope_interleaved": True}


def save_llama2c_v1(path: "str | os.PathLike[str]", config: ModelConfig, weights: Weights) -> None:
    """Write a version-1 llama2.c checkpoint (float32; a matrix stored in fewer bytes, such
    as fp16 or q8_0, is written as its values).

    The format stores only the seven sizes and the shared-classifier flag. If the config
    has another norm_eps / rope_theta / RoPE layout, those go into a JSON sidecar next to
    the file (`model.bin` -> `model.json`), which kvlab.loaders.load_checkpoint reads back.
    """
    path = Path(path)
    _check_saveable(config, weights)
    _check_not_mapped_from(path, weights)
    weights = weights.float32()
    header = struct.pack("<Ii7iB", MAGIC_V1, 1, config.dim, config.hidden_dim, config.n_layers,
                         config.n_heads, config.n_kv_heads, config.vocab_size,
                         config.max_seq_len, int(config.tied_embeddings))
    order = list(V1_ORDER) + ([] if config.tied_embeddings else ["classifier"])
    with open(path, "wb") as f:
        f.write(header.ljust(HEADER_V1_BYTES, b"\0"))
        for name in order:
            f.write(np.ascontiguousarray(getattr(weights, name), dtype="<f4").tobytes())
    _write_sidecar_if_needed(path, config)


def _check_saveable(config: ModelConfig, weights: Weights) -> None:
    weights.check(config)
    if config.head_dim * config.n_heads != config.dim:
        raise CheckpointError(f"llama2.c files assume head_dim = dim / n_heads; this config has "
                              f"head_dim={config.head_dim}, dim={config.dim}, n_heads={config.n_heads} "
                              "(save it with save_hf_llama instead)")
    if config.rope_scaling is not None:
        raise CheckpointError("llama2.c files cannot store rope_scaling "
                              "(save it with save_hf_llama instead)")
    if config.tied_embeddings and not (weights.classifier is weights.token_embedding
                                       or np.array_equal(weights.classifier, weights.token_embedding)):
        raise WeightsError("config says tied_embeddings but classifier differs from token_embedding")


def _check_not_mapped_from(path: Path, weights: Weights) -> None:
    """Writing truncates the file first: weights mapped from it would lose their bytes
    (SIGBUS) before they were written back."""
    try:
        target = signature(os.stat(path))[:2]
    except OSError:
        return
    if any(source.signature[:2] == target for source in weights.mapped_files):
        raise CheckpointError(f"cannot save over {path}: these weights are memory-mapped from "
                              "it; save elsewhere, or load it with mmap=False first")


def _write_sidecar_if_needed(path: Path, config: ModelConfig) -> None:
    """Record settings the .bin cannot hold; keep other keys of an existing sidecar."""
    sidecar = path.with_suffix(".json")
    existing = read_json_object(sidecar, "sidecar") if sidecar.exists() else None
    non_default = any(getattr(config, k) != v for k, v in _DEFAULTS.items())
    if existing is None and not non_default:
        return
    settings = dict(existing or {})
    settings.update({k: getattr(config, k) for k in _DEFAULTS}, name=config.name)
    sidecar.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")

