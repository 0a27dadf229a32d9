"""Read Llama checkpoints in GGUF format (llama.cpp's file format), F32/F16 only.

The `gguf` package (pip install gguf) parses the container; this module maps its
metadata keys and tensor names onto kvlab's ModelConfig and Weights. Two things to know:
  * GGUF lists a tensor's dimensions fastest-varying first (ggml's `ne`), the reverse of
    a NumPy shape: a (out_features, in_features) matrix appears as [in, out].
  * llama.cpp's converter permutes q/k rows to the interleaved RoPE layout (the
    llama2.c / Meta one), so GGUF models use rope_interleaved=True.
Not here: quantized tensors (Q4_0, Q8_0, K-quants, BF16, ...), which are refused by name,
architectures other than "llama", and RoPE scaling stored in GGUF (rope_freqs).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError, TokenizerError
from ..weights import Weights

# kvlab name -> GGUF tensor name ({i} = layer).
_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embedding": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "classifier": "output.weight",
}


def load_gguf(path: "str | os.PathLike[str]") -> Tuple[ModelConfig, Weights, Any]:
    """(config, float32 weights, tokenizer or None) from a llama GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(reader, tensors, name=path.stem)
    weights = _gather_weights(config, tensors)
    return config, weights, _embedded_tokenizer(reader)


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader, with kvlab's errors for a missing package or a bad file."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path} (no such file)")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError ... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file "
                              f"({type(exc).__name__}: {exc})") from None


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value as plain Python (str, int, float, list)."""
    from ..tokenizer import _gguf_value  # one GGUF field decoder for the whole package
    value = _gguf_value(reader, key)
    return default if value is None else value


def config_from_gguf(reader: Any, tensors: Dict[str, Any], name: str = "") -> ModelConfig:
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    _reject_rope_scaling(reader, tensors)

    def key(suffix: str, default: Any = None) -> Any:
        value = metadata(reader, f"llama.{suffix}", default)
        if value is None:
            raise CheckpointError(f"GGUF file lacks metadata 'llama.{suffix}'")
        return value

    n_heads = key("attention.head_count")
    dim = key("embedding_length")
    head_dim = key("attention.key_length", dim // n_heads if n_heads else 0)
    rope_dims = key("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(f"partial RoPE (rope.dimension_count={rope_dims}, "
                              f"head_dim={head_dim}) is not supported")
    return ModelConfig(
        dim=dim,
        hidden_dim=key("feed_forward_length"),
        n_layers=key("block_count"),
        n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv", n_heads),
        vocab_size=_vocab_size(reader, tensors),
        max_seq_len=key("context_length", 2048),
        head_dim=head_dim,
        norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_interleaved=True,  # llama.cpp permutes q/k to the interleaved layout
        tied_embeddings=_GLOBAL_NAMES["classifier"] not in tensors,
        name=name,  # the file name; general.name is often just "llama"
    )


def _reject_rope_scaling(reader: Any, tensors: Dict[str, Any]) -> None:
    kind = metadata(reader, "llama.rope.scaling.type", "none")
    if kind != "none" or "rope_freqs.weight" in tensors:
        raise CheckpointError("RoPE scaling in GGUF files (rope.scaling.type / rope_freqs) "
                              "is not supported; load the Hugging Face checkpoint instead")


def _vocab_size(reader: Any, tensors: Dict[str, Any]) -> int:
    """Rows of token_embd (the weights decide); the token list may be shorter, not longer."""
    embd = tensors.get(_GLOBAL_NAMES["token_embedding"])
    if embd is None:
        raise CheckpointError("GGUF file lacks tensor 'token_embd.weight'")
    rows = int(embd.shape[-1])  # ne is reversed: the last entry is the row count
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > rows:
        raise CheckpointError(f"GGUF vocabulary has {len(tokens)} tokens but token_embd "
                              f"has only {rows} rows")
    return rows


def _gather_weights(config: ModelConfig, tensors: Dict[str, Any]) -> Weights:
    expected = Weights.expected_shapes(config)
    arrays: Dict[str, np.ndarray] = {}
    for key, gguf_name in _GLOBAL_NAMES.items():
        if key == "classifier" and config.tied_embeddings:
            continue
        arrays[key] = _read(tensors, gguf_name, expected[key])
    for key, pattern in _LAYER_NAMES.items():
        stacked = np.empty(expected[key], dtype=np.float32)
        for i in range(config.n_layers):
            stacked[i] = _read(tensors, pattern.format(i=i), expected[key][1:])
        arrays[key] = stacked
    if config.tied_embeddings:
        arrays["classifier"] = arrays["token_embedding"]
    weights = Weights(**arrays)
    weights.check(config)
    return weights


def _read(tensors: Dict[str, Any], name: str, shape: Tuple[int, ...]) -> np.ndarray:
    """One tensor as a new float32 array of NumPy shape `shape`."""
    tensor = tensors.get(name)
    if tensor is None:
        raise CheckpointError(f"GGUF file lacks tensor {name!r}")
    kind = tensor.tensor_type.name
    if kind not in ("F32", "F16"):
        raise CheckpointError(f"tensor {name!r} has type {kind}; kvlab reads F32 and F16 only "
                              "(dequantize the model first)")
    numpy_shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml ne -> row-major
    if numpy_shape != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(numpy_shape)} (GGUF ne "
                              f"{[int(n) for n in tensor.shape]}), the metadata implies {list(shape)}")
    return np.asarray(tensor.data).reshape(numpy_shape).astype(np.float32)


def _embedded_tokenizer(reader: Any) -> Optional[Any]:
    """SentencePieceBPE for a 'llama' vocabulary, None when there is no usable one."""
    if metadata(reader, "tokenizer.ggml.model") != "llama":
        return None
    from ..tokenizer import SentencePieceBPE
    try:
        return SentencePieceBPE.from_gguf(reader)
    except TokenizerError as exc:
        raise CheckpointError(f"the GGUF file's embedded vocabulary is unusable: {exc}") from None
