"""kvlab.cuda: the same model, caches and paged pool on an NVIDIA GPU.

    import kvlab
    kvlab.cuda.is_available(), kvlab.cuda.why_not()       # False, "no usable NVIDIA driver ..."
    model = kvlab.load("stories260K.bin", tokenizer="tok512.bin", device="cuda")
    model = kvlab.load().to("cuda")                        # the same
    cache = model.new_cache(512, "fp16")                   # K and V in GPU memory
    logits = model.prefill(model.encode("Once"), cache)    # logits come back as NumPy arrays
    cache.keys                                             # a COPY in host memory, not a view
    pool = model.new_paged_pool(num_blocks=256, block_size=16, dtype="int8")
    kvlab.generate(model, "Once upon a time", 48)          # and kvlab.Engine(model, pool)

What lives where. The weights are copied to the GPU once (float32, as on the CPU). A cache
or pool made by a GPU model keeps K and V in GPU memory (a kvlab._cuda.KVStore), in the CPU
core's layout and element formats, so its codes are the CPU's codes bit for bit (the GPU
writes them with the same rounding as csrc/quant.c). Reading them (keys, values,
key_codes, dequantized(), pool.gather ...) copies them to the host every time: what you get
is a snapshot, and a large pool's codes are a large copy. A paged pool is kvlab.PagedPool
itself, the C core's pool with its rows in a KVStore: the same bookkeeping (block tables,
reference counts, copy-on-write, the prefix cache, swapping: csrc/paged.c, blocks.c,
swap.c) decides which slots each call writes and reads and which rows to copy, and the
store moves them on the GPU; so the GPU pool has the CPU pool's methods, arguments and
errors. This module runs the forward pass between the pool's reservation and its commit,
and keeps a contiguous cache's length; the kernels (csrc/cuda/) do the arithmetic.

What the GPU path does not do: int4 and fp8 caches, a residual window, different formats
for K and V, head_dim other than a multiple of 8 up to 256. Its sums run in another order
than the CPU's (and prefill's tiled matrix product in another order than decode's
matrix-vector product), so logits agree with the CPU's to float32 rounding, not bit for bit.

Importing kvlab never needs the CUDA extension, a driver or a GPU; is_available() and
why_not() say whether this machine can run the GPU path.
"""
from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from . import arguments, deprecation
from ._core import core
from .errors import CacheFullError, ConfigError, CudaError
from .counts import Counts
from .measure import forward_counts
from .model import DEVICE_MODELS, Model, TokenArray, as_token_array
from .paged import PagedPool
from .quant import CacheFormat, Quantized, dequantize

FORMATS = ("fp32", "fp16", "bf16", "int8")   # what a GPU cache can store
MAX_HEAD_DIM = 256
MAX_POSITIONS = 256 * 65535   # a sequence's positions: 65535 attention splits of 256

_CODE_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}
_CUDA_INSUFFICIENT_DRIVER, _CUDA_NO_DEVICE = 35, 100

_extension = None
_import_error: Optional[str] = None
_probe: Optional[tuple] = None   # the runtime's answer to "is there a GPU?", asked once
_capability: Optional[tuple] = None   # that GPU's compute capability, asked once


def _load_extension():
    """kvlab._cuda, or None (the reason kept in _import_error); imported on first use only."""
    global _extension, _import_error
    if _extension is None and _import_error is None:
        try:
            from . import _cuda
            _extension = _cuda
        except ImportError as error:
            _import_error = str(error)
    return _extension


def why_not() -> Optional[str]:
    """None if a GPU can be used, else why not: no CUDA extension (kvlab was built without
    nvcc), no driver, no GPU, or a GPU the extension was not compiled for."""
    ext = _load_extension()
    if ext is None:
        return ("kvlab was built without its CUDA extension (kvlab._cuda: "
                f"{_import_error}). pip install builds it only where nvcc is found (CUDA_HOME or "
                "PATH) and a GPU is seen (nvidia-smi) or KVLAB_CUDA=1 is set, and never "
                "with KVLAB_NO_CUDA: reinstall on the GPU machine, or with KVLAB_CUDA=1")
    global _probe
    if _probe is None:
        _probe = ext.probe()
    code, count, name, text = _probe
    if code == _CUDA_INSUFFICIENT_DRIVER:
        return (f"no usable NVIDIA driver on this machine: none, or one older than the CUDA "
                f"runtime kvlab was built with ({name}: {text})")
    if code == _CUDA_NO_DEVICE or (code == 0 and count == 0):
        return f"no CUDA GPU on this machine ({name}: {text})"
    if code != 0:
        return f"the CUDA runtime cannot start ({name}: {text})"
    global _capability
    if _capability is None:
        _capability = tuple(ext.device_info()["capability"])
    major, minor = _capability
    if not runs_on((major, minor), ext.ARCHS):
        return (f"kvlab's CUDA extension was compiled for {ext.ARCHS}, which this GPU "
                f"(compute capability {major}.{minor}) cannot run: rebuild it here (pip install "
                f"builds for the GPU it sees), or with KVLAB_CUDA_ARCH={major}{minor}")
    return None


