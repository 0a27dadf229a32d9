"""Write a model as a llama GGUF file that llama.cpp (and kvlab.load) can read.

    save_gguf("model-q8_0.gguf", model.config, model.weights.converted("q8_0"))

Each matrix is written in the format it is stored in, its bytes as they are: float32 as
F32, fp16 as F16, bf16 as BF16 and Q8_0, Q4_0, Q4_1 as themselves, GGUF's own layouts (so a
Q8_0 model written here and read back holds the same bytes, and llama.cpp reads the same
numbers). The norms are F32. GGUF keeps RoPE's pairs interleaved (llama.cpp's converter
permutes q and k rows to that layout), so a model with Hugging Face's rotate-half layout
has its Wq and Wk rows permuted on the way out, as that converter does.

No tokenizer is written (kvlab reads such a file back with tokenizer None: pass
kvlab.load(path, tokenizer=...)). llama.cpp refuses a file without a vocabulary, so a model
meant for llama.cpp's benchmarks gets, with placeholder_vocabulary=True, one made up for
the purpose (<unk>, <s>, </s>, the 256 byte tokens, then tok{i}): enough for
llama.cpp's benchmarks to run the weights, meaningless as text. Not here: reading (see
kvlab.loaders.gguf) and any other architecture than llama.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from .. import weight_formats
from ..config import ModelConfig
from ..errors import CheckpointError
from ..weights import Weights
from .gguf import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from .huggingface import half_to_interleaved

# kvlab's format -> the GGML tensor type that holds the same bytes
_GGML_TYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0",
               "q4_1": "Q4_1"}


def save_gguf(path: "str | os.PathLike[str]", config: ModelConfig, weights: Weights,
              placeholder_vocabulary: bool = False, name: Optional[str] = None) -> None:
    """Write config and weights (each matrix in its stored format) as a llama GGUF file."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("writing GGUF files needs the `gguf` package: pip install gguf") from None
    weights.check(config)
    if config.rope_scaling:
        raise CheckpointError("RoPE scaling is not written to GGUF files by kvlab")
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_name(name or config.name or "kvlab model")
    add_llama_config(writer, config)
    if placeholder_vocabulary:
        _add_placeholder_vocabulary(writer, gguf, config.vocab_size)

    def add(tensor_name: str, array: np.ndarray) -> None:
        fmt = weight_formats.format_of(array)
        if fmt in ("fp32", "fp16"):
            writer.add_tensor(tensor_name, np.ascontiguousarray(array))
        else:   # the bytes of each row, and the type that reads them
            writer.add_tensor(tensor_name, weight_formats.as_bytes(array),
                              raw_dtype=gguf.GGMLQuantizationType[_GGML_TYPES[fmt]])

    add(GGUF_GLOBAL_NAMES["token_embedding"], weights.token_embedding)
    add(GGUF_GLOBAL_NAMES["final_norm"], weights.final_norm)
    if not config.tied_embeddings:
        add(GGUF_GLOBAL_NAMES["classifier"], weights.classifier)
    for layer in range(config.n_layers):
        for key, pattern in GGUF_LAYER_NAMES.items():
            matrix = getattr(weights, key)[layer]
            if key in ("wq", "wk") and not config.rope_interleaved:
                matrix = half_to_interleaved(matrix, config.head_dim)
            add(pattern.format(i=layer), matrix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_llama_config(writer: Any, config: ModelConfig) -> None:
    """The llama.* metadata of config into a gguf.GGUFWriter: the sizes, the norm's epsilon
    and RoPE's base (kvlab.loaders.gguf reads them back into the same ModelConfig)."""
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.hidden_dim)
    writer.add_block_count(config.n_layers)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)


def _add_placeholder_vocabulary(writer: Any, gguf: Any, vocab_size: int) -> None:
    """A SentencePiece-style vocabulary of vocab_size made-up tokens (see the module text)."""
    if vocab_size < 3 + 256:
        raise CheckpointError(f"a placeholder vocabulary needs at least 259 tokens (3 special, "
                              f"256 bytes); this model has {vocab_size}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"tok{i}" for i in range(len(tokens), vocab_size)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    kinds += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab_size - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
