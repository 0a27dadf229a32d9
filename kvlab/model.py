"""kvlab.Model: a loaded model with the C forward pass, and how to call it from NumPy.

A Model bundles a ModelConfig, its Weights (NumPy arrays, often memory-mapped from the
checkpoint file and never copied; matrices in float32 or fewer bytes, see
kvlab.weight_formats), an optional tokenizer, and the compiled core. It
converts and checks Python inputs, then hands them to C. It is not the generation loop
(kvlab.generate) nor the math (csrc/model.c; readable twin: kvlab.reference).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import numpy as np

from . import arguments
from .blocks import blocks_for
from ._core import core
from .config import ModelConfig
from .counts import Counts
from .deprecation import format_arguments, renamed
from .errors import CacheFullError, ContextLengthError, TokenizerError
from .quant import CacheFormat
from .sampling import check_sampling_args, sample
from .paged import PagedPool, PagedSequence, check_token_elements
from .tokenizer import Tokenizer
from . import weight_formats
from .weights import MATRICES, Weights, pin

KVCache = core.KVCache

SCRATCH = core.COUNTERS.index("scratch_bytes")

TokenArray = Union[Sequence[int], np.ndarray]
Cache = Union[KVCache, PagedSequence]
# What forward() without a cache may hold of the K and V it rebuilds (chapter 1)
UNCACHED_KV = ("all_layers", "one_layer")


def as_token_array(tokens: TokenArray, vocab_size: int) -> np.ndarray:
    """Token ids as a 1-D int32 array, with a clear error for anything else: a bool, a
    float (even 2.0) or a string among them is a TypeError, as it is for forward."""
    array = check_token_elements(tokens)
    if array.size == 0:
        raise ValueError("token ids must be a non-empty 1-D sequence, got none")
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"token ids must be a non-empty 1-D sequence, got shape {array.shape}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is out of range [0, {vocab_size})")
    # a copy when the C core could not read it in place: another type, strides, or an
    # address that is not a multiple of 4 (a view into bytes at an odd offset)
    return np.require(array, np.int32, ["C_CONTIGUOUS", "ALIGNED"])


def one_token(token, vocab_size: int, method: str) -> np.ndarray:
    """A single token id (a Python or NumPy integer, not a bool) as a 1-element array."""
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
        raise arguments.ArgumentTypeError(f"{method} takes one integer token id, got {token!r}")
    return as_token_array([token], vocab_size)


def _as_counts(array: np.ndarray) -> Counts:
    return Counts(**dict(zip(core.COUNTERS, array.tolist())))


def _accumulate(total: np.ndarray, call: np.ndarray) -> None:
    """Adds one call's counters to a running total; scratch_bytes keeps the peak."""
    peak = max(total[SCRATCH], call[SCRATCH])
    total += call
    total[SCRATCH] = peak


def _device_name(device: str) -> str:
    """'cpu' or 'cuda' for a device string ('cuda:0' is the first GPU, the only one used)."""
    name = str(device).lower()
    if name in ("cpu", "cuda", "cuda:0"):
        return name[:4] if name.startswith("cuda") else name
    raise ValueError(f"unknown device {device!r}: kvlab runs on 'cpu' or 'cuda' (the first GPU)")


# How to move a model to another device, by device name. A backend registers itself when
# it is imported (kvlab.cuda does, and kvlab imports it), so this file imports none.
DEVICE_MODELS: Dict[str, Callable[["Model"], "Model"]] = {}


def _device_of(cache) -> str:
    """Where a cache (or a paged pool's sequence) keeps its K and V."""
    return getattr(cache, "device", None) or getattr(getattr(cache, "pool", None), "device", "cpu")


