"""Small llama GGUF files with matrices of any GGML type, for the loader tests.

Not a test file (pytest collects nothing here); pyproject.toml puts this folder on the
tests' path, so they `from gguf_files import write_llama_gguf`.

The gguf package quantizes F16, BF16, Q8_0 and the legacy types (Q4_0 ...) from values,
but has no quantizer for the K-quants: a Q4_K or Q6_K tensor here is random blocks with
small, finite scales, so its values are whatever those blocks stand for (read them back
with gguf.quants.dequantize), not the weights passed in.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from kvlab.loaders.gguf_writer import add_llama_config

# kvlab name -> GGUF tensor name ({i} = layer), as llama.cpp's converter writes them
LAYER_TENSORS = {"attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight",
                 "wk": "blk.{i}.attn_k.weight", "wv": "blk.{i}.attn_v.weight",
                 "wo": "blk.{i}.attn_output.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
                 "w1": "blk.{i}.ffn_gate.weight", "w2": "blk.{i}.ffn_down.weight",
                 "w3": "blk.{i}.ffn_up.weight"}
GLOBAL_TENSORS = {"token_embedding": "token_embd.weight", "final_norm": "output_norm.weight",
                  "classifier": "output.weight"}
NORMS = ("attn_norm", "ffn_norm", "final_norm")

# Where a K-quant block keeps its half-precision scales (byte ranges), and a scale that
# keeps the weights it stands for below about 0.1.
_K_QUANT_SCALES = {"Q4_K": (slice(0, 4), 1e-4), "Q6_K": (slice(208, 210), 2e-5)}

Types = Dict[str, Union[str, Sequence[str]]]


def write_llama_gguf(path, config, weights, types: Optional[Types] = None,
                     default: str = "F16", big_endian: bool = False, seed: int = 0,
                     alignment: Optional[int] = None, name: Optional[str] = None) -> None:
    """A llama GGUF file of `config` and `weights` (no vocabulary). Each matrix is written
    in the GGML type `types` names for it (kvlab's name: "wq", "token_embedding", ...), one
    type for all layers or a list with one a layer, else in `default`; the norms in F32.
    A tied config writes no output.weight. alignment: general.alignment (the tensors' data
    padded to it; GGUF's default is 32); name: general.name (its length moves the data)."""
    import gguf
    rng = np.random.default_rng(seed)
    types = types or {}
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    if name is not None:
        writer.add_name(name)
    add_llama_config(writer, config)

    def add(gguf_name: str, values: np.ndarray, kind: str) -> None:
        data = values if kind == "F32" else encode(values, kind, rng)
        raw_dtype = None if kind in ("F32", "F16", "I8") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)

    def kinds(key: str) -> List[str]:
        kind = types.get(key, "F32" if key in NORMS else default)
        return [kind] * config.n_layers if isinstance(kind, str) else list(kind)

    add(GLOBAL_TENSORS["token_embedding"], weights.token_embedding, kinds("token_embedding")[0])
    add(GLOBAL_TENSORS["final_norm"], weights.final_norm, "F32")
    if not config.tied_embeddings:
        add(GLOBAL_TENSORS["classifier"], weights.classifier, kinds("classifier")[0])
    for i in range(config.n_layers):
        for key, pattern in LAYER_TENSORS.items():
            add(pattern.format(i=i), getattr(weights, key)[i], kinds(key)[i])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A float32 matrix as gguf's add_tensor takes it in GGML type `kind`: typed for F16 and
    I8, else bytes (rows, bytes a row). Q4_K and Q6_K are random blocks (see above)."""
    import gguf
    if kind == "F16":
        return values.astype(np.float16)
    if kind == "I8":                       # an integer type: not weights, for refusals
        return np.clip(np.round(values * 100), -127, 127).astype(np.int8)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _K_QUANT_SCALES:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, in_dim = values.shape
    blocks = rng.integers(0, 256, size=(rows, in_dim // block_values, block_bytes),
                          dtype=np.uint8)
    where, scale = _K_QUANT_SCALES[kind]
    n_scales = (where.stop - where.start) // 2
    halves = (scale * rng.uniform(0.5, 1.0, size=(rows, blocks.shape[1], n_scales)))
    blocks[..., where] = halves.astype("<f2").view(np.uint8)
    return blocks.reshape(rows, -1)
