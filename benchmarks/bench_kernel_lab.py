"""How fast the kernel lab's kernels read the cache, as shares of the read bandwidth: what
lab 14's bandwidth targets are set from.

    python benchmarks/bench_kernel_lab.py [--rounds 7] [--json bench_kernel_lab.json]

Needs a clone (instructor/ holds the kernels). The layer is the one the lab's grader times
(instructor/graders/decode_kernel.py): 8 KV heads of 128, 4 query heads on each, int8 with
a scale per 64 values, 32,763 positions in shuffled blocks of 16, 69 MB of cache. Timed, in
rounds, side by side:
  - the reference solution (instructor/solutions/decode_kernel.c) and the plain tier
    transcribed onto the lab's layout (decode_kernel_plain.c), built as the grader builds
    a submission (kvlab/grading/cbuild.py) and called through the lab's harness, here, in
    this process (they are the course's own code, not a student's);
  - kvlab's own fast kernel (cache.attend) over the same rows in a contiguous int8 cache:
    no block table, so the hardware prefetcher follows each head's rows in one run;
and in each round kvlab's read probe (kvlab.measure.memory_bandwidth) over as many bytes.
A share is bytes of cache per second over the probe's bytes per second, both of the same
round; the table shows each kernel's median share and the spread of the rounds. Timings on
a machine shared with other work swing together with the probe, so the shares move less
than the speeds do; run it on an idle machine to set targets.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab.grading import cbuild, kernel_cases
from kvlab.grading.labs import get_lab

REPO = Path(__file__).resolve().parents[1]
KERNELS = {"reference solution": "decode_kernel.c", "plain tier transcribed": "decode_kernel_plain.c"}


def load_kernel(source: Path, folder: Path):
    """The lab's harness module bound to `source` built as the grader builds it."""
    lab = get_lab("decode_kernel")
    library = folder / (source.stem + ".so")
    subprocess.run(cbuild.build_command(source, library, lab.folder), check=True)
    spec = importlib.util.spec_from_file_location(f"harness_{source.stem}", lab.folder / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    harness.bind(ctypes.CDLL(str(library)))
    return harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default="bench_kernel_lab.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    case = kernel_cases.make_case(rng, 8, 4, 128, 32768 - 5, 16, 64, spare_blocks=64)
    threads = kvlab.get_num_threads()
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, file in KERNELS.items():
            harness = load_kernel(REPO / "instructor" / "solutions" / file, Path(folder))
            pool = harness.Pool(*case.key_codes.shape, case.group)
            for array in ("key_codes", "key_scales", "value_codes", "value_scales"):
                pool.put(array, 0, getattr(case, array))
            kernel_cases.check_bits(pool.attend(case.q, case.block_table, case.length,
                                                float(case.scale), threads), case.want(), name)
            runs[name] = lambda q, pool=pool: pool.attend(q, case.block_table, case.length,
                                                          float(case.scale), threads)
        runs["kvlab's fast kernel, contiguous"] = lambda q: case.attend(q, "fast")
        shares = {name: [] for name in runs}
        for _ in range(args.rounds):
            probe = kvlab.measure.memory_bandwidth(case.bytes_read, 2)["read_bytes_per_s"]
            for name, run in runs.items():
                n = 1 if "plain" in name else 6
                started = time.perf_counter()
                for _ in range(n):
                    run(case.q)
                shares[name].append(n * case.bytes_read / (time.perf_counter() - started) / probe)
    rows = [{"kernel": name, "median_share": statistics.median(s), "min": min(s), "max": max(s)}
            for name, s in shares.items()]
    print(f"{threads} threads, {case.shape}, {case.bytes_read / 1e6:.0f} MB of cache")
    for r in rows:
        print(f"  {r['kernel']:34} {r['median_share']:6.1%}  (rounds: {r['min']:.1%} .. {r['max']:.1%})")
    Path(args.json).write_text(json.dumps({"threads": threads, "rounds": args.rounds,
                                           "kernels": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
