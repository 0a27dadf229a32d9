"""Load a checkpoint from disk: one entry point, three formats.

`load_checkpoint(path)` looks at what `path` is and picks the reader:
  * a folder with config.json         -> Hugging Face safetensors (kvlab.loaders.huggingface)
  * a .gguf file, or the GGUF magic   -> GGUF (kvlab.loaders.gguf)
  * anything else                     -> llama2.c .bin, legacy or version 1 (kvlab.loaders.llama2c)
and returns (ModelConfig, Weights, Tokenizer or None). It does not build a model (see
kvlab.model) and does not download anything.

A llama2.c .bin stores only sizes, so an optional JSON sidecar with the same stem
(`model.bin` + `model.json`) can supply the rest: "tokenizer" ("bytes" for a
ByteTokenizer, or a tokenizer file path relative to the sidecar), "norm_eps",
"rope_theta", "rope_interleaved", "name". Other keys are ignored (sidecars may carry notes).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..config import ModelConfig
from ..errors import CheckpointError
from ..tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ..weights import Weights
from .common import read_json_object
from .huggingface import load_hf, save_hf_llama
from .llama2c import load_llama2c, save_llama2c_v1

__all__ = ["load_checkpoint", "detect_format", "save_llama2c_v1", "save_hf_llama"]

_SIDECAR_CONFIG_KEYS = ("norm_eps", "rope_theta", "rope_interleaved", "name")


def load_checkpoint(path: "str | os.PathLike[str]",
                    tokenizer_path: "str | os.PathLike[str] | None" = None,
                    ) -> Tuple[ModelConfig, Weights, Optional[Tokenizer]]:
    """(config, weights, tokenizer) from a checkpoint file or folder.

    Every weight is checked to be finite (a NaN in a corrupt file is a WeightsError, not
    NaN logits later). The tokenizer comes from, in order: `tokenizer_path`; a llama2.c sidecar's
    "tokenizer"; the checkpoint itself (GGUF vocab, HF tokenizer.json); for llama2.c,
    tok{vocab_size}.bin or tokenizer.bin next to the file. None if there is none.
    """
    path = Path(path)
    kind = detect_format(path)
    if kind == "hf":
        config, weights, tokenizer = load_hf(path)
    elif kind == "gguf":
        from .gguf import load_gguf  # imports the gguf package lazily
        config, weights, tokenizer = load_gguf(path)
    else:
        # An explicit tokenizer_path makes the sidecar's and the nearby one irrelevant.
        config, weights, tokenizer = _load_llama2c(path, want_tokenizer=tokenizer_path is None)
    weights.check_finite(str(path))
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path, config.vocab_size)
    _check_tokenizer_fits(tokenizer, config)
    return config, weights, tokenizer


def detect_format(path: Path) -> str:
    """'hf', 'gguf' or 'llama2c' for an existing path; CheckpointError otherwise."""
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (no such file or directory)")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise CheckpointError(f"{path} is a folder without config.json; expected a Hugging Face "
                              "model folder, or pass the checkpoint file itself")
    if path.suffix.lower() == ".gguf":
        return "gguf"
    with open(path, "rb") as f:
        return "gguf" if f.read(4) == b"GGUF" else "llama2c"


def _load_llama2c(path: Path, want_tokenizer: bool
                  ) -> Tuple[ModelConfig, Weights, Optional[Tokenizer]]:
    """A .bin plus what its sidecar (if any) says."""
    sidecar = _read_sidecar(path.with_suffix(".json"))
    overrides = {k: sidecar[k] for k in _SIDECAR_CONFIG_KEYS if k in sidecar}
    config, weights = load_llama2c(path, **overrides)
    if not want_tokenizer:
        return config, weights, None
    if "tokenizer" in sidecar:
        return config, weights, _sidecar_tokenizer(sidecar["tokenizer"], path.parent, config)
    return config, weights, _nearby_tokenizer(path.parent, config)


def _read_sidecar(path: Path) -> Dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


def _sidecar_tokenizer(spec: Any, folder: Path, config: ModelConfig) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    if isinstance(spec, str):
        return load_tokenizer(folder / spec, config.vocab_size)
    raise CheckpointError(f"sidecar 'tokenizer' must be \"bytes\" or a file name, got {spec!r}")


def _nearby_tokenizer(folder: Path, config: ModelConfig) -> Optional[Tokenizer]:
    """llama2.c convention: tok{vocab}.bin (custom vocabularies) or tokenizer.bin."""
    for name in (f"tok{config.vocab_size}.bin", "tokenizer.bin"):
        if (folder / name).is_file():
            return load_tokenizer(folder / name, config.vocab_size)
    return None


def _check_tokenizer_fits(tokenizer: Optional[Tokenizer], config: ModelConfig) -> None:
    # A smaller vocab is fine (models often pad theirs); a bigger one would emit ids
    # the embedding table has no row for.
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {config.vocab_size}; they do not belong together")
