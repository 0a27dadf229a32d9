"""Decode and prefill with the weights in fp32, fp16, bf16 and Q8_0, side by side.

    python benchmarks/bench_weights.py [--shape 110m|15m] [--rounds 5] [--json out.json]
                                       [--kernels]

A decode step reads every weight once, so its time is about the weights' bytes over the
read bandwidth. For one model shape (llama2.c's stories15M or stories110M, random weights)
this builds the model once per weight format, plus Q8_0 with its activations in int8
(llama.cpp's way, "q8_0 x int8"), and in each round, the variants taking turns, times
  * decode: `--steps` greedy decode steps after a 16-token prompt (model.decode_steps, the
    whole loop in C), and
  * prefill: a `--prompt`-token prompt into a fresh cache,
then reports per variant the medians, the speedup over fp32 measured in the same rounds,
the bytes a decode step reads (the core's own count: weights, and K/V), those bytes per
second, and that as a share of the machine's read bandwidth (kvlab.measure.memory_bandwidth,
measured in the same run). Before anything is timed, every float32-activation variant's
logits are checked equal, bit for bit, to the float32 model's over the same dequantized
weights, and "q8_0 x int8"'s to agree with every path of its own.

--gguf DIR also writes the random weights as DIR/random-SHAPE-q8_0.gguf and -f32.gguf
(kvlab.loaders.save_gguf, with a placeholder vocabulary), so that llama.cpp can run the
very same numbers (llama-bench -m FILE), and checks that kvlab reads them back byte for byte.

--llama-bench PATH (with --gguf) also runs llama.cpp's llama-bench on those two files, in
turns with kvlab decoding the same files loaded by kvlab.load (Q8_0 with its default int8
activations, F32), and reports both engines' decode and prefill tokens/s side by side. Not
part of CI: llama.cpp is built by hand from a source package.

--kernels times the matrix products of one decode token alone instead (kvlab._kvlab.matmul
over every layer's matrices and the classifier), the kernels without the rest of the model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab import weight_formats
from kvlab._core import core
from kvlab.measure import memory_bandwidth

SHAPES = {   # (dim, hidden_dim, n_layers, n_heads, vocab_size): llama2.c's stories models
    "15m": (288, 768, 6, 6, 32000),
    "110m": (768, 2048, 12, 12, 32000),
}
VARIANTS = ["fp32", "fp16", "bf16", "q8_0", "q8_0 x int8"]


def config_of(shape: str) -> kvlab.ModelConfig:
    dim, hidden, n_layers, n_heads, vocab = SHAPES[shape]
    return kvlab.ModelConfig(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
                             n_kv_heads=n_heads, vocab_size=vocab, max_seq_len=1024,
                             name=f"random {shape}")


def build_models(shape: str) -> dict:
    """One model per variant over the same random weights (stored once per format)."""
    config = config_of(shape)
    weights = kvlab.Weights.random(config, seed=0, scale=0.05)
    stored = {fmt: weights.converted(fmt) for fmt in weight_formats.FORMATS}
    models = {}
    for variant in VARIANTS:
        fmt, *int8 = variant.split(" x ")
        models[variant] = kvlab.Model(config, stored[fmt], activations="int8" if int8 else "fp32")
    return models


def check(models: dict, prompt: np.ndarray) -> None:
    """Bit for bit: each float32-activation variant gives the float32 model's logits over
    its dequantized weights; int8 activations give the same logits cached and uncached."""
    for variant, model in models.items():
        cache = model.new_cache(len(prompt))
        cached = model.prefill(prompt[:-1], cache, all_logits=True)
        last = model.decode(int(prompt[-1]), cache)
        if variant.endswith("int8"):
            want = model.forward(prompt, all_logits=True)
        else:
            over_values = kvlab.Model(model.config, model.weights.float32())
            want = over_values.forward(prompt, all_logits=True)
        assert np.array_equal(np.vstack([cached, last]), want), variant


def decode_seconds(model, prompt: np.ndarray, steps: int) -> float:
    """Seconds per decode step, median over `steps` steps after the prompt."""
    cache = model.new_cache(len(prompt) + steps)
    first = int(np.argmax(model.prefill(prompt, cache)))
    _, seconds = model.decode_steps(first, cache, steps)
    return float(np.median(seconds))


def prefill_seconds(model, prompt: np.ndarray) -> float:
    cache = model.new_cache(len(prompt))
    start = time.perf_counter()
    model.prefill(prompt, cache)
    return time.perf_counter() - start


def bytes_per_decode_step(model, prompt: np.ndarray) -> int:
    """What the core counts one decode step at position len(prompt) reading."""
    cache = model.new_cache(len(prompt) + 1)
    model.prefill(prompt, cache)
    with model.counting() as step:
        model.decode(int(prompt[0]), cache)
    return step.weight_bytes + step.kv_read_bytes


def interleaved(variants: list, rounds: int, run) -> tuple:
    """Each variant run once per round, the order rotating; medians of the times, and of
    each round's fp32 time over the variant's."""
    times = {v: [] for v in variants}
    ratios = {v: [] for v in variants}
    for v in variants:
        run(v)                                            # warm up
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        taken = {v: run(v) for v in order}
        for v in variants:
            times[v].append(taken[v])
            ratios[v].append(taken["fp32"] / taken[v])
    return times, ratios


def write_gguf(models: dict, folder: Path, shape: str) -> list:
    """The fp32 and Q8_0 weights as GGUF files other engines read; checked read back."""
    from kvlab.loaders import save_gguf
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for variant, ggml in (("q8_0", "q8_0"), ("fp32", "f32")):
        model = models[variant]
        path = folder / f"random-{shape}-{ggml}.gguf"
        save_gguf(path, model.config, model.weights, placeholder_vocabulary=True)
        back = kvlab.load(path)
        assert all(np.array_equal(weight_formats.as_bytes(getattr(back.weights, name)),
                                  weight_formats.as_bytes(getattr(model.weights, name)))
                   for name in model.weights.formats), path
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        written.append(str(path))
    return written


def llama_bench(binary: str, path: str, threads: int, prompt: int, steps: int) -> tuple:
    """llama.cpp's (decode, prefill) tokens/s on a GGUF file: one run of each test."""
    import subprocess
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(prompt), "-n",
                          str(steps), "-r", "1", "-o", "json"], capture_output=True, text=True,
                         check=True).stdout
    tests = json.loads(out)
    decode = next(t["avg_ts"] for t in tests if t["n_gen"] > 0)
    prefill = next(t["avg_ts"] for t in tests if t["n_prompt"] > 0)
    return decode, prefill


