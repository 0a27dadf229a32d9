"""Model shape: the handful of integers that decide every buffer size in kvlab.

This module is plain Python (no compiled code), so cache-size arithmetic works even
where the C extension is not built. It is not where weights live (see kvlab.weights).
Names follow llama2.c: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

import numpy as np

from .arguments import C_INT_MAX
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
    # Mistral-style sliding-window attention: each token attends to itself and the
    # sliding_window - 1 positions before it (None: to every earlier position).
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        self._check_sizes()  # before dim // n_heads: a string or 0 must not get that far
        if self.head_dim == 0:
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
    # [quote ch03-modelconfig-kv-mul]
    def kv_mul(self) -> int:
        """How many query heads share one key/value head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads
    # [end ch03-modelconfig-kv-mul]

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
        """Raise ConfigError naming the first field that does not fit (in its .field)."""
        self._check_sizes(head_dim_may_be_0=False)
        if self.n_heads % self.n_kv_heads != 0:
            raise _error("n_kv_heads", f"n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                         f"({self.n_heads}) so each KV head serves a whole group")
        if self.head_dim % 2 != 0:
            raise _error("head_dim", f"head_dim must be even for RoPE, got {self.head_dim}")
        # The core computes in float32: an epsilon that rounds to 0 (or to infinity) there
        # divides by zero in RMSNorm on an all-zero row.
        if not (_positive_finite(self.norm_eps)
                and _FLOAT32_TINY <= float(self.norm_eps) <= _FLOAT32_MAX):
            raise _error("norm_eps", f"norm_eps must be a positive number that float32 holds "
                         f"({_FLOAT32_TINY:.3g} to {_FLOAT32_MAX:.3g}), got {_short(self.norm_eps)}")
        if not _positive_finite(self.rope_theta):
            raise _error("rope_theta", f"rope_theta must be a positive finite number, "
                         f"got {_short(self.rope_theta)}")
        for field in ("rope_interleaved", "tied_embeddings"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                raise _error(field, f"{field} must be true or false, "
                             f"got {_short(getattr(self, field))}")
        window = self.sliding_window
        if window is not None and (isinstance(window, (bool, np.bool_))
                                   or not isinstance(window, (int, np.integer)) or window < 1):
            raise _error("sliding_window", f"sliding_window must be a positive integer or "
                         f"None, got {_short(window)}")
        if window is not None and window > C_INT_MAX:
            raise _error("sliding_window", f"sliding_window must be at most {C_INT_MAX:,} (the "
                         f"C core's int), got {window:,}")
        if not isinstance(self.name, str):
            raise _error("name", f"name must be a string, got {_short(self.name)}")
        self._check_rope_scaling()
        self._check_rope_frequencies()

    def _check_sizes(self, head_dim_may_be_0: bool = True) -> None:
        for field in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                      "vocab_size", "max_seq_len", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
                    or value < 0 or (value == 0 and not (field == "head_dim" and head_dim_may_be_0)):
                raise _error(field, f"{field} must be a positive integer, got {_short(value)}")
            if value > C_INT_MAX:
                raise _error(field, f"{field} must be at most {C_INT_MAX:,} (the C core's int), "
                             f"got {value:,}")

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise _error("rope_scaling", f"rope_scaling must be a dict (or None), "
                         f"got {_short(scaling)}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "default"):
            raise _error("rope_scaling", f"unsupported rope_scaling type {_short(kind)} "
                         "(kvlab knows 'llama3')")
        if kind != "llama3":
            return
        for key, required in (("factor", True), ("low_freq_factor", False),
                              ("high_freq_factor", False),
                              ("original_max_position_embeddings", False)):
            value = scaling.get(key)
            if value is None and not required:
                continue
            if not _positive_finite(value):
                raise _error("rope_scaling", f"rope_scaling {key!r} must be a positive finite "
                             f"number, got {_short(value)}")
        low, high = scaling.get("low_freq_factor") or 1.0, scaling.get("high_freq_factor") or 4.0
        if not high > low:
            raise _error("rope_scaling", f"rope_scaling 'high_freq_factor' ({high}) must be "
                         f"greater than 'low_freq_factor' ({low})")

    def _check_rope_frequencies(self) -> None:
        """Every RoPE frequency, and its angle at any position float32 counts exactly
        (2**24, or max_seq_len if longer), must be finite: one infinity makes every logit
        NaN. Zero frequencies (a huge theta) are harmless: those pairs do not rotate."""
        for field, scaled in (("rope_theta", False), ("rope_scaling", True)):
            with np.errstate(all="ignore"):
                freq = self._rope_inv_freq64(scaled).astype(np.float32)
                angle = freq * np.float32(min(max(self.max_seq_len, _FLOAT32_EXACT_POSITIONS),
                                              _FLOAT32_MAX))
            if not (np.isfinite(angle).all() and (freq >= 0).all()):
                setting = (f"rope_theta={self.rope_theta!r}" if field == "rope_theta" else
                           f"rope_scaling={_short(self.rope_scaling)}")
                raise _error(field, f"{setting} gives RoPE frequencies (or angles) that are not "
                             "finite in float32: every logit would be NaN")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ---- presets: well-known shapes (sizes only; no weights come with them) -------------
    @classmethod
    # [quote ch02-modelconfig-presets-llama-2]
    def llama2_7b(cls) -> "ModelConfig":
        return cls(dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32,
                   vocab_size=32000, max_seq_len=4096, tied_embeddings=False, name="Llama 2 7B")

    @classmethod
    def llama31_8b(cls) -> "ModelConfig":
        """Llama 3 8B's shape trained to 128K positions (RoPE scaled as Llama 3.1 does)."""
        return cls(dim=4096, hidden_dim=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                   vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                   rope_interleaved=False, tied_embeddings=False, name="Llama 3.1 8B",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})

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
    # [end ch02-modelconfig-presets-llama-2]

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
                "llama3-8b": cls.llama3_8b(), "llama3.1-8b": cls.llama31_8b(),
                "tinyllama-1.1b": cls.tinyllama_1b(),
                "stories260k": cls.stories260k(), "shakespeare-1m": cls.shakespeare_1m()}

    # ---- RoPE ------------------------------------------------------------------------
    def rope_inv_freq(self) -> np.ndarray:
        """Rotation speed of each pair of a head: theta ** (-2i / head_dim), shape (head_dim/2,).

        With Llama 3 rope scaling, long wavelengths are slowed down by `factor` and a
        band in between is blended smoothly (the rule from Meta's Llama 3.1 code).
        Computed in float64 and rounded once to float32, the precision the C core uses.
        """
        return self._rope_inv_freq64().astype(np.float32)

    def _rope_inv_freq64(self, scaled: bool = True) -> np.ndarray:
        with np.errstate(all="ignore"):  # validate() checks the result; np.where computes
            return self._rope_inv_freq64_unchecked(scaled)  # branches it then drops

    def _rope_inv_freq64_unchecked(self, scaled: bool) -> np.ndarray:
        i = np.arange(0, self.head_dim, 2, dtype=np.float64)
        inv_freq = 1.0 / (float(self.rope_theta) ** (i / self.head_dim))
        scaling = (self.rope_scaling or {}) if scaled else {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor") or 1.0)
            high = float(scaling.get("high_freq_factor") or 4.0)
            old_len = float(scaling.get("original_max_position_embeddings") or 8192)
            wavelen = 2 * math.pi / inv_freq
            low_wavelen, high_wavelen = old_len / low, old_len / high
            smooth = (old_len / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            inv_freq = np.where(wavelen > low_wavelen, inv_freq / factor,
                                np.where(wavelen < high_wavelen, inv_freq, blended))
        return inv_freq


# The float32 range the core computes in, and the positions it counts exactly.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)   # smallest normal float32, 1.18e-38
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_EXACT_POSITIONS = 1 << 24


def _positive_finite(value: Any) -> bool:
    """A positive, finite int or float (NumPy's too): not a bool, a string, None, NaN, or
    an integer too large for a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return 0.0 < float(value) < math.inf
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _error(field: str, message: str) -> ConfigError:
    """A ConfigError that also says, in .field, which ModelConfig field is wrong (so that a
    loader can name the field as its file spells it)."""
    error = ConfigError(message)
    error.field = field  # type: ignore[attr-defined]
    return error
