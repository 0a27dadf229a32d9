"""How fast the GPU edition of the kernel lab's kernels read the cache, as shares of the
GPU's copy bandwidth: what its bandwidth target (kvlab/grading/gpu_kernel_cases.py's
TARGET_SHARE, provisional until this has run) is to be set from. Needs an NVIDIA GPU, nvcc
and a clone (instructor/ holds the kernels); benchmarks/gpu_check.sh runs it.

    python benchmarks/bench_kernel_lab_cuda.py [--rounds 4] [--json bench_kernel_lab_cuda.json]

The layer is the one the grader times (lab 14's: 8 KV heads of 128, 4 query heads on each,
int8 with a scale per 64 values, 32,763 positions in shuffled blocks of 16, 71 MB of cache).
Each kernel is built as the grader builds a submission (cbuild.cuda_build_command, for the
GPU present), loaded here behind the lab's harness (the course's own code, not a student's),
checked bit for bit on one call, and timed as the grader times it (gpu_kernel_cases.
measure_share: chains on the device, outputs drawn and checked) against the copy bandwidth
measured first. The plain tier transcribed (one GPU thread per query head) is timed over one
round only: each of its calls takes seconds.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kvlab.grading import cbuild, gpu_kernel_cases, kernel_cases
from kvlab.grading.labs import get_lab, require_gpu

REPO = Path(__file__).resolve().parents[1]
KERNELS = {"reference solution": ("decode_kernel_cuda.cu", None),
           "plain tier transcribed": ("decode_kernel_cuda_plain.cu", 1)}


def load_kernel(source: Path, folder: Path):
    """The lab's harness module bound to `source` built as the grader builds it."""
    lab = get_lab("decode_kernel_cuda")
    library = folder / (source.stem + ".so")
    subprocess.run(cbuild.cuda_build_command(source, library, lab.folder), check=True)
    spec = importlib.util.spec_from_file_location(f"harness_{source.stem}", lab.folder / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    harness.bind(ctypes.CDLL(str(library)))
    return harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="bench_kernel_lab_cuda.json")
    args = parser.parse_args()
    require_gpu(get_lab("decode_kernel_cuda"))
    probe = gpu_kernel_cases.measure_probe()
    print(f"device-to-device copy: {probe / 1e9:.0f} GB/s read and written")
    rng = np.random.default_rng(0)
    case = kernel_cases.timed_case(rng)
    results = {"copy_bytes_per_s": probe, "cache_bytes": case.bytes_read, "kernels": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name, (file, rounds) in KERNELS.items():
            harness = load_kernel(REPO / "instructor" / "solutions" / file, Path(folder))
            pool = harness.Pool(*case.key_codes.shape, case.group)
            for array in harness.ARRAYS:
                pool.put(array, 0, getattr(case, array))
            kernel_cases.check_bits(pool.attend(case.q, case.block_table, case.length,
                                                float(case.scale)), case.want(), name)
            share = gpu_kernel_cases.measure_share(pool, case, rng, probe,
                                                   rounds=rounds or args.rounds)
            seconds = case.bytes_read / np.median(share.kernel_bytes_per_s)
            results["kernels"][name] = {"share": share.share, "seconds_per_call": seconds,
                                        "kernel_bytes_per_s": share.kernel_bytes_per_s}
            print(f"{name:24} {share.share:7.2%} of the copy  {seconds * 1e6:10.0f} us a call")
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    reference = results["kernels"]["reference solution"]["share"]
    print(f"TARGET_SHARE now {gpu_kernel_cases.TARGET_SHARE:.1%}; 80 % of the reference's "
          f"share: {0.8 * reference:.1%}")


if __name__ == "__main__":
    main()
