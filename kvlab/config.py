"""Model shape: the handful of integers that decide every buffer size in kvlab.

This module is plain Python (no compiled code), so cache-size arithmetic works even
where the C extension is not built. It is not where weights live (see kvlab.weights).
Names follow llama2.c: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dim: int                      # width of the residual stream
    hidden_dim: int               # width of the SwiGLU MLP
    n_layers: int
    n_heads: int                  # query heads
    n_kv_heads: int               # key/value heads; n_heads % n_kv_heads == 0 (MHA, GQA, MQA)
    vocab_size: int
    max_seq_len: int              # longest context the model was trained for
    head_dim: int = 0             # 0 means dim // n_heads
    norm_eps: float = 1e-5        # RMSNorm epsilon
    rope_theta: float = 10000.0
    # RoPE pairs: True rotates (x[2i], x[2i+1]) as llama2.c and Meta checkpoints do;
    # False rotates (x[i], x[i + head_dim/2]) as Hugging Face checkpoints do.
    rope_interleaved: bool = True
    # Hugging Face style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8, ...}
    rope_scaling: Optional[dict] = None
    tied_embeddings: bool = True  # classifier shares the token embedding matrix
    name: str = ""

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        self.validate()

    # ---- derived sizes -------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        """Width of one token's keys (or values) in one layer."""
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_mul(self) -> int:
        """How many query heads share one key/value head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def n_params(self) -> int:
        """Learned parameters (the classifier counted once when tied)."""
        per_layer = (2 * self.dim                                   # two RMSNorm weights
                     + self.dim * (self.q_dim + 2 * self.kv_dim)   # wq, wk, wv
                     + self.q_dim * self.dim                        # wo
                     + 3 * self.dim * self.hidden_dim)              # w1, w2, w3
        total = self.vocab_size * self.dim + self.n_layers * per_layer + self.dim
        if not self.tied_embeddings:
            total += self.vocab_size * self.dim
        return total

    def validate(self) -> None:
        """Raise ConfigError naming the first size that does not fit."""
        for field in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                      "vocab_size", "max_seq_len", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                              f"({self.n_heads}) so each KV head serves a whole group")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            raise ConfigError(f"norm_eps must be a positive number, got {self.norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ConfigError(f"unsupported rope_scaling type {kind!r} "
                                  "(kvlab knows 'llama3')")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ---- presets: well-known shapes (sizes only; no weights come with them) -------------
    @classmethod
    def llama2_7b(cls) -> "ModelConfig":
        return cls(dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32,
                   vocab_size=32000, max_seq_len=4096, tied_embeddings=False, name="Llama 2 7B")

    @classmethod
    def llama2_70b(cls) -> "ModelConfig":
        return cls(dim=8192, hidden_dim=28672, n_layers=80, n_heads=64, n_kv_heads=8,
                   vocab_size=32000, max_seq_len=4096, tied_embeddings=False,
                   name="Llama 2 70B")

    @classmethod
    def llama3_8b(cls) -> "ModelConfig":
        return cls(dim=4096, hidden_dim=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                   vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
                   rope_interleaved=False, tied_embeddings=False, name="Llama 3 8B")

    @classmethod
    def tinyllama_1b(cls) -> "ModelConfig":
        return cls(dim=2048, hidden_dim=5632, n_layers=22, n_heads=32, n_kv_heads=4,
                   vocab_size=32000, max_seq_len=2048, rope_interleaved=False,
                   tied_embeddings=False, name="TinyLlama 1.1B")

    @classmethod
    def stories260k(cls) -> "ModelConfig":
        return cls(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4,
                   vocab_size=512, max_seq_len=512, name="stories260K")

    @classmethod
    def shakespeare_1m(cls) -> "ModelConfig":
        """The bundled default model (kvlab.load())."""
        return cls(dim=128, hidden_dim=352, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=16,
                   vocab_size=256, max_seq_len=512, name="shakespeare-1m")

    @classmethod
    def presets(cls) -> dict:
        return {"llama2-7b": cls.llama2_7b(), "llama2-70b": cls.llama2_70b(),
                "llama3-8b": cls.llama3_8b(), "tinyllama-1.1b": cls.tinyllama_1b(),
                "stories260k": cls.stories260k(), "shakespeare-1m": cls.shakespeare_1m()}

    # ---- RoPE ------------------------------------------------------------------------
    def rope_inv_freq(self) -> np.ndarray:
        """Rotation speed of each pair of a head: theta ** (-2i / head_dim), shape (head_dim/2,).

        With Llama 3 rope scaling, long wavelengths are slowed down by `factor` and a
        band in between is blended smoothly (the rule from Meta's Llama 3.1 code).
        Computed in float64 and rounded once to float32, the precision the C core uses.
        """
        i = np.arange(0, self.head_dim, 2, dtype=np.float64)
        inv_freq = 1.0 / (self.rope_theta ** (i / self.head_dim))
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old_len = float(scaling.get("original_max_position_embeddings", 8192))
            wavelen = 2 * math.pi / inv_freq
            low_wavelen, high_wavelen = old_len / low, old_len / high
            smooth = (old_len / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            inv_freq = np.where(wavelen > low_wavelen, inv_freq / factor,
                                np.where(wavelen < high_wavelen, inv_freq, blended))
        return inv_freq.astype(np.float32)
