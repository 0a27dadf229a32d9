"""What the kernel lab's tests are written with: cases laid out as a paged int8 pool, the
plain tier's answer for each, and the timing of a kernel against the machine's bandwidth.

Lab 14 (kvlab/labs/decode_kernel) has the student write decode attention in C over one
sequence of a paged int8 pool. A case is drawn here, in the judge: K and V as floats,
quantized by a kvlab int8 cache (so the codes and scales are kvlab's own), then scattered
into the blocks of a larger pool through a shuffled block table that never names block 0,
every row the sequence does not own filled with codes of +-127 whose scale is NaN, so that
reading one is loud. The softmax's scale is 1 / sqrt(d) for a d the case draws (head_dim or more):
kvlab's attention computes it exactly over rows padded with zeros to d values, which
change no sum, and a kernel that assumes 1 / sqrt(head_dim) gets other bits. The expected
output is that cache's `attend` on the plain tier (csrc/plain.c), bit for bit.

The timing (measure_share) is taken by the judge's clock around chains of calls whose
every output it checks, and set against kvlab's read-bandwidth probe, run here while every
process of the student's is stopped (process.paused), so that nothing the submission runs
can slow the probe down and make its own share look larger.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from typing import Iterator, List, Optional

import numpy as np

from .process import paused, restore_scheduling

TILE = 16            # the plain tier's online-softmax tile (csrc/attention.h)

# The share of the read bandwidth a kernel must reach on the timed layer for the lab's full
# bandwidth points (README.md of the lab: how it was set, and what kvlab's own kernel gets).
TARGET_SHARE = 0.12


@contextlib.contextmanager
def kernels(tier: str) -> Iterator[None]:
    """kvlab's kernel tier set to `tier` ("plain" or "fast") for the block."""
    import kvlab
    before = kvlab.get_kernels()
    kvlab.set_kernels(tier)
    try:
        yield
    finally:
        kvlab.set_kernels(before)


def draw_rows(rng: np.random.Generator, n: int, n_kv_heads: int, head_dim: int, pad: int,
              spread: float) -> np.ndarray:
    """(n, 1, n_kv_heads, head_dim + pad) float32 rows: uniform values (their int8 codes
    are then close to uniform too: no fewer bytes can hold them) times a magnitude per row
    drawn over `spread` powers of ten, then `pad` zeros."""
    magnitude = (10.0 ** rng.uniform(-spread / 2, spread / 2, (n, 1, n_kv_heads, 1))).astype(np.float32)
    rows = np.zeros((n, 1, n_kv_heads, head_dim + pad), np.float32)
    rows[..., :head_dim] = rng.random((n, 1, n_kv_heads, head_dim), dtype=np.float32)
    rows[..., :head_dim] -= 0.5
    rows[..., :head_dim] *= 2.0 * magnitude
    return rows


