"""Decode's matrix products with weights in fp32, fp16, bf16 and Q8_0, side by side.

    python benchmarks/bench_weights.py [--shape 110m|15m] [--rounds 7] [--json out.json]

A decode step reads every weight once, so its projections' time is about the weights'
bytes over the read bandwidth. For one model shape this runs the products of one decode
token (every layer's Wq, Wk, Wv, Wo, W1, W3, W2 and the classifier, random weights) through
kvlab._kvlab.matmul in each format (and Q8_0 against int8 activations, llama.cpp's way:
"q8_0 x int8"), the variants taking turns within each round, and reports
per format the median time, the speedup over fp32 measured in the same rounds, the bytes
read per second, and that as a share of the machine's read bandwidth
(kvlab._kvlab.memory_bandwidth, measured in the same run). The products are checked equal,
bit for bit, to the fp32 product over the dequantized weights before anything is timed.

This is the kernels alone (issue 21's first step): the model does not use the formats yet.
"q8_0 x int8" is checked against kvlab.weight_formats.matmul_int8 instead (x is rounded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlab import weight_formats  # noqa: E402
from kvlab._core import core  # noqa: E402

SHAPES = {   # (dim, hidden_dim, n_layers, vocab_size): llama2.c's stories models
    "15m": (288, 768, 6, 32000),
    "110m": (768, 2048, 12, 32000),
}


def matrices(shape: str):
    """(out_dim, in_dim) of every matrix one decode token multiplies, in order."""
    dim, hidden, n_layers, vocab = SHAPES[shape]
    per_layer = [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden)]
    return per_layer * n_layers + [(vocab, dim)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per product (1: decode)")
    parser.add_argument("--threads", type=int, default=0, help="0: the core's default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        core.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = matrices(args.shape)
    # One distinct random matrix per distinct shape, quantized once per format; every layer
    # reads its own copy, so the weights cannot sit in a cache between layers.
    stored = {fmt: [] for fmt in weight_formats.FORMATS}
    for out_dim, in_dim in shapes:
        w = (rng.standard_normal((out_dim, in_dim)) * 0.05).astype(np.float32)
        for fmt in weight_formats.FORMATS:
            stored[fmt].append(weight_formats.quantize(w, fmt))
    x_of = {d: rng.standard_normal((args.tokens, d)).astype(np.float32)
            for d in {in_dim for _, in_dim in shapes}}
    # bit for bit: each format's product is fp32's over the dequantized weights
    for fmt in weight_formats.FORMATS:
        for (out_dim, in_dim), codes in list(zip(shapes, stored[fmt]))[:8]:
            values = np.ascontiguousarray(weight_formats.dequantize(codes, fmt, in_dim))
            x = x_of[in_dim]
            assert np.array_equal(core.matmul(x, codes, fmt), core.matmul(x, values, "fp32")), fmt
    (out_dim, in_dim), codes = shapes[0], stored["q8_0"][0]
    assert np.array_equal(core.matmul(x_of[in_dim], codes, "q8_0", "int8"),
                          weight_formats.matmul_int8(x_of[in_dim], codes, in_dim))
    bandwidth = core.memory_bandwidth()["read_bytes_per_s"]
    variants = list(weight_formats.FORMATS) + ["q8_0 x int8"]

    def one_token(variant):
        fmt, *int8 = variant.split(" x ")
        start = time.perf_counter()
        for (out_dim, in_dim), codes in zip(shapes, stored[fmt]):
            core.matmul(x_of[in_dim], codes, fmt, "int8" if int8 else "fp32")
        return time.perf_counter() - start

    seconds = {v: [] for v in variants}
    ratios = {v: [] for v in variants}
    for variant in variants:
        one_token(variant)                                   # warm up
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        taken = {v: one_token(v) for v in order}
        for v in variants:
            seconds[v].append(taken[v])
            ratios[v].append(taken["fp32"] / taken[v])
    rows = []
    print(f"{args.shape} shape, {args.tokens} token(s) a product, {core.get_num_threads()} "
          f"threads, read bandwidth {bandwidth / 1e9:.1f} GB/s, median of {args.rounds} rounds")
    print(f"{'format':<13}{'weight bytes':>14}{'ms':>9}{'vs fp32':>10}{'GB/s':>8}{'of read bw':>12}")
    for variant in variants:
        nbytes = sum(c.nbytes for c in stored[variant.split(" x ")[0]])
        median = statistics.median(seconds[variant])
        speedup = statistics.median(ratios[variant])
        rate = nbytes / median
        rows.append({"format": variant, "weight_bytes": nbytes, "ms": 1e3 * median,
                     "ms_runs": [1e3 * s for s in seconds[variant]], "speedup_vs_fp32": speedup,
                     "speedup_runs": ratios[variant], "bytes_per_s": rate,
                     "share_of_read_bandwidth": rate / bandwidth})
        print(f"{variant:<13}{nbytes:>14,}{1e3 * median:>9.2f}{speedup:>9.2f}x{rate / 1e9:>8.1f}"
              f"{100 * rate / bandwidth:>11.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"shape": args.shape, "tokens": args.tokens, "threads": core.get_num_threads(),
             "read_bytes_per_s": bandwidth, "rounds": args.rounds, "formats": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