def runs_on(capability, archs: str) -> bool:
    """Can a GPU of this compute capability (major, minor) run an extension compiled for
    `archs` ("sm_75 sm_90 compute_90", the extension's ARCHS)? Machine code for sm_XY runs on
    any X.Z with Z >= Y (the same major version); PTX for compute_XY is compiled by the
    driver for any GPU of X.Y or newer."""
    major, minor = capability
    # (KVLAB_CUDA_GENCODE builds may name them as "[sm_90,compute_90]" or "sm_90a")
    named = re.findall(r"(sm|compute)_(\d{2,})([a-z]?)", archs)
    if not named:               # "": compiled for nothing; else names this cannot read
        return bool(archs.strip())   # (then let the runtime say)
    for kind, number, suffix in named:
        arch = (int(number[:-1]), int(number[-1]))
        if suffix == "a":       # features of that one GPU: it alone runs them
            if arch == (major, minor):
                return True
        elif kind == "sm" and arch[0] == major and arch[1] <= minor:
            return True
        elif kind == "compute" and arch <= (major, minor):
            return True
    return False


def is_available() -> bool:
    """Can kvlab run models on a GPU here?"""
    return why_not() is None


def extension():
    """The compiled backend, kvlab._cuda; CudaError saying why when it cannot be used."""
    reason = why_not()
    if reason is not None:
        raise CudaError(f"the GPU cannot be used: {reason}")
    return _extension


def device_info() -> dict:
    """The GPU kvlab uses: name, compute capability, memory, multiprocessors, CUDA versions,
    and what the extension was compiled for."""
    info = extension().device_info()
    info["compiled_for"] = _extension.ARCHS
    return info


def check_format(fmt: CacheFormat) -> None:
    """ValueError unless a GPU cache can store K and V this way."""
    for name in (fmt.key, fmt.value):
        if name not in FORMATS:
            raise ValueError(f"a GPU cache stores K and V as {', '.join(FORMATS)}, not {name!r}")
    if (fmt.key, fmt.key_group) != (fmt.value, fmt.value_group):
        raise ValueError("a GPU cache stores K and V in one format and group size "
                         f"(got {fmt.name})")
    if fmt.window:
        raise ValueError("a GPU cache has no residual window (window=0)")
    if fmt.key == "int8" and fmt.key_group % 8:
        raise ValueError(f"int8 groups on the GPU are a multiple of 8 values, got {fmt.key_group}")