@dataclasses.dataclass
class PagedCase:
    """One sequence of a paged int8 pool, the kvlab cache that holds the same rows in order
    (padded to scale_dim values), and what attention over it must give."""
    q: np.ndarray               # (n_heads, head_dim) float32
    key_codes: np.ndarray       # (num_blocks, n_kv_heads, block_size, head_dim) int8
    key_scales: np.ndarray      # (num_blocks, n_kv_heads, block_size, head_dim / group) float32
    value_codes: np.ndarray
    value_scales: np.ndarray
    block_table: np.ndarray     # (blocks of the sequence,) int32
    length: int
    group: int
    scale_dim: int              # the softmax's scale is 1 / sqrt(scale_dim)
    cache: object               # kvlab.KVCache, int8, head_dim scale_dim
    spread: float

    @property
    def head_dim(self) -> int:
        return self.key_codes.shape[3]

    @property
    def scale(self) -> np.float32:
        return np.float32(1.0) / np.sqrt(np.float32(self.scale_dim))

    @property
    def shape(self) -> str:
        _, n_kv_heads, block_size, head_dim = self.key_codes.shape
        return (f"{self.q.shape[0]} query heads on {n_kv_heads} KV heads of {head_dim}, "
                f"{self.length} positions in blocks of {block_size}, scales per {self.group} "
                f"values, softmax scale 1/sqrt({self.scale_dim})")

    def arguments(self, n_threads: int = 1, q: Optional[np.ndarray] = None) -> tuple:
        """What sub.decode_attention takes, in order."""
        return (self.q if q is None else q, self.key_codes, self.key_scales, self.value_codes,
                self.value_scales, self.block_table, self.length, float(self.scale), n_threads)

    @property
    def bytes_read(self) -> int:
        """Bytes of K and V (codes and scales) the sequence holds: what attention must read."""
        _, n_kv_heads, _, head_dim = self.key_codes.shape
        return 2 * self.length * n_kv_heads * (head_dim + 4 * (head_dim // self.group))

    def attend(self, q: np.ndarray, tier: str = "plain") -> np.ndarray:
        """kvlab's attention of q (n_heads, head_dim) over the sequence, on `tier`."""
        padded = np.zeros((q.shape[0], self.scale_dim), np.float32)
        padded[:, :self.head_dim] = q
        with kernels(tier):
            return np.ascontiguousarray(self.cache.attend(padded, 0)[:, :self.head_dim])

    def want(self, q: Optional[np.ndarray] = None) -> np.ndarray:
        """The plain tier's answer for q (the case's own by default)."""
        return self.attend(self.q if q is None else q)

    def scatter(self, positions: np.ndarray) -> None:
        """Rows `positions` of the kvlab cache, codes and scales, into the pool's blocks."""
        block_size, groups = self.key_codes.shape[2], self.head_dim // self.group
        blocks = self.block_table[positions // block_size]
        rows = positions % block_size
        for kind in ("key", "value"):
            codes = getattr(self.cache, f"{kind}_codes")[0]      # (length, n_kv_heads, scale_dim)
            scales = getattr(self.cache, f"{kind}_scales")[0]
            getattr(self, f"{kind}_codes")[blocks, :, rows] = codes[positions, :, :self.head_dim]
            getattr(self, f"{kind}_scales")[blocks, :, rows] = scales[positions, :, :groups]

    def renew_tail(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """New K and V for the last n positions, in the cache and the pool; the ids of the
        blocks that changed."""
        _, n_kv_heads, block_size, head_dim = self.key_codes.shape
        self.cache.truncate(self.length - n)
        pad = self.scale_dim - head_dim
        self.cache.append(draw_rows(rng, n, n_kv_heads, head_dim, pad, self.spread),
                          draw_rows(rng, n, n_kv_heads, head_dim, pad, self.spread))
        positions = np.arange(self.length - n, self.length)
        self.scatter(positions)
        return np.unique(self.block_table[positions // block_size])


def make_case(rng: np.random.Generator, n_kv_heads: int, kv_mul: int, head_dim: int,
              length: int, block_size: int, group: Optional[int] = None,
              scale_dim: Optional[int] = None, spare_blocks: int = 3, spread: float = 1.0,
              q_scale: float = 2.0) -> PagedCase:
    """A sequence of `length` positions in a pool of blocks of `block_size`: its blocks in
    a shuffled order among at least `spare_blocks` others (block 0 always among them)."""
    import kvlab
    group = head_dim if group is None else group
    scale_dim = head_dim if scale_dim is None else scale_dim
    assert head_dim % group == 0 and (scale_dim - head_dim) % group == 0 and spare_blocks >= 1
    cache = kvlab.KVCache(1, n_kv_heads, scale_dim, length, key_format="int8",
                          value_format="int8", key_group=group, value_group=group)
    for start in range(0, length, 4096):        # floats a part at a time: a long case is large
        n = min(4096, length - start)
        pad = scale_dim - head_dim
        cache.append(draw_rows(rng, n, n_kv_heads, head_dim, pad, spread),
                     draw_rows(rng, n, n_kv_heads, head_dim, pad, spread))
    n_blocks = -(-length // block_size)
    num_blocks = n_blocks + spare_blocks
    table = (1 + rng.permutation(num_blocks - 1)[:n_blocks]).astype(np.int32)
    shape = (num_blocks, n_kv_heads, block_size, head_dim)
    scales = shape[:3] + (head_dim // group,)
    q = (rng.standard_normal((n_kv_heads * kv_mul, head_dim)) * q_scale).astype(np.float32)
    case = PagedCase(q, np.full(shape, 127, np.int8), np.full(scales, np.nan, np.float32),
                     np.full(shape, -127, np.int8), np.full(scales, np.nan, np.float32), table,
                     length, group, scale_dim, cache, spread)
    case.scatter(np.arange(length))
    return case


def check_bits(got, want: np.ndarray, what: str) -> None:
    """got must be want, bit for bit (float32, want's shape); a failure says how it differs:
    NaN (a row read that the sequence does not own), close (another order of operations),
    or far (another computation)."""
    from .testkit import as_array
    got = as_array(got, what, shape=want.shape, dtype=np.float32)
    if np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        return
    differ = got.view(np.uint32) != want.view(np.uint32)
    at = tuple(int(i) for i in np.argwhere(differ)[0])
    where = (f"{int(differ.sum())} of {differ.size} values differ, the first at (head {at[0]}, "
             f"value {at[1]}): expected {want[at]!r}, got {got[at]!r}")
    if np.isnan(got).any():
        why = ("NaN: your kernel read a row the sequence does not own (past its length, or "
               "through a wrong block): every such row of the pool has a NaN scale")
    else:
        error = np.abs(got.astype(np.float64) - want) / (np.abs(want).max() + 1e-30)
        import kvlab._kvlab as core     # (the judge's kvlab: whether its kernels fuse)
        madds = "fused multiply-adds" if core.FUSED_MULTIPLY_ADD else "multiplies and adds"
        why = ("close, but not the plain tier's bits: something is computed in another order "
               f"or rounded otherwise (eight lanes of {madds} added pairwise, tiles of 16 "
               "from position 0, the online softmax's steps: README.md)"
               if error.max() < 1e-3 else "not what attention over the sequence gives")
    raise AssertionError(f"{what}: {why}; {where}")


@dataclasses.dataclass
class Share:
    """A kernel's measured speed: bytes of cache per second over the read bandwidth."""
    share: float                 # the median of the rounds' shares
    kernel_bytes_per_s: List[float]
    probe_bytes_per_s: List[float]

    def describe(self) -> str:
        return (f"{self.share:.1%} of the read bandwidth (your kernel: "
                f"{statistics.median(self.kernel_bytes_per_s) / 1e9:.2f} GB/s of cache; kvlab's "
                f"probe: {statistics.median(self.probe_bytes_per_s) / 1e9:.2f} GB/s; medians of "
                f"{len(self.kernel_bytes_per_s)} rounds)")


def upload(sub, case: PagedCase):
    """The case's pool in the worker (the worker's Pool object, which the timing then calls
    again and again), handed over as files: as values, its 69 MB took seconds to encode."""
    from .testkit import handout_file
    num_blocks, n_kv_heads, block_size, head_dim = case.key_codes.shape
    pool = sub.Pool(num_blocks, n_kv_heads, block_size, head_dim, case.group)
    for name in ("key_codes", "key_scales", "value_codes", "value_scales"):
        path = handout_file(sub, getattr(case, name))
        try:
            pool.load(name, path)
        finally:
            os.remove(path)
    return pool


def send_blocks(pool, case: PagedCase, blocks: np.ndarray, part_bytes: int = 16 << 20) -> None:
    """Blocks `blocks` (ids in increasing order) of the case's pool, sent to the worker's
    Pool, runs of consecutive ids a part at a time."""
    per_block = max(1, part_bytes // case.key_codes[0].nbytes)
    runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1)
    for run in runs:
        for start in range(0, len(run), per_block):
            first, last = int(run[start]), int(run[min(start + per_block, len(run)) - 1]) + 1
            for name in ("key_codes", "key_scales", "value_codes", "value_scales"):
                pool.put(name, first, getattr(case, name)[first:last])


def chain_want(case: PagedCase, q: np.ndarray, q_base: np.ndarray, n_runs: int) -> np.ndarray:
    """The outputs of the harness's chain (each query q_base + the output before), on
    kvlab's fast tier, which gives the plain tier's bits (tests/test_bits.py) in a fraction
    of its time."""
    outputs = []
    for _ in range(n_runs):
        out = case.attend(q, "fast")
        outputs.append(out)
        q = q_base + out
    return np.stack(outputs)


def measure_share(pool, case: PagedCase, rng: np.random.Generator, n_threads: int,
                  rounds: int = 4, chain_seconds: float = 0.3, renew: int = 64) -> Share:
    """Rounds of: the last `renew` positions given new rows (so that nothing computed from
    the pool before can stand in for reading it), kvlab's read probe with the student's
    processes stopped, then a chain of calls (as many as take about chain_seconds, from the
    round before; 2 in the first) timed by this process's clock, every output checked bit
    for bit (AssertionError otherwise). The share is the median over the rounds of (bytes
    of cache the chain had to read / its time) / the probe."""
    from kvlab.measure import memory_bandwidth

    from .testkit import as_array
    kernel, probe, n_runs = [], [], 2
    for round_ in range(rounds):
        send_blocks(pool, case, case.renew_tail(rng, renew))
        with paused() as stopped:
            assert stopped, "the processes your code started could not be paused for the probe"
            changed = restore_scheduling()
            assert changed is None, f"{changed}: the probe cannot be run as it should"
            probe.append(memory_bandwidth(max(case.bytes_read, 16 << 20), 2)["read_bytes_per_s"])
        q = (rng.standard_normal(case.q.shape) * 2.0).astype(np.float32)
        q_base = (rng.standard_normal(case.q.shape) * 2.0).astype(np.float32)
        started = time.perf_counter()
        got = pool.chain(q, q_base, case.block_table, case.length, float(case.scale), n_runs,
                         n_threads)
        seconds = time.perf_counter() - started
        want = chain_want(case, q, q_base, n_runs)
        got = as_array(got, "the timed calls' outputs", shape=want.shape)
        for run in range(n_runs):
            check_bits(got[run], want[run], f"timed call {run + 1} of {n_runs} in round "
                                            f"{round_ + 1} ({case.shape})")
        kernel.append(n_runs * case.bytes_read / seconds)
        n_runs = int(min(16, max(1, chain_seconds * kernel[-1] / case.bytes_read)))
    shares = [k / p for k, p in zip(kernel, probe)]
    return Share(statistics.median(shares), kernel, probe)


def timed_case(rng: np.random.Generator) -> PagedCase:
    """The layer the bandwidth is measured on: Llama 3 8B's shape (8 KV heads of 128, 4
    query heads on each), int8 with a scale per 64 values, 32,763 positions (a length that
    ends inside a tile) in shuffled blocks of 16: 71 MB of cache."""
    return make_case(rng, 8, 4, 128, 32768 - 5, 16, 64,
                     scale_dim=128 + 64 * int(rng.integers(0, 2)), spare_blocks=64)


def bandwidth_share(sub, rng: np.random.Generator) -> Share:
    """The timed layer drawn, handed to the student's code and measured (measure_share) on
    as many threads as kvlab uses."""
    import kvlab
    case = timed_case(rng)
    return measure_share(upload(sub, case), case, rng, kvlab.get_num_threads())