class Model:
    """A Llama-family model ready to run: config, weights, tokenizer and the C core."""

    device = "cpu"   # where forward passes run; kvlab.cuda.CudaModel runs them on the GPU

    def __init__(self, config: ModelConfig, weights: Weights,
                 tokenizer: Optional[Tokenizer] = None, source: str = "",
                 activations: Optional[str] = None):
        """activations: how products with block-format matrices (Q8_0, Q4_0, Q4_1) treat
        their input. "int8" quantizes it per block of 32 too and sums integer products, as
        llama.cpp does (faster; not the float32 product); "fp32" keeps it float32, so every
        logit equals, bit for bit, the float32 model's over the dequantized weights. None:
        "int8" when a matrix is Q8_0, Q4_0 or Q4_1, else "fp32"; "int8" without one is
        refused."""
        weights.check(config)
        has_blocks = bool(set(weights.formats.values()) & set(weight_formats.BLOCK_FORMATS))
        if activations is None:
            activations = "int8" if has_blocks else "fp32"
        if activations not in ("fp32", "int8"):
            raise ValueError(f"activations must be 'fp32' or 'int8', got {activations!r}")
        if activations == "int8" and not has_blocks:
            raise ValueError("activations='int8' goes with Q8_0, Q4_0 or Q4_1 weights, and "
                             "this model has none: load it with weights='q8_0' (or leave "
                             "activations unset)")
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.source = source
        self.activations = activations
        self._core = core.Model(*self._core_arguments(),
                                formats=self._stored_formats(),
                                int8_activations=activations == "int8")
        # what every forward call did, as counted by the core (see kvlab.measure.Counts):
        # totals for the model, and per thread the arrays of open counting() blocks
        self._counters = np.zeros(len(core.COUNTERS), dtype=np.int64)
        self._counters_lock = threading.Lock()
        self._thread = threading.local()

    def _stored_formats(self) -> Dict[str, str]:
        """The matrices not stored as float32, and their formats, for the core."""
        return {name: fmt for name, fmt in self.weights.formats.items() if fmt != "fp32"}

    def _core_arguments(self) -> tuple:
        """The config dict and weight arrays a compiled model (CPU or CUDA) is made from:
        a matrix stored in fewer bytes as the uint8 rows the core reads."""
        config = self.config
        arrays = {name: weight_formats.as_bytes(array) if name in MATRICES else array
                  for name, array in self.weights.items()}
        arrays["rope_inv_freq"] = config.rope_inv_freq()
        # the core reads these arrays' memory for as long as the model lives: while weak
        # references to them (and to the arrays they view) are held, NumPy refuses to
        # resize any of them, refcheck=False or not, so none can be freed under the core
        self._pinned = pin(arrays.values())
        core_config = {
            "dim": config.dim, "hidden_dim": config.hidden_dim, "n_layers": config.n_layers,
            "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "vocab_size": config.vocab_size,
            "max_seq_len": config.max_seq_len, "norm_eps": float(config.norm_eps),
            "rope_interleaved": bool(config.rope_interleaved),
        }
        return core_config, arrays

    def to(self, device: str) -> "Model":
        """This model on `device`: 'cpu', or 'cuda' for a kvlab.cuda.CudaModel that shares
        this model's config, weights (copied once to the GPU) and tokenizer. Returns self
        when it is there already. Caches are made by the model they are for."""
        name = _device_name(device)
        if name == self.device:
            return self
        if name != "cpu":
            return DEVICE_MODELS[name](self)
        return Model(self.config, self.weights, self.tokenizer, self.source, self.activations)

    # ---- counting ----------------------------------------------------------------------
    @property
    def counters(self) -> Counts:
        """FLOPs, bytes and peak scratch of every forward call since the last reset,
        counted by the C core as it ran."""
        with self._counters_lock:
            return _as_counts(self._counters)

    def reset_counters(self) -> None:
        with self._counters_lock:
            self._counters[:] = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counts]:
        """with model.counting() as counts: ... -- counts holds what the calls made inside
        the block, by this thread, did (with its own scratch peak); the model's totals
        include them too."""
        block = np.zeros(len(core.COUNTERS), dtype=np.int64)
        open_blocks = self._thread.__dict__.setdefault("blocks", [])
        open_blocks.append(block)
        counts = Counts()
        try:
            yield counts
        finally:
            # by identity: list.remove would compare the arrays, which fails when blocks nest
            del open_blocks[next(i for i, b in enumerate(open_blocks) if b is block)]
            counts.__dict__.update(_as_counts(block).__dict__)

    def _record(self, call: np.ndarray) -> None:
        """Adds one call's counters to the model's totals and to open counting() blocks."""
        with self._counters_lock:
            _accumulate(self._counters, call)
        for block in getattr(self._thread, "blocks", ()):
            _accumulate(block, call)

    def _check_device(self, cache) -> None:
        if cache is not None and _device_of(cache) != self.device:
            raise ValueError(f"this cache keeps its K and V on {_device_of(cache)!r} but the model "
                             f"runs on {self.device!r}: make caches with the model that uses them")

    def _check_window(self, cache, n_new: int) -> None:
        """A sliding-window model attends to its last config.sliding_window positions only;
        the core attends to every row a cache holds, so a call that would leave more rows
        than that visible is refused, not run with the wrong attention."""
        window = self.config.sliding_window
        if window is None:
            return
        if cache is None:
            oldest, newest = 0, n_new - 1
        else:
            # the newest query must not see a kept row older than its window (a cache that
            # dropped rows knows which positions its rows hold)
            next_position = getattr(cache, "next_position", cache.length)   # GPU: no drops
            newest = next_position + n_new - 1
            kept = None
            if cache.length and isinstance(cache, KVCache):
                kept = cache.positions
            elif cache.length and isinstance(cache, PagedSequence) and hasattr(cache.pool, "positions"):
                kept = cache.pool.positions(cache)
            oldest = int(kept.min()) if kept is not None else next_position - cache.length
        if newest - oldest + 1 > window:
            raise ValueError(
                f"this model attends to its last {window} positions (config.sliding_window), "
                f"but this call would let position {newest} see position {oldest}: run it "
                f"over a cache that keeps only the last {window}, "
                f"kvlab.cache_policy.SlidingWindow({window}) (kvlab.generate does so by itself)")

    def _run(self, tokens: np.ndarray, cache, all_logits: bool,
             one_layer_kv: bool = False) -> np.ndarray:
        """One forward call through the core, its counts added where they belong."""
        self._check_weights()
        self._check_device(cache)
        self._check_window(cache, len(tokens))
        call = np.zeros(len(core.COUNTERS), dtype=np.int64)
        logits = self._core.forward(tokens, cache, all_logits, call, one_layer_kv)
        self._record(call)
        return logits

    # ---- caches ----------------------------------------------------------------------
    def cache_format(self, dtype: Union[str, CacheFormat] = "fp32", *,
                     key_format: Optional[str] = None, value_format: Optional[str] = None,
                     group: Optional[int] = None, key_group: Optional[int] = None,
                     value_group: Optional[int] = None, window: int = 0,
                     key_dtype: Optional[str] = None,
                     value_dtype: Optional[str] = None) -> CacheFormat:
        """The CacheFormat these arguments describe for this model's heads: dtype is one of
        fp32, fp16, bf16, int8, int4, fp8 for both K and V, key_format/value_format override
        it for one side; group is the values per scale (default: one scale per head for int8
        and fp8, 32 values for int4); window keeps the most recent positions in float32.
        dtype may be a CacheFormat instead, alone; it is checked against this model's
        head_dim. key_dtype and value_dtype are the old names of key_format and value_format
        (deprecated)."""
        key_format, value_format = format_arguments(key_format, value_format, key_dtype,
                                                    value_dtype)
        return CacheFormat.make(self.config.head_dim, dtype, key=key_format, value=value_format,
                                group=group, key_group=key_group, value_group=value_group,
                                window=window)

    def new_cache(self, max_seq_len: Optional[int] = None, dtype: Union[str, CacheFormat] = "fp32",
                  **format_options) -> KVCache:
        """A contiguous KV cache for one sequence, holding up to max_seq_len positions
        (default: the model's context length). Its memory is reserved now, in full.
        dtype and format_options (key_format, value_format, group, key_group, value_group,
        window) choose how K and V are stored: see cache_format()."""
        fmt = self.cache_format(dtype, **format_options)
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self._capacity(max_seq_len),
                       **fmt.core_arguments())

    def _capacity(self, max_seq_len: Optional[int]) -> int:
        """A cache's positions, checked (default: the model's context length)."""
        return arguments.positive(self.config.max_seq_len if max_seq_len is None else max_seq_len,
                                  "max_seq_len")

    def _pool_sizes(self, num_blocks, block_size, max_seqs, max_blocks_per_seq) -> tuple:
        """(n_layers, n_kv_heads, head_dim, num_blocks, block_size, max_seqs,
        max_blocks_per_seq) of a pool, checked; max_blocks_per_seq defaults to enough
        blocks for the model's context."""
        num_blocks = arguments.positive(num_blocks, "num_blocks")
        block_size = arguments.positive(block_size, "block_size")
        max_seqs = arguments.positive(max_seqs, "max_seqs")
        if max_blocks_per_seq is None:
            max_blocks_per_seq = blocks_for(self.config.max_seq_len, block_size)
        max_blocks_per_seq = arguments.positive(max_blocks_per_seq, "max_blocks_per_seq")
        c = self.config
        return (c.n_layers, c.n_kv_heads, c.head_dim, int(num_blocks), int(block_size),
                int(max_seqs), int(max_blocks_per_seq))

    def new_paged_pool(self, num_blocks: int, block_size: int = 16,
                       dtype: Union[str, CacheFormat] = "fp32",
                       max_seqs: int = 256, max_blocks_per_seq: Optional[int] = None,
                       prefix_cache: bool = True, **format_options) -> PagedPool:
        """A paged KV cache: num_blocks blocks of block_size positions, shared by up to
        max_seqs sequences, each at most max_blocks_per_seq blocks long (default: enough
        for the model's context). Make sequences with pool.new_sequence(). dtype and
        format_options choose how K and V are stored, as for new_cache(). With
        prefix_cache=False full blocks are never shared by their tokens (reuse_prefix
        finds nothing, and equal prompts take their own blocks)."""
        fmt = self.cache_format(dtype, **format_options)
        return PagedPool(*self._pool_sizes(num_blocks, block_size, max_seqs, max_blocks_per_seq),
                         prefix_cache=arguments.flag(prefix_cache, "prefix_cache"),
                         **fmt.core_arguments())

    # ---- running ---------------------------------------------------------------------
    def forward(self, tokens: TokenArray, cache: Optional[Cache] = None,
                all_logits: bool = False, *, uncached_kv: str = "all_layers") -> np.ndarray:
        """The forward pass, the one entry to it. With a cache (a KVCache, or a
        PagedSequence of a paged pool), the tokens are the sequence's next positions: their
        K and V are computed once and appended, and they attend over everything the cache
        holds. Without one, the tokens are the whole sequence from position 0, every K and
        V recomputed, as a model without a KV cache does on every step. Returns the last
        token's logits (vocab,), or every new token's (len(tokens), vocab) with all_logits.
        prefill and decode below are the same call under the names the chapters use.

        uncached_kv says what a call without a cache holds of the K and V it rebuilds:
        "all_layers" (the cached path over a cache thrown away afterwards) or "one_layer"
        (each layer's over the last one's: a layer attends only to the K and V it has just
        computed). The same logits, bit for bit; chapter 1 compares their memory."""
        if isinstance(cache, (bool, np.bool_)):      # the old forward(tokens, all_logits)
            renamed("model.forward(tokens, all_logits) with all_logits second",
                    "model.forward(tokens, all_logits=...)")
            cache, all_logits = None, bool(cache)
        all_logits = arguments.flag(all_logits, "all_logits")
        if uncached_kv not in UNCACHED_KV:
            raise ValueError(f"uncached_kv must be one of {', '.join(UNCACHED_KV)}, "
                             f"got {uncached_kv!r}")
        if uncached_kv != "all_layers" and cache is not None:
            raise ValueError("uncached_kv is how a call without a cache holds K and V: "
                             "give cache=None")
        return self._forward_ids(as_token_array(tokens, self.config.vocab_size), cache,
                                 all_logits, uncached_kv == "one_layer")

    def _forward_ids(self, ids: np.ndarray, cache: Optional[Cache], all_logits: bool,
                     one_layer_kv: bool = False) -> np.ndarray:
        """forward() once the ids are checked (decode checks its one token its own way)."""
        if cache is None and len(ids) > self.config.max_seq_len:
            raise ContextLengthError(f"{len(ids)} tokens exceed the model's context of "
                                     f"{self.config.max_seq_len} (config.max_seq_len)")
        return self._run(ids, cache, all_logits, one_layer_kv)

    def prefill(self, tokens: TokenArray, cache: Cache, all_logits: bool = False) -> np.ndarray:
        """Run a prompt (or any chunk of new tokens) in one causal pass, appending its K
        and V to the cache: forward(tokens, cache). Returns the last token's logits
        (vocab,), or every token's (len(tokens), vocab) with all_logits=True."""
        return self.forward(tokens, cache, all_logits)

    def decode(self, token: int, cache: Cache) -> np.ndarray:
        """One generation step: a single new token attends over the cache,
        forward([token], cache). Returns (vocab,)."""
        return self._forward_ids(one_token(token, self.config.vocab_size, "decode"), cache, False)

    def decode_steps(self, token: int, cache: Cache, max_steps: int, temperature: float = 0.0,
                     top_k: Optional[int] = None, top_p: Optional[float] = None,
                     rng: Optional[np.random.Generator] = None,
                     stop_token: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Up to max_steps decode steps from `token` (chosen, not yet in the cache): each
        step runs the newest token over the cache and chooses the next from its logits,
        exactly as decode() + kvlab.sampling.sample would (greedy at temperature 0, else
        one number from rng per step, in order). Stops after the step that picks
        stop_token. Returns every step's pick (int32) and wall time in seconds (float64).

        Over a KVCache the whole loop runs in C with the GIL released: no Python and no
        allocation between tokens, which is what a tiny model's step is otherwise mostly
        made of; it draws its max_steps numbers from rng before the first step, then leaves
        rng as if each step had drawn its own, as stepping does. Other caches (paged, GPU)
        step through decode() here.

        A call that fails part-way (Ctrl-C, which stops it between two tokens, or logits
        that hold NaN) keeps every step it completed: the cache holds their tokens (and the
        failed step's own, for NaN logits), and the exception carries the completed steps'
        picks and times as `error.completed`, a (tokens, seconds) pair."""
        max_steps, rng, stop = self._check_decode_steps(token, cache, max_steps, temperature,
                                                        top_k, top_p, rng, stop_token)
        if isinstance(cache, KVCache):
            return self._decode_steps_in_c(token, cache, max_steps, temperature, top_k, top_p,
                                           rng, stop)
        return self._decode_steps_in_python(token, cache, max_steps, temperature, top_k, top_p,
                                            rng, stop)

    def _check_decode_steps(self, token, cache, max_steps, temperature, top_k, top_p, rng,
                            stop_token) -> Tuple[int, Optional[np.random.Generator], int]:
        """decode_steps' arguments checked before a step runs: max_steps as an int, the
        generator to draw from (a fresh one when sampling without one), and the stop token
        as the C loop takes it (-1: none)."""
        self._check_weights()
        one_token(token, self.config.vocab_size, "decode_steps")
        max_steps = arguments.positive(max_steps, "max_steps")
        check_sampling_args(temperature, top_k, top_p)
        stop = -1 if stop_token is None else arguments.integer(stop_token, "stop_token", None, None)
        if not -1 <= stop < self.config.vocab_size:
            raise ValueError(f"stop_token {stop_token} is out of range [0, "
                             f"{self.config.vocab_size}) (or None for no stop)")
        if rng is not None and not callable(getattr(rng, "random", None)):
            raise arguments.ArgumentTypeError(f"rng must be a numpy.random.Generator (or have its random()) or None, "
                                              f"got {type(rng).__name__}")
        self._check_device(cache)
        self._check_window(cache, max_steps)
        if temperature > 0.0 and rng is None:
            rng = np.random.default_rng()
        return max_steps, rng, stop

    def _decode_steps_in_c(self, token: int, cache: KVCache, max_steps: int, temperature: float,
                           top_k, top_p, rng, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """decode_steps over a KVCache: the whole loop in the core, the GIL released."""
        # each step adds a row: past the cache's room, the next step raises CacheFullError
        # whatever max_steps says, so no more numbers are drawn than steps can run
        # (max_steps=2**31-1 would otherwise ask NumPy for 16 GiB of them)
        max_steps = min(max_steps, max(cache.capacity - cache.length, 0) + 1)
        call = np.zeros(len(core.COUNTERS), dtype=np.int64)
        # the numbers each sampled step draws with, the same ones sample() would take;
        # drawn ahead, then rng is set to have given exactly those the steps used
        uniforms, before = None, None
        if temperature > 0.0:
            before = rng.bit_generator.state
            uniforms = rng.random(max_steps)
        used = 0
        try:
            picks, seconds = self._core.generate(
                int(token), cache, max_steps, temperature, top_k or 0,
                1.0 if top_p is None else top_p, uniforms, stop, call)
            used = len(picks)
        except BaseException as error:
            # an interrupt comes between steps; NaN logits fail a step that drew its number;
            # a full cache stops a step before it runs, so before it draws
            drew = isinstance(error, ValueError) and not isinstance(error, CacheFullError)
            used = len(getattr(error, "completed", ((),))[0]) + drew
            raise
        finally:
            self._record(call)
            if before is not None:
                rng.bit_generator.state = before
                rng.random(used)
        return picks, seconds

    def _decode_steps_in_python(self, token: int, cache: Cache, max_steps: int,
                                temperature: float, top_k, top_p, rng,
                                stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """decode_steps over any other cache (paged, GPU): decode() and sample(), step by step."""
        picks, seconds = [], []
        try:
            for step in range(max_steps):
                start = time.perf_counter()
                logits = self.decode(token, cache)
                try:
                    token = sample(logits, temperature, top_k, top_p, rng)
                except ValueError as error:       # the arguments were checked: bad logits
                    raise ValueError(f"decode step {step} (position {cache.length - 1}): "
                                     f"{error}; the cache keeps that step's token and the "
                                     f"{step} steps before") from None
                seconds.append(time.perf_counter() - start)
                picks.append(token)
                if token == stop:
                    break
        except BaseException as error:      # as the C loop does: keep what was completed
            error.completed = (np.array(picks, dtype=np.int32), np.array(seconds))
            raise
        return np.array(picks, dtype=np.int32), np.array(seconds)

    # ---- text ------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError("this model was loaded without a tokenizer; pass token ids, "
                                 "or load it with tokenizer=PATH")
        return self.tokenizer

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        """Token ids of `text`. bos None: BOS first if this model's tokenizer adds one (its
        add_bos: llama2.c and SentencePiece vocabularies do, SmolLM2's does not)."""
        return self._require_tokenizer().encode(text, bos=bos)

    def forward_batch(self, seqs: Sequence[PagedSequence], chunks: Sequence[TokenArray],
                      all_logits: bool = False) -> np.ndarray:
        """One step of a batching engine: each sequence (of one paged pool) gets its chunk
        of new tokens (part of a prompt, or one decode token), all run through the model
        together, every weight matrix streamed once per TOKEN_CHUNK (96) tokens of the
        batch (once for a decode step of up to 96 sequences). Returns the last token's logits of each
        sequence, (len(seqs), vocab), or with all_logits every token's, (total tokens,
        vocab) in the chunks' order; each row bit-identical to running that sequence
        alone. A call of more than about measure.CHUNK_FLOPS of work stops for Ctrl-C
        between two layers: KeyboardInterrupt, every sequence as before the call."""
        self._check_weights()
        if len(seqs) != len(chunks):
            raise ValueError(f"{len(seqs)} sequences but {len(chunks)} chunks of tokens")
        if len(seqs) == 0:
            raise ValueError("forward_batch needs at least one sequence and its chunk")
        arrays = [as_token_array(chunk, self.config.vocab_size) for chunk in chunks]
        for seq, chunk in zip(seqs, arrays):
            self._check_device(seq)
            self._check_window(seq, len(chunk))
        counts = np.array([len(a) for a in arrays], dtype=np.int32)
        call = np.zeros(len(core.COUNTERS), dtype=np.int64)
        logits = self._core.forward_batch(list(seqs), np.concatenate(arrays), counts, call,
                                          arguments.flag(all_logits, "all_logits"))
        self._record(call)
        return logits

    def decode_text(self, ids: Sequence[int]) -> str:
        """The text of token ids (integers: a bool, a float or a string among them is
        refused, as forward refuses them, not read as 1, 2 or a digit)."""
        tokenizer = self._require_tokenizer()
        if not isinstance(ids, (list, tuple, np.ndarray)):
            ids = list(ids)                     # read once, here and by the tokenizer
        check_token_elements(ids)
        return tokenizer.decode(ids)

    # ---- facts -----------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        return self.config.n_params()

    @property
    def weights_nbytes(self) -> int:
        """Bytes of weight memory (a tied classifier counted once), in the formats stored."""
        return self.weights.nbytes

    @property
    def weight_format(self) -> str:
        """The matrices' format ('fp32', 'fp16', 'bf16', 'q8_0', 'q4_0', 'q4_1'), or 'mixed'."""
        return self.weights.format

    def __repr__(self) -> str:
        c = self.config
        name = c.name or self.source or "model"
        stored = "" if self.weight_format == "fp32" else (
            f", weights={self.weight_format}" + (", int8 activations" if self.activations == "int8" else ""))
        return (f"Model({name!r}: {self.n_params:,} params, dim={c.dim}, n_layers={c.n_layers}, "
                f"n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads} ({c.attention_kind}), "
                f"head_dim={c.head_dim}, vocab={c.vocab_size}, context={c.max_seq_len}{stored})")

    def _check_weights(self) -> None:
        """CheckpointError if the file the core's weights are memory-mapped from was
        truncated or rewritten since loading (one os.fstat): reading them would crash
        (SIGBUS) or use other numbers.
        A GPU model reads its own copy."""
        if self.device == "cpu":
            self.weights.check_source()
