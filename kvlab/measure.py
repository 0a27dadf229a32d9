"""Cache-size and work arithmetic: what the chapter computes by hand, as functions.

    bytes per token = 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes per element

For the quantized formats (int8, int4, fp8) "bytes per element" includes each value's
share of its group's scale (and zero point): int8 with one scale per 128 values costs
1 + 4/128 bytes per value. A residual window adds its float32 rows once per sequence.

Also the FLOPs and bytes one forward call moves (`forward_counts`), summed over a whole
generation (`generation_counts`), and the activation scratch a call needs
(`scratch_bytes`). These are derived from the shapes alone; the C core counts the same
things while it runs (model.counters), and the tests hold the two equal. These work for
any ModelConfig, including presets far too large to load here.

The last part measures a real process: `measure_memory` (formula vs allocated vs resident
memory) and `working_memory` (peak working memory with and without a cache) run a model.
"""
from __future__ import annotations

import dataclasses

from typing import Dict, Optional, Tuple, Union

from . import arguments, weight_formats
from .blocks import blocks_for
from ._core import core
from .config import ModelConfig
from .counts import Counts  # noqa: F401 (re-exported: kvlab.measure.Counts)
from .deprecation import default_changed, format_arguments
from .generate import generate
from .process_memory import peak_resident_bytes, release_freed_memory, resident_bytes  # noqa: F401
from .quant import CacheFormat

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}
FLOAT = 4   # the C core computes in fp32
ATTENTION_TILE = 16   # K/V head rows attention reads at a time (KV_ATTENTION_TILE, csrc/attention.h)
QUERY_TILE = 8        # prefill tokens of a KV head attended together (QUERY_TILE, csrc/attention.c)


def _element_bytes(dtype: str) -> int:
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(BYTES_PER_ELEMENT)}") from None


def cache_format(config: ModelConfig, dtype: Union[None, str, CacheFormat] = None, *,
                 key_format: Optional[str] = None, value_format: Optional[str] = None,
                 group: Optional[int] = None, key_group: Optional[int] = None,
                 value_group: Optional[int] = None, window: int = 0,
                 key_dtype: Optional[str] = None, value_dtype: Optional[str] = None) -> CacheFormat:
    """The CacheFormat these arguments describe for this model's heads (checked), as
    model.new_cache() reads them: dtype a format name or a CacheFormat, fp32 if unset.
    key_dtype and value_dtype are the old names of key_format and value_format (deprecated)."""
    return _cache_format(config, dtype, "kvlab.measure.cache_format", key_format=key_format,
                         value_format=value_format, group=group, key_group=key_group,
                         value_group=value_group, window=window, key_dtype=key_dtype,
                         value_dtype=value_dtype)


def _cache_format(config: ModelConfig, dtype, caller: str, key_format: Optional[str] = None,
                  value_format: Optional[str] = None, key_dtype: Optional[str] = None,
                  value_dtype: Optional[str] = None, **options) -> CacheFormat:
    key_format, value_format = format_arguments(key_format, value_format, key_dtype, value_dtype)
    if dtype is None:
        if key_format is None or value_format is None:   # the default decides the answer
            default_changed(f"{caller}'s dtype", "'fp16'", "'fp32', as for model.new_cache",
                            stacklevel=4)
        dtype = "fp32"
    return CacheFormat.make(config.head_dim, dtype, key=key_format, value=value_format,
                            **options)


# [quote ch02-kv-bytes-per-token-and-kv-cache-bytes]
def kv_bytes_per_token(config: ModelConfig, dtype: Union[None, str, CacheFormat] = None,
                       **format_options) -> int:
    """Bytes one token adds to the cache, over all layers, K and V (scales and zero points
    included). dtype and format_options (key_format, value_format, group, key_group,
    value_group) as for model.new_cache: fp32 if unset."""
    fmt = _cache_format(config, dtype, "kv_bytes_per_token", **format_options)
    return config.n_layers * fmt.row_bytes(config.n_kv_heads, config.head_dim)


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1,
                   dtype: Union[None, str, CacheFormat] = None, **format_options) -> int:
    """Bytes of K and V for `batch` requests of `seq_len` tokens each: exactly what
    model.new_cache(seq_len, dtype, ...) allocates per request, with the same default
    (fp32). format_options: key_format, value_format, group, key_group, value_group, window."""
    seq_len = arguments.count(seq_len, "seq_len", arguments.INT64_MAX)
    batch = arguments.count(batch, "batch", arguments.INT64_MAX)
    fmt = _cache_format(config, dtype, "kv_cache_bytes", **format_options)
    if fmt.window > seq_len:
        raise ValueError(f"window ({fmt.window}) cannot be longer than the cache ({seq_len} positions)")
    per_request = (config.n_layers * fmt.row_bytes(config.n_kv_heads, config.head_dim) * seq_len
                   + fmt.window_bytes(config.n_layers, config.n_kv_heads, config.head_dim))
    return per_request * batch
