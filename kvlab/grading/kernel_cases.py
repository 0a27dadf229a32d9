"""What the kernel lab's tests are written with: cases laid out as a paged int8 pool, the
plain tier's answer for each, and the judge's clock and bandwidth probe.

Lab 14 (kvlab/labs/decode_kernel) has the student write decode attention in C over one
sequence of a paged int8 pool. A case is drawn here, in the judge: K and V as floats,
quantized by a kvlab int8 cache (so the codes and scales are kvlab's own), then scattered
into the blocks of a larger pool through a shuffled block table, every row the sequence
does not own filled with codes whose scale is NaN, so that reading one is loud. The
expected output is the cache's `attend` on the plain tier (csrc/plain.c), which the
student's kernel must give bit for bit; the fast tier gives the same bits (tests/test_bits.py)
and checks the long chains of the timing tests.

The timing tests (bandwidth_share) time the student's kernel from the judge, over a chain
of calls whose every output is checked, and divide the bytes of cache it had to read by
the time, then by the machine's read bandwidth as kvlab's probe measures it
(kvlab.measure.memory_bandwidth) with no process of the student's alive.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Optional

import numpy as np

TILE = 16            # the plain tier's online-softmax tile (csrc/attention.h)


@dataclasses.dataclass
class PagedCase:
    """One sequence of a paged int8 pool, and what attention over it must give."""
    q: np.ndarray               # (n_heads, head_dim) float32
    key_codes: np.ndarray       # (num_blocks, n_kv_heads, block_size, head_dim) int8
    key_scales: np.ndarray      # (num_blocks, n_kv_heads, block_size, head_dim / group) float32
    value_codes: np.ndarray
    value_scales: np.ndarray
    block_table: np.ndarray     # (blocks of the sequence,) int32
    length: int
    group: int
    cache: object               # the kvlab int8 KVCache holding the same rows, in order

    @property
    def shape(self) -> str:
        n_blocks, n_kv_heads, block_size, head_dim = self.key_codes.shape
        return (f"{self.q.shape[0]} query heads on {n_kv_heads} KV heads of {head_dim}, "
                f"{self.length} positions in blocks of {block_size}, groups of {self.group}")

    def arguments(self, n_threads: int = 1) -> tuple:
        """What sub.decode_attention takes, in order."""
        return (self.q, self.key_codes, self.key_scales, self.value_codes, self.value_scales,
                self.block_table, self.length, n_threads)

    @property
    def bytes_read(self) -> int:
        """Bytes of K and V (codes and scales) the sequence holds: what attention must read."""
        _, n_kv_heads, _, head_dim = self.key_codes.shape
        return 2 * self.length * n_kv_heads * (head_dim + 4 * (head_dim // self.group))

    def want(self, q: Optional[np.ndarray] = None) -> np.ndarray:
        """The plain tier's attention of q (the case's own by default) over the sequence."""
        with kernels("plain"):
            return self.cache.attend(self.q if q is None else q, 0)


@contextlib.contextmanager
def kernels(tier: str) -> Iterator[None]:
    import kvlab
    before = kvlab.get_kernels()
    kvlab.set_kernels(tier)
    try:
        yield
    finally:
        kvlab.set_kernels(before)


def draw_rows(rng: np.random.Generator, length: int, n_kv_heads: int, head_dim: int,
              spread: float) -> np.ndarray:
    """(length, 1, n_kv_heads, head_dim) float32 rows: uniform values (so that their int8
    codes are close to uniform too: no fewer bytes can hold them) times a magnitude per row
    drawn over `spread` powers of ten."""
    values = rng.uniform(-1.0, 1.0, (length, 1, n_kv_heads, head_dim))
    magnitude = 10.0 ** rng.uniform(-spread / 2, spread / 2, (length, 1, n_kv_heads, 1))
    return (values * magnitude).astype(np.float32)


def make_case(rng: np.random.Generator, n_kv_heads: int, kv_mul: int, head_dim: int,
              length: int, block_size: int, group: Optional[int] = None, spare_blocks: int = 3,
              spread: float = 1.0, q_scale: float = 2.0) -> PagedCase:
    """A sequence of `length` positions in a pool of blocks of `block_size`, its blocks in
    a shuffled order among `spare_blocks` others it does not own."""
    import kvlab
    group = head_dim if group is None else group
    cache = kvlab.KVCache(1, n_kv_heads, head_dim, length, key_format="int8",
                          value_format="int8", key_group=group, value_group=group)
    for start in range(0, length, 4096):        # floats a part at a time: a long case is large
        n = min(4096, length - start)
        cache.append(draw_rows(rng, n, n_kv_heads, head_dim, spread),
                     draw_rows(rng, n, n_kv_heads, head_dim, spread))
    n_blocks = -(-length // block_size)
    num_blocks = n_blocks + spare_blocks
    table = rng.permutation(num_blocks)[:n_blocks].astype(np.int32)
    pool = {}
    for kind in ("key", "value"):
        codes = rng.integers(-127, 128, (num_blocks, n_kv_heads, block_size, head_dim), dtype=np.int8)
        scales = np.full((num_blocks, n_kv_heads, block_size, head_dim // group), np.nan, np.float32)
        seq_codes = getattr(cache, f"{kind}_codes")[0]          # (length, n_kv_heads, head_dim)
        seq_scales = getattr(cache, f"{kind}_scales")[0]
        positions = np.arange(length)
        blocks, rows = table[positions // block_size], positions % block_size
        codes[blocks, :, rows] = seq_codes
        scales[blocks, :, rows] = seq_scales
        pool[kind] = (codes, scales)
    q = (rng.standard_normal((n_kv_heads * kv_mul, head_dim)) * q_scale).astype(np.float32)
    return PagedCase(q, pool["key"][0], pool["key"][1], pool["value"][0], pool["value"][1],
                     table, length, group, cache)


def chain_want(case: PagedCase, q: np.ndarray, q_base: np.ndarray, n_runs: int) -> np.ndarray:
    """The outputs of the harness's chain (each query q_base + the output before), computed
    here on the fast tier, which gives the plain tier's bits in a fraction of its time."""
    outputs = []
    with kernels("fast"):
        for _ in range(n_runs):
            out = case.cache.attend(q, 0)
            outputs.append(out)
            q = q_base + out
    return np.stack(outputs)


def read_bandwidth(n_bytes: int, repeats: int = 5) -> float:
    """The machine's read bandwidth, bytes per second, as kvlab's probe measures it over
    arrays of n_bytes (at least 16 MiB): the denominator of a kernel's share."""
    from kvlab.measure import memory_bandwidth
    return memory_bandwidth(max(int(n_bytes), 16 << 20), repeats)["read_bytes_per_s"]


def timed(call) -> tuple:
    """(seconds, result) of call(), by the judge's clock."""
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result
