"""Read and write llama2.c checkpoints (.bin): the legacy format and "version 1".

Both are a small header followed by raw little-endian float32 arrays, so we can hand out
NumPy views of a read-only memory map: loading is instant and nothing is copied. Every
size is checked against the header *before* anything is mapped, so a corrupt header
cannot make us allocate or read gigabytes. Not here: int8 "version 2" files (refused
with a clear error), tokenizers (kvlab.tokenizer), format detection (kvlab.loaders).

Legacy layout ("version 0"):
    7 x int32   dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
                (vocab_size < 0 means an untied classifier is stored at the end)
    float32     token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final,
                freq_cis_real, freq_cis_imag (precomputed RoPE tables; skipped), [wcls]
Version 1 layout:
    uint32 magic 0x616b3432 ("ak42"), int32 version = 1, the same 7 x int32,
    uint8 shared_classifier, zero padding to 256 bytes
    float32     rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo, w1, w2, w3, [wcls]
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError, WeightsError
from ..weights import Weights
from .common import LIMITS, read_json_object

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
                 **overrides: object) -> Tuple[ModelConfig, Weights]:
    """Config and memory-mapped weights of a llama2.c .bin (legacy or version 1).

    `overrides` replace ModelConfig fields the format does not store (norm_eps,
    rope_theta, rope_interleaved, name), e.g. from a JSON sidecar.
    """
    path = Path(path)
    file_size = _file_size(path)
    header, version = _read_header(path, file_size)
    shared, fields = header
    config = _config_from_header(fields, shared, name or path.stem, overrides)
    order = V1_ORDER if version == 1 else LEGACY_ORDER
    offset = HEADER_V1_BYTES if version == 1 else HEADER_LEGACY_BYTES
    shapes = _array_shapes(config, order)
    _check_size(path, file_size, offset, shapes)
    return config, _map_weights(path, offset, shapes, config)


def _file_size(path: Path) -> int:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (no such file)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a file")
    return path.stat().st_size


def _read_header(path: Path, file_size: int) -> Tuple[Tuple[bool, Dict[str, int]], int]:
    """((shared_classifier, the 7 header ints), version) without trusting any of them yet."""
    with open(path, "rb") as f:
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


def _config_from_header(fields: Dict[str, int], shared: bool, name: str,
                        overrides: Dict[str, object]) -> ModelConfig:
    settings = dict(norm_eps=1e-5, rope_theta=10000.0, rope_interleaved=True, name=name)
    settings.update(overrides)
    return ModelConfig(**fields, tied_embeddings=shared, **settings)  # ConfigError if sizes clash


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


def _map_weights(path: Path, offset: int, shapes: List[Tuple[str, Tuple[int, ...]]],
                 config: ModelConfig) -> Weights:
    """Read-only float32 views into one memory map of the file: nothing is copied."""
    floats = np.memmap(path, dtype="<f4", mode="r", offset=offset)
    arrays: Dict[str, np.ndarray] = {}
    start = 0
    for name, shape in shapes:
        count = int(np.prod(shape))
        # np.asarray drops the memmap subclass (so arithmetic gives plain arrays) but
        # keeps it as .base, which keeps the mapping alive as long as the view lives.
        arrays[name] = np.asarray(floats[start:start + count]).reshape(shape)
        start += count
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
    """Write a version-1 llama2.c checkpoint (float32).

    The format stores only the seven sizes and the shared-classifier flag. If the config
    has another norm_eps / rope_theta / RoPE layout, those go into a JSON sidecar next to
    the file (`model.bin` -> `model.json`), which kvlab.loaders.load_checkpoint reads back.
    """
    path = Path(path)
    _check_saveable(config, weights)
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


def _write_sidecar_if_needed(path: Path, config: ModelConfig) -> None:
    """Record settings the .bin cannot hold; keep other keys of an existing sidecar."""
    sidecar = path.with_suffix(".json")
    existing = read_json_object(sidecar) if sidecar.is_file() else None
    non_default = any(getattr(config, k) != v for k, v in _DEFAULTS.items())
    if existing is None and not non_default:
        return
    settings = dict(existing or {})
    settings.update({k: getattr(config, k) for k in _DEFAULTS}, name=config.name)
    sidecar.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")