def compare_llama_cpp(args, files: list) -> list:
    """kvlab and llama.cpp on the same GGUF files, in turns, medians of args.rounds."""
    threads = core.get_num_threads()
    rng = np.random.default_rng(1)
    rows = []
    for path in files:
        model = kvlab.load(path)
        short = rng.integers(0, model.config.vocab_size, 16).astype(np.int32)
        long = rng.integers(0, model.config.vocab_size, args.prompt).astype(np.int32)
        theirs, ours = [], []
        for _ in range(args.rounds):
            theirs.append(llama_bench(args.llama_bench, path, threads, args.prompt, args.steps))
            ours.append((1 / decode_seconds(model, short, args.steps),
                         args.prompt / prefill_seconds(model, long)))
        row = {"file": Path(path).name, "weights": model.weight_format,
               "activations": model.activations,
               "kvlab_decode_tokens_per_s": statistics.median(o[0] for o in ours),
               "llama_cpp_decode_tokens_per_s": statistics.median(t[0] for t in theirs),
               "kvlab_prefill_tokens_per_s": statistics.median(o[1] for o in ours),
               "llama_cpp_prefill_tokens_per_s": statistics.median(t[1] for t in theirs),
               "runs": {"kvlab": ours, "llama_cpp": theirs}}
        rows.append(row)
        print(f"{row['file']:<26} decode kvlab {row['kvlab_decode_tokens_per_s']:7.1f} "
              f"llama.cpp {row['llama_cpp_decode_tokens_per_s']:7.1f} tok/s "
              f"({row['kvlab_decode_tokens_per_s'] / row['llama_cpp_decode_tokens_per_s']:.2f}x); "
              f"prefill {args.prompt}: kvlab {row['kvlab_prefill_tokens_per_s']:7.1f} "
              f"llama.cpp {row['llama_cpp_prefill_tokens_per_s']:7.1f} tok/s")
    return rows


def bench_model(args, bandwidth: float) -> dict:
    models = build_models(args.shape)
    written = write_gguf(models, Path(args.gguf), args.shape) if args.gguf else []
    rng = np.random.default_rng(1)
    vocab = models["fp32"].config.vocab_size
    short = rng.integers(0, vocab, 16).astype(np.int32)
    long = rng.integers(0, vocab, args.prompt).astype(np.int32)
    check(models, short[:6])
    decode, decode_ratio = interleaved(VARIANTS, args.rounds,
                                       lambda v: decode_seconds(models[v], short, args.steps))
    prefill, prefill_ratio = interleaved(VARIANTS, args.rounds,
                                         lambda v: prefill_seconds(models[v], long))
    print(f"{args.shape} shape, random weights, {core.get_num_threads()} threads, read "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s; medians of {args.rounds} interleaved rounds "
          f"({args.steps} decode steps after 16 tokens; a {args.prompt}-token prefill)")
    print(f"{'weights':<13}{'weight bytes':>14}{'decode tok/s':>14}{'vs fp32':>9}"
          f"{'read GB/s':>11}{'of bw':>7}{'prefill tok/s':>15}{'vs fp32':>9}")
    rows = []
    for v in VARIANTS:
        model = models[v]
        step_bytes = bytes_per_decode_step(model, short)
        seconds = statistics.median(decode[v])
        rate = step_bytes / seconds
        row = {"variant": v, "weights_nbytes": model.weights_nbytes,
               "bytes_per_decode_step": step_bytes,
               "decode_tokens_per_s": 1 / seconds, "decode_runs_s": decode[v],
               "decode_speedup_vs_fp32": statistics.median(decode_ratio[v]),
               "decode_speedup_runs": decode_ratio[v],
               "read_bytes_per_s": rate, "share_of_read_bandwidth": rate / bandwidth,
               "prefill_tokens_per_s": args.prompt / statistics.median(prefill[v]),
               "prefill_runs_s": prefill[v],
               "prefill_speedup_vs_fp32": statistics.median(prefill_ratio[v])}
        rows.append(row)
        print(f"{v:<13}{model.weights_nbytes:>14,}{row['decode_tokens_per_s']:>14.1f}"
              f"{row['decode_speedup_vs_fp32']:>8.2f}x{rate / 1e9:>11.1f}"
              f"{100 * rate / bandwidth:>6.0f}%{row['prefill_tokens_per_s']:>15.1f}"
              f"{row['prefill_speedup_vs_fp32']:>8.2f}x")
    against = compare_llama_cpp(args, written) if args.llama_bench and written else []
    return {"mode": "model", "variants": rows, "decode_steps": args.steps,
            "prefill_tokens": args.prompt, "gguf_files": written, "llama_cpp": against}


