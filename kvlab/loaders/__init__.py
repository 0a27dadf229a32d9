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

Every file is opened only if it is a regular file (a named pipe or a device is refused by
name) and read no further than its format allows; a wrong-typed or implausible value in
any header or JSON file is a CheckpointError or ConfigError naming the file and the field.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ..weights import Weights
from ..registry import KNOWN_MODELS
from ..files import is_number, open_regular, read_json_object, short
from .gguf import load_gguf   # (the gguf package only for a type it must dequantize)
from .gguf_writer import save_gguf
from .huggingface import load_hf, save_hf_llama
from .llama2c import load_llama2c, save_llama2c_v1

__all__ = ["load_checkpoint", "detect_format", "save_llama2c_v1", "save_hf_llama", "save_gguf"]

_SIDECAR_CONFIG_KEYS = ("norm_eps", "rope_theta", "rope_interleaved", "name")


def load_checkpoint(path: "str | os.PathLike[str]",
                    tokenizer_path: "str | os.PathLike[str] | None" = None,
                    mmap: bool = True, weight_format: Optional[str] = None,
                    ) -> Tuple[ModelConfig, Weights, Optional[Tokenizer]]:
    """(config, weights, tokenizer) from a checkpoint file or folder.

    Matrices come in the checkpoint's own format where the core reads it: fp32, fp16 and
    bf16 safetensors, GGUF F32, F16, BF16, Q8_0, Q4_0 and Q4_1. weight_format: the format the caller
    will store the matrices in (kvlab.load converts them afterwards), or None; a GGUF tensor
    type the core cannot read (Q4_K, ...) is dequantized straight to it (to q8_0 when None,
    fp16 for rows that are not whole Q8_0 blocks), with a warning that says what it cost.

    mmap=True (the default) memory-maps a llama2.c file and uses it in place: instant, and
    shared between processes, but the file must not change while the weights are in use
    (Weights.check_source notices when it has). mmap=False reads the weights into memory
    of their own. Hugging Face and GGUF weights are always copies (each stacks a matrix's
    layers, which the files keep apart, into one array).

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
        config, weights, tokenizer = load_gguf(path, weight_format=weight_format)
    else:
        # An explicit tokenizer_path makes the sidecar's and the nearby one irrelevant.
        config, weights, tokenizer = _load_llama2c(path, want_tokenizer=tokenizer_path is None,
                                                   mmap=mmap)
    weights.check_finite(str(path))
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path, config.vocab_size)
    _check_tokenizer_fits(tokenizer, config)
    return config, weights, tokenizer


def detect_format(path: Path) -> str:
    """'hf', 'gguf' or 'llama2c' for an existing path; CheckpointError otherwise."""
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (no such file or directory; "
                              f"the named models kvlab can fetch are: {', '.join(KNOWN_MODELS)})")
    if path.is_dir():
        if (path / "config.json").exists():  # read (or refused) by the HF reader
            return "hf"
        raise CheckpointError(f"{path} is a folder without config.json; expected a Hugging Face "
                              "model folder, or pass the checkpoint file itself")
    with open_regular(path, "checkpoint") as f:  # a FIFO or a device is refused here
        magic = f.read(4)
    return "gguf" if path.suffix.lower() == ".gguf" or magic == b"GGUF" else "llama2c"


def _load_llama2c(path: Path, want_tokenizer: bool, mmap: bool = True
                  ) -> Tuple[ModelConfig, Weights, Optional[Tokenizer]]:
    """A .bin plus what its sidecar (if any) says."""
    sidecar_path = path.with_suffix(".json")
    sidecar = _read_sidecar(sidecar_path)
    overrides = {k: sidecar[k] for k in _SIDECAR_CONFIG_KEYS if k in sidecar}
    try:
        config, weights = load_llama2c(path, mmap=mmap, **overrides)
    except ConfigError as exc:
        if getattr(exc, "field", None) not in overrides:
            raise
        # the checkpoint's path is in the message already; name the sidecar's key too
        error = ConfigError(f"{exc} (set by {sidecar_path}'s {exc.field!r})")
        error.field = exc.field  # type: ignore[attr-defined]
        raise error from None
    if not want_tokenizer:
        return config, weights, None
    if "tokenizer" in sidecar:
        return config, weights, _sidecar_tokenizer(sidecar["tokenizer"], sidecar_path, config)
    return config, weights, _nearby_tokenizer(path.parent, config)


def _read_sidecar(path: Path) -> Dict[str, Any]:
    """The sidecar's settings, each of the type ModelConfig needs (a JSON "1e-5" string or
    null must be named here, not fail later in arithmetic)."""
    if not path.exists():  # a dangling link counts as none; a FIFO or device is refused
        return {}
    sidecar = read_json_object(path, "sidecar")
    for key, ok, kind in (("norm_eps", is_number, "a number"),
                          ("rope_theta", is_number, "a number"),
                          ("rope_interleaved", lambda v: isinstance(v, bool), "true or false"),
                          ("name", lambda v: isinstance(v, str), "a string")):
        if key in sidecar and not ok(sidecar[key]):
            raise CheckpointError(f"sidecar {path}: {key!r} must be {kind}, "
                                  f"got {short(sidecar[key])}")
    return sidecar


def _sidecar_tokenizer(spec: Any, sidecar: Path, config: ModelConfig) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    if isinstance(spec, str) and spec:
        return load_tokenizer(sidecar.parent / spec, config.vocab_size)
    raise CheckpointError(f"sidecar {sidecar}: 'tokenizer' must be \"bytes\" or a file name, "
                          f"got {short(spec)}")


def _nearby_tokenizer(folder: Path, config: ModelConfig) -> Optional[Tokenizer]:
    """llama2.c convention: tok{vocab}.bin (custom vocabularies) or tokenizer.bin."""
    for name in (f"tok{config.vocab_size}.bin", "tokenizer.bin"):
        if (folder / name).exists():  # one that is not a regular file is refused, by name
            return load_tokenizer(folder / name, config.vocab_size)
    return None


def _check_tokenizer_fits(tokenizer: Optional[Tokenizer], config: ModelConfig) -> None:
    # A smaller vocab is fine (models often pad theirs); a bigger one would emit ids
    # the embedding table has no row for.
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {config.vocab_size}; they do not belong together")
