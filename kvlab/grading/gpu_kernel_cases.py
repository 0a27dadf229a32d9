"""The GPU edition of the kernel lab (kvlab/labs/decode_kernel_cuda): its timing, against
the GPU's own copy bandwidth. Its cases, its expected bits (the CPU plain tier's) and its
timed layer are lab 14's (kernel_cases.py).

How it is timed, and why not as lab 14 is:

- The chain of calls runs on the device (harness.cu's lab_chain): each call's query is
  q_base plus the output before, made by a kernel of the harness behind the student's on
  the same stream, so no call can start early or be skipped, and no host round trip (tens of
  microseconds, as long as a kernel call) sits between two calls. The judge's clock times
  the whole chain, hundreds of calls, from its own process.
- The outputs stay on the device; the judge then asks for the first and for a few drawn at
  random after the chain (and for the one before each, whose sum with q_base was that
  call's query), and checks each bit for bit against the CPU's plain tier. Checking every
  one of thousands of calls would take the CPU minutes; a kernel that skips or fakes a
  share of its calls is caught with a probability that grows with that share and with the
  rounds (4, each with its own draw).
- The yardstick is a device-to-device copy timed by kvlab's own CUDA extension
  (kvlab._cuda.time_copy, CUDA events, in the judge's process), as bytes read and written
  per second: what a kernel that only streams memory reaches. It is measured once, when the
  grader's tests load, before any code of the student's has run: the GPU runs work queued
  by a process even while that process is stopped, so pausing the worker (as lab 14 does
  for its CPU probe) would not keep a kernel the student left queued off the GPU.

Never run on a GPU yet: TARGET_SHARE is provisional (the lab's README says how it was set,
and benchmarks/gpu_check.sh measures what it must be set from).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Optional

import numpy as np

from .kernel_cases import PagedCase, Share, check_bits, send_blocks, timed_case, upload

# The share of the GPU's copy bandwidth the timed layer must reach for full bandwidth
# points: PROVISIONAL, an estimate (README.md of the lab) until a GPU session measures the
# reference solution (benchmarks/gpu_check.sh) and sets it to 80 % of that share.
TARGET_SHARE = 0.10
PROBE_BYTES = 512 << 20      # well past any GPU's L2 cache (50 MB on an H100)
MAX_RUNS = 4096              # calls in one timed chain (their outputs stay on the device)
CHECKED_PER_ROUND = 3        # chain outputs drawn for checking in each round, beside the first

_probe: Dict[str, float] = {}


class GpuShare(Share):
    """Share, said against the GPU's copy (probe_bytes_per_s: the copy's bytes read and
    written per second)."""

    def describe(self) -> str:
        return (f"{self.share:.1%} of the GPU's copy bandwidth (your kernel: "
                f"{statistics.median(self.kernel_bytes_per_s) / 1e9:.1f} GB/s of cache read; a "
                f"device-to-device copy: {statistics.median(self.probe_bytes_per_s) / 1e9:.0f} "
                f"GB/s read and written; medians of {len(self.kernel_bytes_per_s)} rounds)")


def measure_probe(repeats: int = 10) -> Optional[float]:
    """The GPU's copy bandwidth (bytes read + written per second, the median of `repeats`
    copies of PROBE_BYTES), measured once per process and kept; None where kvlab cannot
    use a GPU. The grader calls this from prepare(), before any worker runs."""
    import kvlab.cuda
    if "bytes_per_s" not in _probe:
        if not kvlab.cuda.is_available():
            return None
        seconds = statistics.median(kvlab.cuda.extension().time_copy(PROBE_BYTES, repeats))
        _probe["bytes_per_s"] = 2 * PROBE_BYTES / seconds
    return _probe["bytes_per_s"]


def _check_chain(pool, case: PagedCase, q: np.ndarray, q_base: np.ndarray, n_runs: int,
                 rng: np.random.Generator, round_: int) -> None:
    """The chain's first output and CHECKED_PER_ROUND others drawn now, each against the
    plain tier's answer for the query it was given; AssertionError otherwise."""
    from .testkit import as_array
    drawn = rng.choice(np.arange(1, n_runs), size=min(CHECKED_PER_ROUND, n_runs - 1),
                       replace=False) if n_runs > 1 else np.array([], int)
    asked = sorted({0, *(int(k) for k in drawn), *(int(k) - 1 for k in drawn)})
    got = as_array(pool.outputs(asked), "the timed calls' outputs",
                   shape=(len(asked),) + case.q.shape)
    out = dict(zip(asked, got))
    for k in sorted({0, *(int(k) for k in drawn)}):
        query = q if k == 0 else q_base + out[k - 1]
        check_bits(out[k], case.attend(query, "fast"),
                   f"timed call {k + 1} of {n_runs} in round {round_ + 1} ({case.shape})")


def measure_share(pool, case: PagedCase, rng: np.random.Generator, probe: float,
                  rounds: int = 4, chain_seconds: float = 0.3, renew: int = 64) -> Share:
    """Rounds of: the last `renew` positions given new rows (so that nothing computed from
    the pool before can stand in for reading it), then a chain of calls on the device (as
    many as take about chain_seconds, from the round before; 2 in the first) timed by this
    process's clock, and some of its outputs checked (_check_chain). The share is the
    median over the rounds of (bytes of cache the chain had to read / its time) / probe."""
    kernel, n_runs = [], 2
    q = (rng.standard_normal(case.q.shape) * 2.0).astype(np.float32)
    pool.chain(q, q, case.block_table, case.length, float(case.scale), 1)    # warm-up
    for round_ in range(rounds):
        send_blocks(pool, case, case.renew_tail(rng, renew))
        q = (rng.standard_normal(case.q.shape) * 2.0).astype(np.float32)
        q_base = (rng.standard_normal(case.q.shape) * 2.0).astype(np.float32)
        started = time.perf_counter()
        pool.chain(q, q_base, case.block_table, case.length, float(case.scale), n_runs)
        seconds = time.perf_counter() - started
        _check_chain(pool, case, q, q_base, n_runs, rng, round_)
        kernel.append(n_runs * case.bytes_read / seconds)
        n_runs = int(min(MAX_RUNS, max(2, chain_seconds * kernel[-1] / case.bytes_read)))
    shares = [k / probe for k in kernel]
    return GpuShare(statistics.median(shares), kernel, [probe] * rounds)


def bandwidth_share(sub, rng: np.random.Generator) -> Share:
    """Lab 14's timed layer, handed to the student's code and measured (measure_share)
    against the probe this process measured before any worker ran."""
    probe = measure_probe()
    assert probe is not None, "no GPU for the grader to measure: this lab needs one"
    case = timed_case(rng)
    return measure_share(upload(sub, case), case, rng, probe)


class OneMeasurement:
    """The grading's one bandwidth measurement, shared by its bandwidth tests: taken by
    whichever runs first; each then asks whether the share reaches its tier. A measurement
    that failed (a wrong output, say) fails each of them with what it said."""

    def __init__(self):
        self.share: Optional[Share] = None
        self.failed: Optional[BaseException] = None

    def reaches(self, sub, rng: np.random.Generator, needed: float) -> None:
        if self.share is None and self.failed is None:
            try:
                self.share = bandwidth_share(sub, rng)
            except Exception as error:
                self.failed = error
        if self.failed is not None:
            raise self.failed
        assert self.share.share >= needed, (f"reached {self.share.describe()}; this test asks "
                                            f"for {needed:.1%}")
