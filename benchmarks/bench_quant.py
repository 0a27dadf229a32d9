"""Quantized KV caches: bytes per token, decode attention time, and the accuracy they cost.

1. Bytes per token of each format (scales and zero points included), for the bundled
   model and for Llama 3 8B's shape, from kvlab.kv_bytes_per_token; the bundled model's
   figures are checked against what a real cache allocates.
2. Decode attention alone at long context: one layer shaped like Llama 3 8B's (32 query
   heads, 8 KV heads of head_dim 128), a cache filled with random K/V rows by
   cache.append, and cache.attend(q) timed for every format, interleaved in one run
   (round-robin, each format first in turn, best of N; every round's times are kept in the
   JSON too), so the ratio to fp32 is measured side by side. Also the bytes attention
   reads per second (codes, scales and zero points).
3. Accuracy (kvlab.accuracy): the bundled model on the validation split of Tiny
   Shakespeare it was not trained on, and stories260K (if ../shared/models is present)
   on text it generated; perplexity change, KL and top-1 agreement against fp32.

    python benchmarks/bench_quant.py [--contexts 4096,16384,32768] [--tokens 8192]
                                     [--data ../shared/data/tinyshakespeare.txt] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab import accuracy

FORMATS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVLAB_SHARED", REPO.parent / "shared"))


def bytes_table() -> list:
    default = kvlab.load()
    llama3 = kvlab.ModelConfig.llama3_8b()
    rows = []
    for fmt in FORMATS:
        measured = default.new_cache(1024, fmt).nbytes // 1024
        predicted = kvlab.kv_bytes_per_token(default.config, fmt)
        assert measured == predicted, (fmt, measured, predicted)   # the formula is the allocation
        rows.append({"format": fmt, "default_model": predicted,
                     "llama3_8b": kvlab.kv_bytes_per_token(llama3, fmt),
                     "ratio_to_fp32": predicted / kvlab.kv_bytes_per_token(default.config, "fp32")})
    return rows


def attention_times(contexts, repeats: int) -> list:
    n_heads, n_kv_heads, head_dim = 32, 8, 128            # one Llama 3 8B layer
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_heads, head_dim), dtype=np.float32)
    rows = []
    for context in contexts:
        keys = rng.standard_normal((context, 1, n_kv_heads, head_dim), dtype=np.float32)
        values = rng.standard_normal((context, 1, n_kv_heads, head_dim), dtype=np.float32)
        caches = {}
        for fmt in FORMATS:
            cache = kvlab.KVCache(1, n_kv_heads, head_dim, context, key_format=fmt, value_format=fmt)
            cache.append(keys, values)
            cache.attend(q)                                    # touch every page once
            caches[fmt] = cache
        taken = {fmt: [] for fmt in FORMATS}
        for r in range(repeats):                               # round-robin: same conditions
            order = FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]   # each first in turn
            for fmt in order:
                start = time.perf_counter()
                caches[fmt].attend(q)
                taken[fmt].append(time.perf_counter() - start)
        best = {fmt: min(taken[fmt]) for fmt in FORMATS}
        for fmt in FORMATS:
            read = caches[fmt].nbytes                          # every row of K and V, once
            rows.append({"context": context, "format": fmt, "seconds": best[fmt],
                         "ratio_to_fp32": best["fp32"] / best[fmt],
                         "bytes_read": read, "gb_per_s": read / best[fmt] / 1e9,
                         # every round's time, and fp32's time over this format's in it
                         "round_seconds": taken[fmt],
                         "round_ratios_to_fp32": [f / t for f, t in zip(taken["fp32"], taken[fmt])]})
        del caches
    return rows


def accuracy_reports(tokens: int, data: Path) -> list:
    reports = []
    model = kvlab.load()
    if data.is_file():
        ids = accuracy.validation_tokens(model, str(data), tokens)
        report = accuracy.evaluate(model, ids, progress=True)
        report.model += " (Tiny Shakespeare validation split)"
        reports.append(report)
    else:
        print(f"({data} not found: skipping the default model's held-out perplexity)")
    stories = SHARED / "models" / "stories260K" / "stories260K.bin"
    if stories.is_file():
        small = kvlab.load(stories, SHARED / "models" / "stories260K" / "tok512.bin")
        ids = accuracy.generated_tokens(small, min(tokens, 4096), seed=0)
        report = accuracy.evaluate(small, ids, context=small.config.max_seq_len, progress=True)
        report.model += " (its own generated text)"
        reports.append(report)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=8192,
                        help="validation tokens for the perplexity runs (0: the whole split)")
    parser.add_argument("--data", default=str(SHARED / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_quant.json"))
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    print(f"kvlab {kvlab.__version__}, {kvlab.get_num_threads()} threads\n")
    sizes = bytes_table()
    print("1. Bytes per token (all layers, K and V, scales and zero points included)")
    print(f"{'format':<8}{'default model':>15}{'Llama 3 8B':>14}{'vs fp32':>10}")
    for row in sizes:
        print(f"{row['format']:<8}{row['default_model']:>15,}{row['llama3_8b']:>14,}"
              f"{row['ratio_to_fp32']:>10.3f}")

    times = attention_times(contexts, args.repeats)
    print("\n2. Decode attention, one Llama 3 8B layer (32 heads, 8 KV heads, head_dim 128)")
    print(f"{'context':>8} {'format':<7}{'ms':>9}{'fp32 / this':>13}{'GB/s read':>11}")
    for row in times:
        print(f"{row['context']:>8} {row['format']:<7}{1e3 * row['seconds']:>9.2f}"
              f"{row['ratio_to_fp32']:>12.2f}x{row['gb_per_s']:>11.2f}")

    reports = accuracy_reports(args.tokens or 10 ** 9, Path(args.data))
    for i, report in enumerate(reports):
        print(f"\n3.{i + 1} Accuracy against the fp32 cache")
        print(report.table())

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": kvlab.get_num_threads(), "bytes_per_token": sizes,
                               "attention": times,
                               "accuracy": [r.as_dict() for r in reports]}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