# [end ch02-kv-bytes-per-token-and-kv-cache-bytes]


def weights_bytes(config: ModelConfig, dtype: str = "fp16") -> int:
    """Bytes of the model's weights stored in dtype: fp32, fp16 or bf16 (every parameter
    that many bytes), or a block format of kvlab.weight_formats: "q8_0" (34 bytes per 32),
    "q4_0" (18 per 32) or "q4_1" (20 per 32)."""
    if dtype in weight_formats.BLOCK_FORMATS:
        block_bytes = weight_formats.row_bytes(dtype, weight_formats.Q8_0_BLOCK)
        return config.n_params() * block_bytes // weight_formats.Q8_0_BLOCK
    return config.n_params() * _element_bytes(dtype)


# [quote ch06-whose-bytes]
def decode_step_bytes(config: ModelConfig, context: int, batch: int = 1,
                      weights: str = "fp16", cache: str = "fp16") -> Tuple[int, int]:
    """(weight bytes, cache bytes) one decode step of `batch` sequences reads with `context`
    positions cached each: every weight once for the whole batch, and every position's K and
    V for each sequence. An untied embedding table is left out (a step looks up one row of
    it per token, not the table); the norms are priced like the matrices (they are a few
    thousandths of the bytes)."""
    per_step = weights_bytes(config, weights)
    if not config.tied_embeddings:          # the embedding is looked up, not multiplied
        per_step -= weights_bytes(config, weights) * config.vocab_size * config.dim // config.n_params()
    return per_step, batch * context * kv_bytes_per_token(config, cache)


def crossover_context(config: ModelConfig, batch: int = 1, weights: str = "fp16",
                      cache: str = "fp16") -> float:
    """The context at which a decode step reads as many bytes of K and V as of weights."""
    weight_part, _ = decode_step_bytes(config, 0, batch, weights, cache)
    return weight_part / (batch * kv_bytes_per_token(config, cache))
# [end ch06-whose-bytes]


# ---- work per forward call ----------------------------------------------------------------

# A long forward call runs in chunks of about this much work and can be interrupted
# between them (csrc/common.h KV_CHUNK_FLOPS, csrc/model.c kv_chunk_length).
# A chunk is whole passes of the matrix kernels, which stream each weight matrix once per
# CHUNK_MIN tokens (ops.h's KV_TOKEN_CHUNK): a shorter chunk reads the weights as often.
CHUNK_FLOPS = 2e9
CHUNK_MIN = core.TOKEN_CHUNK


def work_rates(config: ModelConfig) -> Tuple[float, float]:
    """The rule's measure of work (chunk_length's, kv_chunk_length's): FLOPs per token
    run, and per earlier position one token's attention reads. kvlab.Engine splits a long
    step's forward into calls of about CHUNK_FLOPS by the same measure."""
    c = config
    q_dim, kv_dim = float(c.n_heads * c.head_dim), float(c.n_kv_heads * c.head_dim)
    per_token = (2.0 * c.n_layers * (float(c.dim) * (2.0 * q_dim + 2.0 * kv_dim)
                                     + 3.0 * float(c.dim) * c.hidden_dim)
                 + 2.0 * float(c.dim) * c.vocab_size)
    return per_token, 4.0 * c.n_layers * q_dim


