"""Read and write Hugging Face Llama checkpoints: config.json + *.safetensors.

safetensors is parsed here with NumPy alone, because the format is small enough to read
in a few lines: an 8-byte little-endian header length N, N bytes of JSON describing each
tensor (dtype, shape, data_offsets relative to the end of the header), then raw data.
Every number in the header is checked against the file before any tensor is read, and
every config.json value for its type and against the readers' shared size limits.

Every tensor and byte is accounted for: the tensors' data_offsets must tile each file's data
section exactly (no overlap, no hole, nothing after the last tensor: the safetensors
library's rule), a header key may appear once, a shard index and its shards must agree, and
every tensor must be one the model config.json describes reads (a num_hidden_layers smaller
than the files' layers is refused, not a smaller model). Two kinds are explained instead:
the layers' rotary_emb.inv_freq (computed from rope_theta, as transformers does) and a tied
model's lm_head.weight, which must then equal the embedding.

Not here: PyTorch .bin checkpoints, quantized weights, models other than Llama-like
(llama and mistral), biases, or partial rotary embeddings. A sliding window (Mistral) is
kept in the config: kvlab.generate runs such a model with a SlidingWindow cache policy.
A matrix keeps its dtype, which the core reads as it is: F32, F16 and BF16 become kvlab's
fp32, fp16 and bf16 (kvlab.weight_formats), so a 16-bit checkpoint takes half the memory
of float32 (a matrix whose layers differ in dtype becomes fp32, which holds all three
exactly). The norm vectors become float32. Per-layer tensors are stacked into one array a
matrix, so this loader copies (unlike the llama2.c loader, which maps the file).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import weight_formats
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..tokenizer import HFTokenizer
from ..weights import MATRICES, Weights
from ..files import (LIMITS, config_error_in, is_int, is_number, open_regular,
                     read_json_object, short)

# Bytes per element of every safetensors dtype, so sizes can be checked even for
# tensors we would not read; the three we read (and keep) are in _READABLE.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_READABLE = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_KEPT_FORMATS = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}   # dtype -> weight format
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own limit on the JSON header

_SUPPORTED_TYPES = ("llama", "mistral")


class TensorInfo:
    """Where one tensor lives: file, dtype, shape, absolute byte range (and its name)."""

    def __init__(self, path: Path, dtype: str, shape: Tuple[int, ...], start: int, end: int,
                 name: str = ""):
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end
        self.name = name

    def __repr__(self) -> str:
        return f"TensorInfo({self.path.name}, {self.dtype}, {self.shape}, [{self.start}, {self.end}))"


# ---------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------
def read_safetensors_header(path: "str | os.PathLike[str]") -> Dict[str, TensorInfo]:
    """Every tensor's TensorInfo, after checking the header against the file size."""
    path = Path(path)
    with open_regular(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: header length {header_len:,} runs past the end of "
                                  f"the file ({size:,} bytes); the file is truncated or not safetensors")
        raw = f.read(header_len)
        if len(raw) != header_len:
            raise CheckpointError(f"{path}: the file shrank while its header was being read")
    if not raw.startswith(b"{"):  # as the safetensors library requires
        raise CheckpointError(f"{path}: safetensors header must be a JSON object starting "
                              f"with '{{', it starts with {short(bytes(raw[:8]))}")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path}: tensor {short(exc.args[0])} appears twice in the "
                              "safetensors header (a JSON reader would keep only the last)") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header must be a JSON object")
    _check_metadata(path, header.get("__metadata__"))
    data_start = 8 + header_len
    infos = {name: _tensor_info(path, name, entry, data_start, size)
             for name, entry in header.items() if name != "__metadata__"}
    _check_data_layout(path, infos, data_start, size)
    return infos


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key that appears twice (json.loads keeps
    the last silently: two entries for one tensor, one of them never checked)."""
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _check_metadata(path: Path, metadata: Any) -> None:
    """__metadata__, where there is one, maps strings to strings (the format's rule)."""
    if metadata is None:
        return
    if not (isinstance(metadata, dict)
            and all(isinstance(value, str) for value in metadata.values())):
        raise CheckpointError(f"{path}: '__metadata__' must be an object of strings, got "
                              f"{short(metadata)}")


def _check_data_layout(path: Path, infos: Dict[str, TensorInfo], data_start: int,
                       size: int) -> None:
    """The tensors' byte ranges tile the data section exactly, as the safetensors library
    requires: sorted by offset, each begins where the one before ends (no overlap: two
    tensors sharing bytes; no hole: bytes no tensor accounts for) and the last ends at the
    end of the file (no trailing bytes)."""
    at, previous = data_start, None
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start != at:
            where = (f"tensor {short(previous.name)} ends at byte {at:,}" if previous
                     else f"the data section begins at byte {at:,}")
            if info.start < at:
                problem = (f"tensors {short(previous.name)} and {short(info.name)} overlap: "
                           f"{short(info.name)} begins at byte {info.start:,}, before "
                           f"{short(previous.name)} ends at byte {at:,}")
            else:
                problem = (f"{info.start - at:,} bytes belong to no tensor: {where}, tensor "
                           f"{short(info.name)} begins at byte {info.start:,}")
            raise CheckpointError(f"{path}: {problem} (data_offsets must cover the data "
                                  "section exactly, each tensor after the one before)")
        at, previous = info.end, info
    if at != size:
        after = (f"the last tensor, {short(previous.name)}," if previous
                 else "the header (it lists no tensors)")
        raise CheckpointError(f"{path}: {size - at:,} bytes follow {after} which ends at byte "
                              f"{at:,} of {size:,}; no tensor in the header accounts for them")


def _tensor_info(path: Path, name: str, entry: Any, data_start: int, size: int) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {short(name)}: {why}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    unknown = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if unknown:
        raise bad(f"unknown field {short(unknown[0])} in its header entry (a tensor has "
                  "dtype, shape and data_offsets only)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise bad(f"unknown dtype {short(dtype)}")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise bad(f"shape must be a list of non-negative integers, got {_brief(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got "
                  f"{_brief(offsets)}")
    start, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise bad(f"data ends at byte {end:,}, past the end of the file ({size:,} bytes)")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - start != expected:
        raise bad(f"shape {_brief(shape)} of {dtype} needs {expected:,} bytes, "
                  f"but data_offsets span {end - start:,}")
    return TensorInfo(path, dtype, tuple(shape), start, end, name)


def _brief(value: Any) -> str:
    """A header value for a message: as it is when short, else what short() says of it."""
    text = repr(value)
    return text if len(text) <= 60 else short(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor as a new float32 array (F32, F16 or BF16 on disk)."""
    raw = _read_raw(info)
    if info.dtype == "BF16":
        # bfloat16 is the top half of a float32: put the 16 bits back in the high half.
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    return raw.astype(np.float32, copy=False).reshape(info.shape)


def read_stored(info: TensorInfo) -> np.ndarray:
    """One tensor as a new array in its own weight format (kvlab.weight_formats): float32
    for F32, float16 for F16, BF16_DTYPE for BF16; the bytes of the file, not converted."""
    raw = _read_raw(info)
    if info.dtype == "BF16":
        return raw.view(weight_formats.BF16_DTYPE).reshape(info.shape)
    return raw.reshape(info.shape)


def _read_raw(info: TensorInfo) -> np.ndarray:
    """A tensor's elements as a new flat array of their own dtype (BF16 as uint16)."""
    _check_readable(info)
    count = math.prod(info.shape)
    raw = np.fromfile(info.path, dtype=_READABLE[info.dtype], count=count, offset=info.start)
    if raw.size != count:  # the file shrank since the header was checked
        raise CheckpointError(f"{info.path}: could not read all of a tensor at byte {info.start}")
    return raw


def _check_readable(info: TensorInfo) -> None:
    if info.dtype not in _READABLE:
        raise CheckpointError(f"{info.path}: dtype {info.dtype} is not supported "
                              f"(kvlab reads {', '.join(_READABLE)})")


def write_safetensors(path: "str | os.PathLike[str]", tensors: Dict[str, np.ndarray],
                      dtype: str = "F32") -> None:
    """Write float tensors as one safetensors file, converted to F32, F16 or BF16."""
    if dtype not in _READABLE:
        raise CheckpointError(f"cannot write dtype {dtype!r}; choose one of {', '.join(_READABLE)}")
    blobs, header, offset = [], {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
        blob = _encode(np.asarray(array, dtype=np.float32), dtype)
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def _encode(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return float32_to_bf16_bits(array).tobytes()
    return np.ascontiguousarray(array, dtype=_READABLE[dtype]).tobytes()


def float32_to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the uint16 bits."""
    bits = np.ascontiguousarray(array, dtype="<f4").view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to an even result.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # NaN must stay NaN (rounding could carry it into infinity): keep a quiet NaN.
    rounded = np.where(np.isnan(array), 0x7FC0, rounded)
    return rounded.astype("<u2")


# ---------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------
# kvlab's ModelConfig field -> the config.json key it comes from, to name the key in errors.
_HF_KEYS = {"dim": "hidden_size", "hidden_dim": "intermediate_size",
            "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size",
            "max_seq_len": "max_position_embeddings", "head_dim": "head_dim",
            "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "rope_scaling": "rope_scaling", "tied_embeddings": "tie_word_embeddings",
            "sliding_window": "sliding_window"}
_MISSING = object()


def config_from_hf(hf: Dict[str, Any], name: str = "") -> ModelConfig:
    """A ModelConfig from a Llama-like config.json, refusing what kvlab cannot run.

    Every value is checked for its type (a string, list, null or boolean where a number
    belongs is named, not left to fail in arithmetic) and every size against the same
    plausibility limits as the GGUF and llama2.c readers, before anything is allocated."""
    _check_architecture(hf)
    heads = _size(hf, "num_attention_heads", "n_heads")
    theta, scaling = _rope_settings(hf)
    head_dim = _size(hf, "head_dim", "dim", 0, null_is_default=True)  # 0: dim // n_heads
    try:
        return ModelConfig(
            dim=_size(hf, "hidden_size", "dim"),
            hidden_dim=_size(hf, "intermediate_size", "hidden_dim"),
            n_layers=_size(hf, "num_hidden_layers", "n_layers"),
            n_heads=heads,
            n_kv_heads=_size(hf, "num_key_value_heads", "n_kv_heads", heads, null_is_default=True),
            vocab_size=_size(hf, "vocab_size", "vocab_size"),
            max_seq_len=_max_positions(hf),
            head_dim=head_dim,
            norm_eps=_number(hf, "rms_norm_eps", 1e-6),       # transformers' Llama default
            rope_theta=theta,
            rope_interleaved=False,  # HF stores q/k for the rotate-half layout
            rope_scaling=scaling,
            tied_embeddings=_flag(hf, "tie_word_embeddings"),
            name=name,
            sliding_window=_sliding_window(hf),
        )
    except ConfigError as exc:
        raise config_error_in(exc, "config.json", _HF_KEYS) from None


def _size(hf: Dict[str, Any], key: str, field: str, default: Any = _MISSING,
          null_is_default: bool = False) -> int:
    """An integer size in 1..LIMITS[field]; `default` when absent (if it has one) or null
    (where transformers reads null so too: num_key_value_heads, head_dim)."""
    value = hf.get(key)
    if value is None:
        if key in hf and not null_is_default:
            raise CheckpointError(f"config.json: {key!r} is null, expected an integer")
        if default is _MISSING:
            raise CheckpointError(f"config.json lacks {key!r}")
        return default
    if not is_int(value):
        raise CheckpointError(f"config.json: {key!r} is {short(value)}, expected an integer")
    if not 1 <= value <= LIMITS[field]:
        raise CheckpointError(f"config.json: {key!r} is {value:,}, expected 1..{LIMITS[field]:,}")
    return value


def _max_positions(hf: Dict[str, Any]) -> int:
    return _size(hf, "max_position_embeddings", "max_seq_len", default=2048)  # transformers' default


def _number(hf: Dict[str, Any], key: str, default: float) -> float:
    """A number (int or float, not a bool, a string or null); `default` when absent.
    ModelConfig checks its range."""
    if key not in hf:
        return default
    value = hf[key]
    if not is_number(value):
        raise CheckpointError(f"config.json: {key!r} is {short(value)}, expected a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise CheckpointError(f"config.json: {key!r} is {short(value)}, too large "
                              "for a number") from None


def _flag(hf: Dict[str, Any], key: str) -> bool:
    """true or false (absent or null: false). A string such as "false" is refused, not
    taken as true."""
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key!r} is {short(value)}, expected true or false")
    return value


def _check_architecture(hf: Dict[str, Any]) -> None:
    model_type = hf.get("model_type")
    if model_type not in _SUPPORTED_TYPES:
        raise CheckpointError(f"config.json: 'model_type' is {short(model_type)}, which is not "
                              f"supported; kvlab loads Llama-like models "
                              f"({', '.join(_SUPPORTED_TYPES)})")
    window = hf.get("sliding_window")
    if window is not None and not is_int(window):
        raise CheckpointError(f"config.json: 'sliding_window' is {short(window)}, "
                              "expected an integer or null")
    if window is not None and window < 1:
        raise CheckpointError(f"config.json: 'sliding_window' is {window}: it must be a "
                              "positive number of positions")
    for flag in ("attention_bias", "mlp_bias"):
        if _flag(hf, flag):
            raise CheckpointError(f"config.json: {flag!r} is true: kvlab's Llama has no bias terms")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: 'hidden_act' is {short(act)}, which is not "
                              "supported (SwiGLU needs 'silu')")


def _sliding_window(hf: Dict[str, Any]) -> Optional[int]:
    """The window, or None where it never slides: absent, null, at least the context, or
    in a Llama config (transformers' Llama ignores the key; Mistral applies it)."""
    window = hf.get("sliding_window")
    if hf.get("model_type") != "mistral" or window is None or window >= _max_positions(hf):
        return None
    return int(window)


def _rope_settings(hf: Dict[str, Any]) -> Tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either config style.

    transformers 4 writes rope_theta + rope_scaling; transformers 5 writes one
    rope_parameters dict holding both. ModelConfig checks the scaling's own fields.
    """
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"config.json: 'rope_parameters' is {short(params)}, "
                              "expected an object")
    if params is not None:
        # transformers 5 writes rope_theta inside rope_parameters (and may leave a null
        # at the top level)
        theta = (_number(params, "rope_theta", 10000.0) if "rope_theta" in params
                 else _number(hf, "rope_theta", 10000.0))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = _number(hf, "rope_theta", 10000.0), hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"config.json: 'rope_scaling' is {short(scaling)}, "
                              "expected an object or null")
    partial = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"config.json: 'partial_rotary_factor' is {short(partial)}: "
                              "partial rotary embeddings are not supported")
    if not scaling or scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------
# kvlab name -> HF name ({i} = layer); the per-layer ones are stacked.
_LAYER_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w1": "model.layers.{i}.mlp.gate_proj.weight",
    "w2": "model.layers.{i}.mlp.down_proj.weight",
    "w3": "model.layers.{i}.mlp.up_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embedding": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "classifier": "lm_head.weight",
}


def load_hf(folder: "str | os.PathLike[str]") -> Tuple[ModelConfig, Weights, Any]:
    """(config, float32 weights, tokenizer or None) from a Hugging Face model folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    hf = _read_config_json(config_path)
    try:
        config = config_from_hf(hf, name=folder.name)
    except (CheckpointError, ConfigError) as exc:
        message = str(exc)
        message = message[len("config.json: "):] if message.startswith("config.json: ") else message
        error = type(exc)(f"{config_path}: {message}")
        error.field = getattr(exc, "field", None)  # type: ignore[attr-defined]
        raise error from None
    tensors = _tensor_index(folder)
    _reject_biases(tensors)
    if not config.tied_embeddings and _GLOBAL_NAMES["classifier"] not in tensors:
        config = config.replace(tied_embeddings=True)
    weights = _gather_weights(config, tensors, folder)
    return config, weights, _folder_tokenizer(folder)


def _read_config_json(path: Path) -> Dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"no {path.name} in {path.parent}")
    return read_json_object(path, path.name)


def _tensor_index(folder: Path) -> Dict[str, TensorInfo]:
    """Every tensor of the checkpoint, across shards, by name."""
    files, weight_map = _safetensors_files(folder)
    tensors: Dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {short(name)} appears in both "
                                      f"{tensors[name].path.name} and {path.name}")
            tensors[name] = info
    if weight_map is not None:
        _check_weight_map(folder, weight_map, tensors)
    return tensors


def _check_weight_map(folder: Path, weight_map: Dict[str, str],
                      tensors: Dict[str, TensorInfo]) -> None:
    """The shard index and the shards agree: every tensor the index names is in the shard
    it names, and every tensor of the shards is in the index (transformers reads a tensor
    where the index says: one the index leaves out, or places elsewhere, is a corrupt or
    mixed-up folder)."""
    index = folder / "model.safetensors.index.json"
    for name, shard in weight_map.items():
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"{index}: weight_map places tensor {short(name)} in "
                                  f"{short(shard)}, which has no such tensor")
        if info.path != folder / shard:
            raise CheckpointError(f"{index}: weight_map places tensor {short(name)} in "
                                  f"{short(shard)}, but it is in {info.path.name}")
    missing = [name for name in tensors if name not in weight_map]
    if missing:
        raise CheckpointError(f"{index}: tensor {short(missing[0])} of "
                              f"{tensors[missing[0]].path.name} is not in the weight_map"
                              + (f" ({len(missing) - 1} more are not either)"
                                 if len(missing) > 1 else ""))


def _safetensors_files(folder: Path) -> Tuple[List[Path], Optional[Dict[str, str]]]:
    """The shard files, and the index's weight_map where there is an index."""
    index = folder / "model.safetensors.index.json"
    weight_map: Optional[Dict[str, str]] = None
    if index.exists():  # one that is not a regular file is refused when read
        weight_map = _read_config_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object")
        bad = [v for v in weight_map.values() if not (isinstance(v, str) and v)]
        if bad:
            raise CheckpointError(f"{index}: weight_map holds {short(bad[0])}; expected the "
                                  "file name of a shard for every tensor")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        if not files:
            raise CheckpointError(f"{index}: weight_map is empty; it names no shard")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    for path in files:
        if not path.exists():  # one that is not a regular file is refused when read
            named = f" (named in {index})" if index.exists() else ""
            raise CheckpointError(f"checkpoint shard not found: {path}{named}")
    return files, weight_map


def _reject_biases(tensors: Dict[str, TensorInfo]) -> None:
    biases = [name for name in tensors if name.startswith("model.layers.") and name.endswith(".bias")]
    if biases:
        raise CheckpointError(f"checkpoint has bias tensors (e.g. {biases[0]}); "
                              "kvlab's Llama has no bias terms")


def _gather_weights(config: ModelConfig, tensors: Dict[str, TensorInfo],
                    folder: Optional[Path] = None) -> Weights:
    # Every tensor is found and its shape checked before anything is allocated: the sizes
    # come from config.json, and a corrupt num_hidden_layers must not allocate gigabytes
    # for tensors the files do not have. Once all match, a matrix takes the bytes it has in
    # the files (twice them where its layers mix 16-bit and F32 dtypes), a norm at most twice.
    expected = Weights.expected_shapes(config)
    found: Dict[str, List[TensorInfo]] = {}
    for key, hf_name in _GLOBAL_NAMES.items():
        if key == "classifier" and config.tied_embeddings:
            continue
        found[key] = [_find(tensors, hf_name, expected[key], folder)]
    for key, pattern in _LAYER_NAMES.items():
        found[key] = [_find(tensors, pattern.format(i=i), expected[key][1:], folder)
                      for i in range(config.n_layers)]
    tied_head = _refuse_unused(tensors, {info.name for infos in found.values() for info in infos},
                               config, folder)
    arrays: Dict[str, np.ndarray] = {}
    for key, infos in found.items():
        fmt = _stored_format(infos) if key in MATRICES else "fp32"   # norms: float32
        read = read_stored if fmt != "fp32" else read_tensor
        if key in _GLOBAL_NAMES:
            arrays[key] = read(infos[0])
        else:
            stacked = weight_formats.empty(expected[key], fmt)  # filled layer by layer
            for i, info in enumerate(infos):
                stacked[i] = read(info)
            arrays[key] = stacked
    if config.tied_embeddings:
        arrays["classifier"] = arrays["token_embedding"]  # one array, two names
    if tied_head is not None:
        _check_tied_head(tied_head, found["token_embedding"][0])
    weights = Weights(**arrays)
    weights.check(config)
    return weights


# Tensors a Llama checkpoint may hold that the model does not read: RoPE's inverse
# frequencies, which older transformers saved in every layer and which kvlab (as
# transformers does) computes from rope_theta instead.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"


def _refuse_unused(tensors: Dict[str, TensorInfo], used: set, config: ModelConfig,
                   folder: Optional[Path]) -> Optional[TensorInfo]:
    """Every tensor of the files must be one the model reads, or be explained: a
    num_hidden_layers smaller than the layers in the files would otherwise load a smaller
    model, silently, and an unknown tensor would be left out of the computation it belongs
    to. Explained: the layers' rotary_emb.inv_freq (computed from rope_theta instead), and
    lm_head.weight in a tied model, where it must equal the embedding (returned, to be
    compared once that is read: transformers would use the embedding in its place)."""
    tied_head = None
    unused = []
    for name, info in tensors.items():
        if name in used:
            continue
        layer = _layer_of(name)
        if name.endswith(_IGNORED_SUFFIX) and layer is not None and layer < config.n_layers:
            continue
        if name == _GLOBAL_NAMES["classifier"] and config.tied_embeddings:
            tied_head = info
            continue
        unused.append(name)
    if not unused:
        return tied_head
    layers = sorted({layer for layer in map(_layer_of, unused)
                     if layer is not None and layer >= config.n_layers})
    listed = ", ".join(short(name) for name in unused[:4])
    more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
    why = (f"; config.json's 'num_hidden_layers' is {config.n_layers} but the files have "
           f"tensors for layer {layers[0]}" + (f" to {layers[-1]}" if len(layers) > 1 else "")
           if layers else "")
    raise CheckpointError(f"{str(folder) + ': ' if folder else ''}wrong number of tensors: "
                          f"the files have {len(tensors)}, the model config.json describes "
                          f"reads {len(used)}; {len(unused)} would be left unused "
                          f"({listed}{more}){why}. kvlab reads a whole checkpoint or none of it")


def _layer_of(name: str) -> Optional[int]:
    """i of a "model.layers.{i}." name, else None."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _check_tied_head(head: TensorInfo, embedding: TensorInfo) -> None:
    """A tied model's lm_head.weight holds the embedding's values, or is refused."""
    if head.shape != embedding.shape:
        raise CheckpointError(f"{head.path}: tensor 'lm_head.weight' has shape "
                              f"{list(head.shape)}, but config.json ties it to the embedding "
                              f"of shape {list(embedding.shape)}")
    _check_readable(head)
    if not np.array_equal(read_tensor(head), read_tensor(embedding)):
        raise CheckpointError(f"{head.path}: config.json says 'tie_word_embeddings' but "
                              "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight': "
                              "set tie_word_embeddings to false to use it as the classifier")


def _stored_format(infos: List[TensorInfo]) -> str:
    """The weight format of a matrix's tensors (one per layer, or one): their own when they
    share a dtype, else fp32, which holds the values of all three exactly."""
    for info in infos:
        _check_readable(info)
    dtypes = {info.dtype for info in infos}
    return _KEPT_FORMATS[dtypes.pop()] if len(dtypes) == 1 else "fp32"


def _find(tensors: Dict[str, TensorInfo], name: str, shape: Tuple[int, ...],
          folder: Optional[Path] = None) -> TensorInfo:
    info = tensors.get(name)
    if info is None:
        raise CheckpointError(f"{str(folder) + ': ' if folder else ''}checkpoint lacks "
                              f"tensor {name!r}")
    if info.shape != tuple(shape):
        raise CheckpointError(f"{info.path}: tensor {name!r} has shape {list(info.shape)}, "
                              f"config.json implies {list(shape)}")
    return info


def _folder_tokenizer(folder: Path) -> Any:
    """HFTokenizer for folder/tokenizer.json when the `tokenizers` package is there."""
    path = folder / "tokenizer.json"
    if not path.exists():  # one that is not a regular file is refused by HFTokenizer
        return None
    try:
        import tokenizers  # noqa: F401  (only asking whether it is installed)
    except ImportError:
        return None
    return HFTokenizer(path)


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "f32": "F32", "f16": "F16", "bf16": "BF16"}


def save_hf_llama(folder: "str | os.PathLike[str]", config: ModelConfig, weights: Weights,
                  dtype: str = "float32") -> None:
    """Write config.json + model.safetensors that transformers' LlamaForCausalLM can load.

    HF checkpoints expect the rotate-half RoPE layout. If `config.rope_interleaved` is
    True (llama2.c, GGUF), the rows of wq and wk are permuted so that the saved model
    computes exactly the same function; loading it back gives rope_interleaved=False.
    A matrix stored in fewer bytes (fp16, bf16, q8_0) is written as its values, in `dtype`.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    weights.check(config)
    weights = weights.float32()   # safetensors has no q8_0, and the writer converts values
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n",
                                        encoding="utf-8")
    write_safetensors(folder / "model.safetensors", _hf_tensors(config, weights), _DTYPES[dtype])


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> Dict[str, Any]:
    """config.json contents (transformers 4 style, which transformers 5 also reads)."""
    windowed = config.sliding_window is not None     # transformers' Llama has no window
    return {
        "architectures": ["MistralForCausalLM" if windowed else "LlamaForCausalLM"],
        "model_type": "mistral" if windowed else "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tied_embeddings,
        "sliding_window": config.sliding_window,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(dtype, dtype),
    }


def _hf_tensors(config: ModelConfig, weights: Weights) -> Dict[str, np.ndarray]:
    tensors = {_GLOBAL_NAMES["token_embedding"]: weights.token_embedding}
    for key, pattern in _LAYER_NAMES.items():
        stacked = getattr(weights, key)
        if config.rope_interleaved and key in ("wq", "wk"):
            stacked = interleaved_to_half(stacked, config.head_dim)
        for i in range(config.n_layers):
            tensors[pattern.format(i=i)] = stacked[i]
    tensors[_GLOBAL_NAMES["final_norm"]] = weights.final_norm
    if not config.tied_embeddings:
        tensors[_GLOBAL_NAMES["classifier"]] = weights.classifier
    return tensors


def interleaved_to_half(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Reorder q/k output rows from interleaved RoPE pairs to rotate-half pairs.

    Interleaved rotates rows (2i, 2i+1) of each head together; rotate-half rotates
    rows (i, i + head_dim/2). Putting a head's even rows first and odd rows second
    turns one into the other. Works on (..., n_heads * head_dim, in_features).
    """
    *lead, rows, cols = w.shape
    heads = w.reshape(*lead, rows // head_dim, head_dim // 2, 2, cols)
    return np.ascontiguousarray(np.swapaxes(heads, -3, -2)).reshape(w.shape)


def half_to_interleaved(w: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of interleaved_to_half."""
    *lead, rows, cols = w.shape
    heads = w.reshape(*lead, rows // head_dim, 2, head_dim // 2, cols)
    return np.ascontiguousarray(np.swapaxes(heads, -3, -2)).reshape(w.shape)