def kernel_matrices(shape: str) -> list:
    """(out_dim, in_dim) of every matrix one decode token multiplies, in order."""
    dim, hidden, n_layers, _, vocab = SHAPES[shape]
    per_layer = [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden)]
    return per_layer * n_layers + [(vocab, dim)]


def bench_kernels(args, bandwidth: float) -> dict:
    rng = np.random.default_rng(0)
    shapes = kernel_matrices(args.shape)
    # every layer reads its own copy, so the weights cannot sit in a cache between layers
    stored = {fmt: [] for fmt in weight_formats.FORMATS}
    for out_dim, in_dim in shapes:
        w = (rng.standard_normal((out_dim, in_dim)) * 0.05).astype(np.float32)
        for fmt in weight_formats.FORMATS:
            stored[fmt].append(weight_formats.quantize(w, fmt))
    x_of = {d: rng.standard_normal((1, d)).astype(np.float32) for d in {i for _, i in shapes}}
    for fmt in weight_formats.FORMATS:     # bit for bit: fp32's product over the values
        for (out_dim, in_dim), codes in list(zip(shapes, stored[fmt]))[:8]:
            values = np.ascontiguousarray(weight_formats.dequantize(codes, fmt, in_dim))
            x = x_of[in_dim]
            assert np.array_equal(core.matmul(x, codes, fmt), core.matmul(x, values, "fp32")), fmt

    def one_token(variant):
        fmt, *int8 = variant.split(" x ")
        start = time.perf_counter()
        for (out_dim, in_dim), codes in zip(shapes, stored[fmt]):
            core.matmul(x_of[in_dim], codes, fmt, "int8" if int8 else "fp32")
        return time.perf_counter() - start

    seconds, ratios = interleaved(VARIANTS, args.rounds, one_token)
    print(f"{args.shape} shape, the products of one decode token, {core.get_num_threads()} "
          f"threads, read bandwidth {bandwidth / 1e9:.1f} GB/s, median of {args.rounds} rounds")
    print(f"{'format':<13}{'weight bytes':>14}{'ms':>9}{'vs fp32':>10}{'GB/s':>8}{'of read bw':>12}")
    rows = []
    for v in VARIANTS:
        nbytes = sum(c.nbytes for c in stored[v.split(" x ")[0]])
        median = statistics.median(seconds[v])
        rate = nbytes / median
        rows.append({"format": v, "weight_bytes": nbytes, "ms": 1e3 * median,
                     "ms_runs": [1e3 * s for s in seconds[v]],
                     "speedup_vs_fp32": statistics.median(ratios[v]), "speedup_runs": ratios[v],
                     "bytes_per_s": rate, "share_of_read_bandwidth": rate / bandwidth})
        print(f"{v:<13}{nbytes:>14,}{1e3 * median:>9.2f}{rows[-1]['speedup_vs_fp32']:>9.2f}x"
              f"{rate / 1e9:>8.1f}{100 * rate / bandwidth:>11.0f}%")
    return {"mode": "kernels", "formats": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--prompt", type=int, default=256, help="prefill length")
    parser.add_argument("--threads", type=int, default=0, help="0: the core's default")
    parser.add_argument("--kernels", action="store_true", help="the products alone")
    parser.add_argument("--gguf", default=None, metavar="DIR",
                        help="also write the weights as GGUF (q8_0, f32) for other engines")
    parser.add_argument("--llama-bench", default=None, metavar="PATH",
                        help="llama.cpp's llama-bench, run on the --gguf files beside kvlab")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.llama_bench and not args.gguf:
        parser.error("--llama-bench needs --gguf DIR (the files both engines read)")
    if args.threads:
        kvlab.set_num_threads(args.threads)
    bandwidth = memory_bandwidth()["read_bytes_per_s"]
    result = bench_kernels(args, bandwidth) if args.kernels else bench_model(args, bandwidth)
    result.update(shape=args.shape, threads=core.get_num_threads(), rounds=args.rounds,
                  read_bytes_per_s=bandwidth)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