def chunk_length(config: ModelConfig, start_pos: int, n_tokens: int) -> int:
    """How many of n_tokens new tokens at start_pos.. one chunk of a forward call runs (the
    C core's rule, to the bit): as many whole multiples of CHUNK_MIN as fit in CHUNK_FLOPS
    of work, at least CHUNK_MIN.
    Every chunk but the last has this length; calls with less work run in one piece."""
    start_pos = arguments.count(start_pos, "start_pos", arguments.INT64_MAX)
    n_tokens = arguments.positive(n_tokens, "n_tokens")
    per_token, per_position = work_rates(config)
    fits = CHUNK_FLOPS / (per_token + per_position * (float(start_pos) + n_tokens))
    n = n_tokens if fits >= n_tokens else int(fits) // CHUNK_MIN * CHUNK_MIN
    return min(max(n, CHUNK_MIN), n_tokens)


def forward_counts(config: ModelConfig, n_tokens: int, start_pos: int = 0,
                   all_logits: bool = False, cache: Optional[CacheFormat] = None,
                   weights: Optional[Dict[str, str]] = None) -> Counts:
    """What one forward call of n_tokens new tokens at positions start_pos.. does
    (scratch_bytes aside: see scratch_bytes()), on a cache stored as `cache` (default
    fp32): attention reads each position as stored, except the residual window's in
    float32, and writes each new row as stored plus the window's float32 copy. `weights`:
    the matrices' formats by name (Weights.formats), float32 where not named."""
    n_tokens = arguments.positive(n_tokens, "n_tokens")
    start_pos = arguments.count(start_pos, "start_pos", arguments.INT64_MAX)
    c, T = config, n_tokens
    cache = cache or CacheFormat()
    per_layer_proj = c.dim * c.q_dim + 2 * c.dim * c.kv_dim + c.q_dim * c.dim
    per_layer_mlp = 3 * c.dim * c.hidden_dim
    chunk = chunk_length(c, start_pos, T)
    chunks = [chunk] * (T // chunk) + ([T % chunk] if T % chunk else [])
    n_out = T if all_logits else 1               # without all_logits, the last row alone
    seen = T * start_pos + T * (T + 1) // 2          # positions seen, summed over the tokens
    full_row = 2 * c.kv_dim * FLOAT                  # K and V of one position, float32
    stored_row = cache.row_bytes(c.n_kv_heads, c.head_dim)
    in_window = sum(min(cache.window, start_pos + t + 1) for t in range(T)) if cache.window else 0
    formats = weights or {}

    def matrix_bytes(name: str, rows: int, in_dim: int) -> int:
        return rows * weight_formats.row_bytes(formats.get(name, "fp32"), in_dim)

    layer_bytes = (matrix_bytes("wq", c.q_dim, c.dim) + matrix_bytes("wk", c.kv_dim, c.dim)
                   + matrix_bytes("wv", c.kv_dim, c.dim) + matrix_bytes("wo", c.dim, c.q_dim)
                   + matrix_bytes("w1", c.hidden_dim, c.dim) + matrix_bytes("w3", c.hidden_dim, c.dim)
                   + matrix_bytes("w2", c.dim, c.hidden_dim) + 2 * c.dim * FLOAT)   # + the norms
    # the layers once per chunk; the final norm and the classifier once per chunk that
    # writes logits (every chunk with all_logits, else only the last)
    weights_read = (len(chunks) * c.n_layers * layer_bytes
                    + (len(chunks) if all_logits else 1)
                    * (c.dim * FLOAT + matrix_bytes("classifier", c.vocab_size, c.dim))
                    + T * matrix_bytes("token_embedding", 1, c.dim))                # embedding rows
    return Counts(
        flops_projections=2 * T * c.n_layers * per_layer_proj,
        flops_attention=4 * seen * c.n_layers * c.n_heads * c.head_dim,
        flops_mlp=2 * T * c.n_layers * per_layer_mlp,
        flops_logits=2 * n_out * c.dim * c.vocab_size,
        weight_bytes=weights_read,
        kv_read_bytes=c.n_layers * ((seen - in_window) * stored_row + in_window * full_row),
        kv_write_bytes=c.n_layers * (T * stored_row
                                     + sum(min(n, cache.window) for n in chunks) * full_row),
        tokens=T, calls=1)


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _attention_scratch(c: ModelConfig) -> int:
    """Floats of one thread's attention scratch (kv_attention_scratch, csrc/attention.c):
    the weights, running max and sum of a block's query heads, a tile of K/V rows made
    float32, and the block's queries and outputs side by side."""
    heads = QUERY_TILE * c.kv_mul
    return (_round16(heads * (ATTENTION_TILE + 2)) + ATTENTION_TILE * _round16(c.head_dim)
            + 2 * heads * c.head_dim)


def scratch_bytes(config: ModelConfig, n_tokens: int, n_threads: int = 1,
                  cached: bool = True, start_pos: int = 0,
                  weights: Optional[Dict[str, str]] = None, int8_activations: bool = False,
                  uncached_kv: str = "all_layers") -> int:
    """Activation scratch one forward call allocates (csrc/model.c, run_state): a few
    (n_tokens, width) buffers plus, per thread, the online softmax's state for each query
    head of a group (a tile of ATTENTION_TILE weights, a running max and a running sum)
    and a tile of head rows to dequantize K and V into; without a cache the whole
    sequence's K and V are rebuilt as scratch too. (A prefill attends QUERY_TILE tokens of
    a KV head together, so the softmax state is for QUERY_TILE x kv_mul query heads, beside
    a copy of their queries and their outputs; a thread's share is sized so in every call.) Nothing here grows with the context
    already cached: attention walks it a tile at a time. A long call's buffers hold one
    chunk of its tokens (chunk_length). Matrices stored in fewer bytes (`weights`, their
    formats by name) add four rows of the widest input per thread to make float32 in, or,
    for the block formats (Q8_0, Q4_0, Q4_1) with int8_activations, each token's
    activations as int8 and their scales. Where the running kernel variant has the AVX-512
    tiles (kvlab._kvlab.PACKED_INPUTS), their products allocate more, one product at a time
    (csrc/ops.h; the widest input's): the float32 tile, from 4 tokens, a packed copy of a
    chunk of TOKEN_CHUNK tokens of its input; the int8 tile (block formats with int8
    activations), from 8 tokens, each token's blocks' starting sums and a panel of 16 rows
    per thread (fewer tokens stream the rows and allocate nothing).

    Without a cache (cached=False), uncached_kv says how the K and V are held, as
    Model.forward's argument does: "all_layers" (every layer's, the buffers a chunk of the
    tokens at a time) or "one_layer" (one layer's, the buffers for every token at once: a
    chunk of tokens through every layer would need the earlier chunks' K and V of every
    layer, so it goes layer by layer over all the tokens). cached=True takes only
    "all_layers", as Model.forward does."""
    n_tokens = arguments.positive(n_tokens, "n_tokens")
    n_threads = arguments.positive(n_threads, "n_threads")
    start_pos = arguments.count(start_pos, "start_pos", arguments.INT64_MAX)
    if uncached_kv not in ("all_layers", "one_layer"):
        raise ValueError(f"uncached_kv must be all_layers or one_layer, got {uncached_kv!r}")
    if cached and uncached_kv != "all_layers":      # as Model.forward refuses it
        raise ValueError("uncached_kv is how a call without a cache holds K and V: "
                         "give cached=False")
    one_layer = not cached and uncached_kv == "one_layer"
    c = config
    T = n_tokens if one_layer else chunk_length(config, start_pos, n_tokens)
    buffers = [T * c.dim, T * c.dim, T * c.q_dim, T * c.kv_dim, T * c.kv_dim, T * c.q_dim,
               T * c.dim, T * c.hidden_dim, T * c.hidden_dim, T * c.head_dim // 2,
               T * c.head_dim // 2,
               n_threads * _attention_scratch(c)]
    # (the embedding is read a row at a time, straight into the residual stream)
    formats = {fmt for name, fmt in (weights or {}).items() if name != "token_embedding"}
    widest = max(c.dim, c.hidden_dim, c.q_dim)
    blocks = formats & set(weight_formats.BLOCK_FORMATS)
    if formats & {"fp16", "bf16"} or (blocks and not int8_activations):
        buffers.append(n_threads * 4 * widest)
    if blocks and int8_activations:
        # each block's scale and its scale times the sum of its codes, then the codes
        buffers += [2 * T * (widest // weight_formats.Q8_0_BLOCK), (T * widest + 3) // 4]
    tiles = _packed_input(T, widest, weights or {}, int8_activations, n_threads)
    total = (sum(_round16(n) for n in buffers) + tiles) * FLOAT
    if not cached:
        total += 2 * (1 if one_layer else c.n_layers) * n_tokens * c.kv_dim * FLOAT
    return total


# What the AVX-512 VNNI int8 tile allocates (csrc/ops.h, kv_int8_tile_floats): nothing below
# INT8_TILE_MIN_TOKENS tokens (those stream the rows), then per product each token's blocks'
# starting sums and, per thread, a panel of 16 rows: INT8_PANEL_BLOCK_BYTES a block of 32
# inputs (stored only from 13 tokens on, Q4_1 9, but allocated from 8).
INT8_TILE_MIN_TOKENS = 8
INT8_PANEL_BLOCK_BYTES = 640


def _packed_input(n_tokens: int, widest: int, formats: dict, int8_activations: bool,
                  n_threads: int) -> int:
    """Floats of the scratch the running kernel variant's AVX-512 tiles allocate for a
    product (csrc/ops.h; the C core's packed_input_floats), where one of the matrices takes
    a tile this variant has: the float32 tile's packed copy of a chunk of core.TOKEN_CHUNK
    tokens (from 4 tokens); the int8 tile's (block formats with int8 activations), from
    INT8_TILE_MIN_TOKENS, the starting sums of every token's blocks and a panel per thread.
    One product at a time: the widest input, the larger of the two."""
    if core.get_kernels() == "plain" or widest < 8:
        return 0
    matrices = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "classifier")
    int8 = {name for name in matrices if int8_activations
            and formats.get(name) in weight_formats.BLOCK_FORMATS}
    chunk, blocks = min(n_tokens, core.TOKEN_CHUNK), widest // 32
    float32_tile = (chunk + 1) // 2 * (widest // 8) * 16 if n_tokens >= 4 else 0
    int8_tile = (n_tokens * blocks + n_threads * blocks * INT8_PANEL_BLOCK_BYTES // FLOAT
                 if n_tokens >= INT8_TILE_MIN_TOKENS else 0)
    most = 0
    for tile, floats, used in ((1, float32_tile, len(int8) < len(matrices)),
                               (2, int8_tile, bool(int8))):
        if core.PACKED_INPUTS & tile and used:
            most = max(most, floats)
    return most


def generation_counts(config: ModelConfig, prompt_len: int, new_tokens: int,
                      use_cache: bool = True) -> Counts:
    """The work of kvlab.generate: with the cache, one prefill of the prompt and one
    decode per further token; without it, the whole sequence from scratch every step."""
    prompt_len = arguments.positive(prompt_len, "prompt_len")
    new_tokens = arguments.positive(new_tokens, "new_tokens")
    total = Counts()
    for step in range(new_tokens):
        if not use_cache:
            total = total + forward_counts(config, prompt_len + step, 0)
        elif step == 0:
            total = total + forward_counts(config, prompt_len, 0)
        else:
            total = total + forward_counts(config, 1, prompt_len + step - 1)
    return total


def arithmetic_ratio(config: ModelConfig, prompt_len: int, new_tokens: int) -> float:
    """Whole-run FLOPs without a cache over FLOPs with one. For projections and MLP this
    is about (prompt_len + new_tokens / 2) * new_tokens / (prompt_len + new_tokens): about
    half the number of generated tokens after a short prompt, growing toward the number of
    generated tokens as the prompt gets longer than what is generated."""
    return (generation_counts(config, prompt_len, new_tokens, False).flops /
            generation_counts(config, prompt_len, new_tokens, True).flops)


# ---- measuring a real process -------------------------------------------------------------

def memory_bandwidth(n_bytes: int = 1 << 28, repeats: int = 3) -> dict:
    """This machine's memory bandwidth as the C core's own threads see it:
    {'read_bytes_per_s', 'triad_bytes_per_s'}, best of `repeats` passes over arrays of
    n_bytes each (three are allocated; make them much larger than the CPU's caches). The
    yardstick for "bytes read per second" figures of decode and attention."""
    n_bytes = arguments.integer(n_bytes, "n_bytes", 1 << 20, arguments.INT64_MAX)   # 1 MiB
    repeats = arguments.positive(repeats, "repeats")
    return dict(core.memory_bandwidth(n_bytes, repeats))


def compute_roof(repeats: int = 3) -> dict:
    """This machine's compute roof as the C core's threads see it, beside memory_bandwidth's
    memory roof: the best of `repeats` passes of chains of independent instructions on
    registers (no memory traffic), on one thread and on the core's threads (set_num_threads).
    Rates in operations per second, a multiply and an add counted as two:
      f32_flops_per_s:        the widest float32 multiply-add the build has;
      int8_ops_per_s:         the widest int8 dot-product instruction (byte products);
      int8_product_ops_per_s: byte products through the int8-activation product's own
                              sequence as its rows-in-lanes tiles run it (eight sums of
                              four make each lane's block total of 32 exact, which is made
                              float, times a scale, added with a multiply-add: what a Q8_0
                              prefill or batched decode step can reach at best);
    each also as ..._1_thread, with 'threads' and the instructions timed, in words. A
    product of many tokens (a prefill, a batched decode step) is bound by these; a decode
    step of one sequence by the bandwidth."""
    repeats = arguments.positive(repeats, "repeats")
    if repeats > 1000:
        raise ValueError(f"repeats must be at most 1000, got {repeats}")
    return dict(core.compute_roof(repeats))


def attention_walk_bandwidth(context: int, n_kv_heads: int = 8, head_dim: int = 128,
                             repeats: int = 3) -> float:
    """Bytes per second read by decode attention's walk through an fp32 cache of `context`
    positions (each KV head's keys and values a tile of 16 rows at a time, the next tile
    fetched ahead, the heads shared among the core's threads) when it computes nothing:
    the ceiling of attention's access pattern, to compare with memory_bandwidth's plain
    read. The best of `repeats` passes, each from memory."""
    # (the core says which shapes the walk takes: a context of 16 or more, ...)
    context = arguments.integer(context, "context", None, arguments.C_INT_MAX)
    n_kv_heads = arguments.integer(n_kv_heads, "n_kv_heads", None, arguments.C_INT_MAX)
    head_dim = arguments.integer(head_dim, "head_dim", None, arguments.C_INT_MAX)
    repeats = arguments.positive(repeats, "repeats")
    return float(core.attention_walk_bandwidth(n_kv_heads, head_dim, context, repeats))


@dataclasses.dataclass
class MemoryReport:
    context: int
    batch: int
    formula_bytes: int        # kv_cache_bytes(config, context, batch, "fp32")
    allocated_bytes: int      # what the caches say they allocated (cache.nbytes)
    rss_after_create: int     # resident growth once the caches exist (memory is reserved lazily)
    rss_after_fill: int       # resident growth once every request holds `context` tokens
    weights_bytes: int        # the model's weights (memory-mapped files count once touched)
    scratch_bytes: int        # peak activation scratch of one forward call (counted)
    peak_rss: int             # the process's high-water mark of resident memory

    def table(self) -> str:
        rows = [("KV cache, formula", self.formula_bytes),
                ("KV cache, allocated (nbytes)", self.allocated_bytes),
                ("resident growth after creating", self.rss_after_create),
                ("resident growth after filling", self.rss_after_fill),
                ("weights", self.weights_bytes),
                ("scratch (peak of one call)", self.scratch_bytes),
                ("process peak resident", self.peak_rss)]
        head = f"{self.batch} request(s) x {self.context} tokens, fp32"
        return "\n".join([head] + [f"  {name:32}{value:>16,} B" for name, value in rows])


def measure_memory(model, context: int, batch: int = 1, cache: str = "contiguous",
                   block_size: int = 16) -> MemoryReport:
    """Create `batch` caches of `context` positions (or one paged pool of that size), fill
    each with `context` tokens, and compare the formula with what was allocated and what
    the process's resident memory did. Resident growth is a measurement, so it includes
    whatever else the process allocated meanwhile; expect it to match to within a few
    pages, not to the byte."""
    import numpy as np

    if cache not in ("contiguous", "paged"):
        raise ValueError(f"cache must be 'contiguous' or 'paged', got {cache!r}")
    config = model.config
    context = arguments.positive(context, "context")
    batch = arguments.positive(batch, "batch")
    block_size = arguments.positive(block_size, "block_size")
    if context > config.max_seq_len:
        raise ValueError(f"need 1 <= context <= {config.max_seq_len} and batch >= 1")
    # a different prompt per request: identical ones would share their blocks in a pool
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, size=context) for _ in range(batch)]
    with model.counting() as counts:
        model.forward(prompts[0][:1])               # touch the weights before measuring
        release_freed_memory()
        before = resident_bytes()
        if cache == "contiguous":
            caches = [model.new_cache(context) for _ in range(batch)]
            targets, allocated = caches, sum(c.nbytes for c in caches)
        else:
            blocks = batch * blocks_for(context, block_size)
            pool = model.new_paged_pool(blocks, block_size, max_seqs=max(batch, 1))
            targets, allocated = [pool.new_sequence() for _ in range(batch)], pool.nbytes
        created = resident_bytes()
        for target, prompt in zip(targets, prompts):
            model.prefill(prompt, target)
        release_freed_memory()
        filled = resident_bytes()
    return MemoryReport(context=context, batch=batch,
                        formula_bytes=kv_cache_bytes(config, context, batch, "fp32"),
                        allocated_bytes=allocated, rss_after_create=created - before,
                        rss_after_fill=filled - before, weights_bytes=model.weights_nbytes,
                        scratch_bytes=counts.scratch_bytes,
                        peak_rss=peak_resident_bytes())