def _codes(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Stored bytes (..., head_bytes) as the CPU cache shows its codes: float32, float16,
    bf16 bits as uint16, or int8."""
    return raw.view(_CODE_DTYPES[fmt])


def _dequantized(raw: np.ndarray, scales: Optional[np.ndarray], fmt: str, group: int) -> np.ndarray:
    """The float32 values codes stand for, by kvlab.quant (the definition the GPU matches)."""
    return dequantize(Quantized(fmt, _codes(raw, fmt), scales, None, group))


@contextlib.contextmanager
def _exclusive(lock: threading.Lock, what: str) -> Iterator[None]:
    """One thread at a time, as the CPU caches: a second one gets a RuntimeError at once."""
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"this {what} is in use by a call in another thread; one thread at a "
                           "time may use it")
    try:
        yield
    finally:
        lock.release()


def _device_store(n_layers: int, n_kv_heads: int, head_dim: int, slots: int, fmt: CacheFormat):
    """K and V storage in GPU memory, a kvlab._cuda.KVStore: what a cache's or a pool's rows
    live in (write, read, put, copy_rows, attend). The tests give a NumPy stand-in instead."""
    return extension().KVStore(n_layers, n_kv_heads, head_dim, slots, fmt.key, fmt.value,
                               fmt.key_group, fmt.value_group)


class CudaCache:
    """A contiguous KV cache in GPU memory: kvlab.KVCache's attributes and methods, with
    every array it returns copied to the host (the CPU cache returns zero-copy views). Which
    slot a position takes is simple here (slot = position), so this class keeps its length
    itself; a paged pool's books are the C core's (CudaPagedPool)."""

    device = "cuda"

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 fmt: CacheFormat, store=None):
        check_format(fmt)
        if not 1 <= capacity <= MAX_POSITIONS:
            raise ValueError(f"a GPU cache holds 1 to {MAX_POSITIONS} positions, not {capacity!r}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self._capacity = int(capacity)
        self._fmt = fmt
        self._length = 0
        self._store = store if store is not None else _device_store(n_layers, n_kv_heads,
                                                                    head_dim, capacity, fmt)
        self._lock = threading.Lock()

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def shape(self) -> tuple:
        return (self.n_layers, self._capacity, self.n_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of GPU memory this cache holds for K and V (the full capacity)."""
        return self._store.nbytes

    def _using(self):
        return _exclusive(self._lock, "KVCache")

    def _read(self):
        n = self._length
        if n == 0:   # nothing cached: empty arrays of the shapes a read would have
            width = self.head_dim * np.dtype(_CODE_DTYPES[self._fmt.key]).itemsize
            groups = self.head_dim // self._fmt.key_group if self._fmt.key == "int8" else 0

            def empty(last, dtype):
                return np.zeros((self.n_layers, 0, self.n_kv_heads, last), dtype=dtype)
            scales = empty(groups, np.float32) if groups else None
            return (empty(width, np.uint8), scales, empty(width, np.uint8),
                    None if scales is None else scales.copy())
        with self._using():
            return self._store.read(np.arange(n, dtype=np.int64))

    def _part(self, index: int) -> Optional[np.ndarray]:
        """Part `index` of (key codes, key scales, value codes, value scales), a copy."""
        part = self._read()[index]
        if part is None or index % 2:
            return part
        return _codes(part, self._fmt.key if index < 2 else self._fmt.value)

    @property
    def key_codes(self) -> np.ndarray:
        """The stored key codes, a COPY from the GPU, laid out as the CPU cache's view."""
        return self._part(0)

    @property
    def key_scales(self) -> Optional[np.ndarray]:
        return self._part(1)

    @property
    def value_codes(self) -> np.ndarray:
        return self._part(2)

    @property
    def value_scales(self) -> Optional[np.ndarray]:
        return self._part(3)

    key_zeros = value_zeros = property(lambda self: None, doc="int4 only: always None on the GPU")

    @property
    def key_format(self) -> str:
        """Element format of the keys."""
        return self._fmt.key

    @property
    def value_format(self) -> str:
        """Element format of the values."""
        return self._fmt.value

    @property
    def key_dtype(self) -> str:
        """Deprecated: the old name of key_format (warns; goes in the next release)."""
        deprecation.renamed("CudaCache.key_dtype", "CudaCache.key_format")
        return self._fmt.key

    @property
    def value_dtype(self) -> str:
        """Deprecated: the old name of value_format (warns; goes in the next release)."""
        deprecation.renamed("CudaCache.value_dtype", "CudaCache.value_format")
        return self._fmt.value

    @property
    def key_group(self) -> int:
        return self._fmt.key_group

    @property
    def value_group(self) -> int:
        return self._fmt.value_group

    window = property(lambda self: 0, doc="No residual window on the GPU: always 0.")

    def _float_part(self, index: int, what: str) -> np.ndarray:
        fmt = self._fmt.key
        if fmt not in ("fp32", "fp16"):
            part = "key" if what == "keys" else "value"
            raise TypeError(f"this cache stores its {what} as {fmt} codes, not floats: see "
                            f"{part}_codes and {part}_scales, or dequantized() for float32 copies")
        return self._part(index)

    @property
    def keys(self) -> np.ndarray:
        """Cached keys of the filled positions (n_layers, length, n_kv_heads, head_dim),
        float32 (or float16 in an fp16 cache): a COPY from the GPU, not a view."""
        return self._float_part(0, "keys")

    @property
    def values(self) -> np.ndarray:
        """Cached values, as keys: a COPY from the GPU."""
        return self._float_part(2, "values")

    def dequantized(self) -> Tuple[np.ndarray, np.ndarray]:
        """(keys, values): float32 copies, (n_layers, length, n_kv_heads, head_dim), of what
        attention reads."""
        kc, ks, vc, vs = self._read()
        return (_dequantized(kc, ks, self._fmt.key, self._fmt.key_group),
                _dequantized(vc, vs, self._fmt.value, self._fmt.value_group))

    def attend(self, q: np.ndarray, layer: int = 0) -> np.ndarray:
        """Attention of one token's queries q (n_heads, head_dim) over every cached position
        of a layer, on the GPU; the cache is not changed."""
        q = np.asarray(q)
        if q.dtype != np.float32 or q.ndim != 2:
            raise TypeError("q must be a float32 numpy array (n_heads, head_dim)")
        if self._length == 0:
            raise ValueError("the cache is empty: nothing to attend to")
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        with self._using():
            out = self._store.attend(layer, np.ascontiguousarray(q)[None], np.zeros((1, 1), np.int32),
                                     self._capacity, np.zeros(1, np.int32),
                                     np.array([self._length], np.int32))
        return out[0]

    def reset(self) -> None:
        """Forget every cached token (length = 0)."""
        with self._using():
            self._length = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens, as if the rest never came."""
        with self._using():
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
                    or not 0 <= length <= self._length:
                raise ValueError(f"truncate({length}): length must be between 0 and the current "
                                 f"length {self._length}")
            self._length = int(length)

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Write given K/V rows, each (n_tokens, n_layers, n_kv_heads, head_dim) float32,
        without a model (for exercises and benchmarks), quantized as the cache stores them."""
        for name, rows in (("keys", keys), ("values", values)):
            if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 4:
                raise ValueError(f"{name} must be a 4-D float32 array (n_tokens, n_layers, "
                                 "n_kv_heads, head_dim)")
        n = keys.shape[0]
        with self._using():
            if n < 1:
                raise ValueError("append needs at least one row")
            if n > self._capacity - self._length:
                raise CacheFullError(f"the KV cache is full: it holds {self._length} of "
                                     f"{self._capacity} positions and cannot take {n} more")
            slots = np.arange(self._length, self._length + n, dtype=np.int64)
            self._store.write(slots, np.ascontiguousarray(keys), np.ascontiguousarray(values))
            self._length += n

    def __repr__(self) -> str:
        return (f"CudaCache(length={self._length}, capacity={self._capacity}, "
                f"n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self._fmt.key}, device='cuda', nbytes={self.nbytes})")


class CudaPagedPool(PagedPool):
    """A paged pool whose K and V rows live in GPU memory: kvlab.PagedPool itself, the
    same C pool (csrc/paged.c and swap.c keep its books: block tables, copy-on-write, the
    prefix cache, swapping, statistics, pictures), with a GPU store (kvlab._cuda.KVStore)
    that copies, writes and reads the rows the pool names. Its arguments, methods and errors
    are PagedPool's; reading K and V (key_codes, gather ...) copies them from the GPU, and
    keep() is refused (the GPU reads row i as position i). `store` replaces the GPU store:
    any object with KVStore's copy_rows, write, read and put (the tests give a NumPy one).
    Its device, read off the C pool like every other attribute, is 'cuda'."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, max_seqs: int = 256, max_blocks_per_seq: int = 0,
                 hash_bits: int = 64, key_format: str = "fp32", value_format: str = "fp32",
                 key_group: int = 0, value_group: int = 0, window: int = 0,
                 prefix_cache: bool = True, store=None):
        fmt = CacheFormat.make(head_dim, key=key_format, value=value_format,
                               key_group=key_group or None, value_group=value_group or None,
                               window=window)
        check_format(fmt)
        if (max_blocks_per_seq or num_blocks) * block_size > MAX_POSITIONS:
            raise ValueError(f"a GPU pool's sequences hold at most {MAX_POSITIONS} positions: "
                             f"max_blocks_per_seq={max_blocks_per_seq or num_blocks} is too many")
        if store is None:
            store = _device_store(n_layers, n_kv_heads, head_dim, num_blocks * block_size, fmt)
        super().__init__(n_layers, n_kv_heads, head_dim, num_blocks, block_size, max_seqs,
                         max_blocks_per_seq, hash_bits, prefix_cache=prefix_cache, store=store,
                         **fmt.core_arguments())
        self._fmt, self._store = fmt, store

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + ", device='cuda')"


class CudaModel(Model):
    """A Model whose forward passes run on the GPU: the same methods (prefill, decode,
    forward, forward_batch, new_cache, new_paged_pool, counting ...), with caches and pools
    in GPU memory. Made by model.to("cuda") or kvlab.load(..., device="cuda")."""

    device = "cuda"

    def __init__(self, model: Model):
        ext = extension()
        c = model.config
        if c.head_dim % 8 or c.head_dim > MAX_HEAD_DIM:
            raise ConfigError(f"the CUDA backend needs head_dim a multiple of 8 up to "
                              f"{MAX_HEAD_DIM}, this model has {c.head_dim}")
        # The kernels read float32 weights: a model stored in fewer bytes runs its values,
        # with float32 activations (the GPU's logits are then the float32 model's).
        if model.weight_format != "fp32":
            warnings.warn(f"the GPU backend reads float32 weights: this model's "
                          f"{model.weight_format} matrices go to the GPU as their float32 values "
                          f"(4 bytes a weight) and its products use float32 activations, so "
                          f"its logits are the float32 model's over those values", stacklevel=3)
        super().__init__(c, model.weights.float32(), model.tokenizer, model.source)
        self._gpu = ext.Model(*self._core_arguments())
        self._gpu_lock = threading.Lock()

    def to(self, device: str) -> Model:
        return Model.to(self, device)

    # ---- caches ----------------------------------------------------------------------
    def new_cache(self, max_seq_len: Optional[int] = None, dtype: str = "fp32",
                  **format_options) -> CudaCache:
        """A contiguous KV cache in GPU memory (see Model.new_cache); fp32, fp16, bf16 or int8."""
        fmt = self.cache_format(dtype, **format_options)
        c = self.config
        return CudaCache(c.n_layers, c.n_kv_heads, c.head_dim, self._capacity(max_seq_len), fmt)

    def new_paged_pool(self, num_blocks: int, block_size: int = 16, dtype: str = "fp32",
                       max_seqs: int = 256, max_blocks_per_seq: Optional[int] = None,
                       prefix_cache: bool = True, **format_options) -> CudaPagedPool:
        """A paged pool with its K and V in GPU memory (see Model.new_paged_pool)."""
        fmt = self.cache_format(dtype, **format_options)
        return CudaPagedPool(*self._pool_sizes(num_blocks, block_size, max_seqs,
                                               max_blocks_per_seq),
                             prefix_cache=arguments.flag(prefix_cache, "prefix_cache"),
                             **fmt.core_arguments())

    # ---- running ---------------------------------------------------------------------
    def _counts(self, runs: Sequence[Tuple[int, int]], all_logits: bool,
                fmt: CacheFormat) -> np.ndarray:
        """What a call did, worked out from the shapes (kvlab.measure) since the GPU does not
        count: one pass over the weights for the whole batch, attention per run."""
        total = Counts()
        for n, start in runs:
            total = total + forward_counts(self.config, n, start, all_logits, fmt)
        once = forward_counts(self.config, sum(n for n, _ in runs), 0, all_logits, fmt)
        total.weight_bytes, total.calls = once.weight_bytes, 1
        total.scratch_bytes = self._gpu.scratch_bytes
        return np.array([getattr(total, name) for name in core.COUNTERS], dtype=np.int64)

    def _check_shape(self, holder) -> None:
        c = self.config
        if (holder.n_layers, holder.n_kv_heads, holder.head_dim) != (c.n_layers, c.n_kv_heads, c.head_dim):
            raise ValueError(f"this cache holds {holder.n_layers} layers x {holder.n_kv_heads} KV "
                             f"heads x {holder.head_dim}, but the model needs {c.n_layers} x "
                             f"{c.n_kv_heads} x {c.head_dim}")

    def _run(self, tokens: np.ndarray, cache, all_logits: bool,
             one_layer_kv: bool = False) -> np.ndarray:
        if one_layer_kv:
            raise ValueError("uncached_kv='one_layer' runs on the CPU; the GPU's no-cache path "
                             "holds every layer's K and V")
        if cache is None:
            logits = self._forward_uncached(tokens, all_logits)
        elif isinstance(cache, CudaCache):
            logits = self._forward_cache(tokens, cache, all_logits)
        elif isinstance(cache, core.PagedSequence) and isinstance(cache.pool, CudaPagedPool):
            logits = self._forward_paged([cache], [tokens], all_logits)
        else:
            raise TypeError(f"a model on the GPU runs over caches made by its own new_cache() or "
                            f"new_paged_pool(), not a {type(cache).__name__} kept on the CPU")
        return logits if all_logits else logits[0]

    def _forward(self, tokens, store, runs, tables, block_size, slots, all_logits):
        counts = np.array([n for n, _ in runs], dtype=np.int32)
        starts = np.array([s for _, s in runs], dtype=np.int32)
        return self._gpu.forward(tokens, store, counts, starts, tables, block_size, slots, all_logits)

    def _forward_uncached(self, tokens: np.ndarray, all_logits: bool) -> np.ndarray:
        """The no-cache path: the whole sequence in a scratch cache thrown away afterwards."""
        c, n = self.config, len(tokens)
        fmt = CacheFormat()
        with self._gpu_lock:   # calls on one GPU model take turns
            store = _device_store(c.n_layers, c.n_kv_heads, c.head_dim, n, fmt)
            logits = self._forward(tokens, store, [(n, 0)], np.zeros((1, 1), np.int32), n,
                                   np.arange(n, dtype=np.int64), all_logits)
        self._record(self._counts([(n, 0)], all_logits, fmt))
        return logits

    def _forward_cache(self, tokens: np.ndarray, cache: CudaCache, all_logits: bool) -> np.ndarray:
        self._check_shape(cache)
        n = len(tokens)
        with cache._using(), self._gpu_lock:
            start = cache.length
            if n > cache.capacity - start:
                raise CacheFullError(f"the KV cache is full: it holds {start} of {cache.capacity} "
                                     f"positions and cannot take {n} more (make it with a larger "
                                     "max_seq_len, or truncate/reset it)")
            # a contiguous cache is a paged one with a single block as long as the cache
            logits = self._forward(tokens, cache._store, [(n, start)], np.zeros((1, 1), np.int32),
                                   cache.capacity, np.arange(start, start + n, dtype=np.int64),
                                   all_logits)
            cache._length = start + n
        self._record(self._counts([(n, start)], all_logits, cache._fmt))
        return logits

    def _forward_paged(self, seqs: Sequence, arrays: Sequence[np.ndarray],
                       all_logits: bool) -> np.ndarray:
        """One call over sequences of one CudaPagedPool, as kv_model_forward_batch runs one
        on the CPU: the pool checks everything and reserves (csrc/paged.c,
        kv_pool_reserve_batch), the GPU writes the new rows and computes, the pool commits.
        If the GPU fails, the pool cancels: every sequence is as it was."""
        pool = seqs[0].pool
        self._check_shape(pool)
        counts = np.array([len(a) for a in arrays], dtype=np.int32)
        tokens, block_size = np.concatenate(arrays), pool.block_size
        with self._gpu_lock:   # calls on one GPU model take turns
            # refused (OutOfBlocks ...) with the pool unchanged, or the pool is held (busy to
            # any other use) until the commit or the cancel below
            starts, tables, slots = pool._reserve_batch(seqs, counts)
            try:
                n_logits = len(tokens) if all_logits else len(seqs)
                self._gpu.reserve(len(tokens), len(seqs), tables.shape[1],
                                  int((starts + counts).max()), n_logits)
                logits = self._gpu.forward(tokens, pool._store, counts, starts, tables,
                                           block_size, slots, all_logits)
                pool._commit_batch(seqs, tokens, counts)
            except BaseException:
                pool._cancel_batch(seqs)
                raise
        self._record(self._counts(list(zip(counts.tolist(), starts.tolist())), all_logits,
                                  pool._fmt))
        return logits

    def forward_batch(self, seqs: Sequence, chunks: Sequence[TokenArray],
                      all_logits: bool = False) -> np.ndarray:
        """One engine step over sequences of one CudaPagedPool (see Model.forward_batch):
        each row of the returned logits is its sequence's last new token's."""
        if len(seqs) != len(chunks):
            raise ValueError(f"{len(seqs)} sequences but {len(chunks)} chunks of tokens")
        if len(seqs) == 0:
            raise ValueError("seqs must hold at least one sequence")
        for i, seq in enumerate(seqs):
            if not isinstance(seq, core.PagedSequence) or not isinstance(seq.pool, CudaPagedPool):
                raise TypeError(f"seqs[{i}] is not a sequence of a GPU pool (model.new_paged_pool())")
        arrays = [as_token_array(chunk, self.config.vocab_size) for chunk in chunks]
        return self._forward_paged(list(seqs), arrays, bool(all_logits))

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + ", device='cuda')"


DEVICE_MODELS["cuda"] = CudaModel          # Model.to("cuda")


__all__ = ["is_available", "why_not", "device_info", "extension", "check_format", "FORMATS",
           "CudaModel", "CudaCache", "CudaPagedPool"]