@dataclasses.dataclass
class WorkingMemory:
    new_tokens: int
    cached_scratch: int       # peak scratch of any one call, with the cache
    cache_bytes: int          # the cache itself (reserved for prompt + new tokens)
    uncached_scratch: int     # peak scratch of any one call without a cache
    # the same, holding one layer's K and V at a time (None for a model on the GPU, whose
    # no-cache path holds every layer's)
    uncached_one_layer_scratch: Optional[int] = None

    @property
    def cached_total(self) -> int:
        return self.cached_scratch + self.cache_bytes

    @property
    def ratio(self) -> float:
        """Working memory without a cache (every layer's K and V held) over working memory
        with one."""
        return self.uncached_scratch / self.cached_total

    @property
    def one_layer_ratio(self) -> Optional[float]:
        """The same, for the uncached run that holds one layer's K and V at a time (None
        where it was not measured)."""
        if self.uncached_one_layer_scratch is None:
            return None
        return self.uncached_one_layer_scratch / self.cached_total


def working_memory(model, prompt, new_tokens: int = 256) -> WorkingMemory:
    """Generate with and without the cache and compare peak working memory, as counted
    by the core. Without a cache the last step rebuilds every K and V of the sequence and
    runs its tokens in chunks (measure.chunk_length), so it holds every layer's K and V and
    one chunk's activations (one_layer: one layer's K and V, but every token's
    activations); with a cache, a step holds one token's activations and the cache holds
    every K and V once."""

    with_cache = generate(model, prompt, new_tokens, use_cache=True, stop_at_eos=False)
    without = generate(model, prompt, new_tokens, use_cache=False, stop_at_eos=False)
    # the uncached run's largest step, the last, again holding one layer's K and V at a time
    # (on the CPU: the GPU's no-cache path holds every layer's, and refuses the other way)
    one_layer = None
    if model.device == "cpu":
        last_step = without.prompt_tokens + without.tokens[:-1]
        with model.counting() as counted:
            model.forward(last_step, uncached_kv="one_layer")
        one_layer = counted.scratch_bytes
    return WorkingMemory(new_tokens=new_tokens, cached_scratch=with_cache.counts.scratch_bytes,
                         cache_bytes=with_cache.cache_nbytes,
                         uncached_scratch=without.counts.scratch_bytes,
                         uncached_one_layer_scratch=one_layer)


def per_token_saving(config: ModelConfig, position: int) -> float:
    """Share of one step's FLOPs that the cache saves when generating the token at
    `position` (0-based): the uncached step reruns all position + 1 tokens, the cached
    step only the newest. About 1 - 1/(position + 1): 75 % at position 3, 90 % at 9."""
    position = arguments.count(position, "position", arguments.INT64_MAX)
    cached = forward_counts(config, 1, position).flops
    uncached = forward_counts(config, position + 1, 0).flops
    return 1.0 - cached / uncached
