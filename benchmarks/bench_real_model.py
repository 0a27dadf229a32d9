"""A real GGUF file's own 4-bit weights against the same file at 8 bits, side by side.

    python benchmarks/bench_real_model.py [MODEL.gguf] [--rounds 7] [--threads 2]
                                          [--json out.json]

The course's model, SmolLM2-135M-Instruct.Q4_1.gguf, stores its 210 layer matrices as Q4_1
(20 bytes a block of 32) and its tied embedding as Q8_0. kvlab keeps both as the file's
bytes (kvlab.loaders.gguf), so a decode step reads about 97 MB; loaded with weights="q8_0",
every matrix is 34 bytes a block and a step reads about 145 MB. Both use int8 activations
(the Model default for block formats). This loads the file both ways and, in each round,
the two taking turns (the order alternating), times
  * decode: `--steps` greedy decode steps after a 16-token prompt (model.decode_steps, the
    whole loop in C), tokens per second;
  * prefill: a `--prompt`-token prompt into a fresh cache, tokens per second;
and, each in a fresh child process, the resident memory the load added (the weights, and
whatever loading left behind), beside the file's size. Token ids only: the prompt is ids
1000, 1001, ... (no tokenizer is needed to time a forward pass).

The model comes from the first argument, else $KVLAB_SMOLLM2_GGUF, else the named model
smollm2-135m (kvlab.fetch: fetched into the cache folder once); where it cannot be had the
benchmark says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab.process_memory import release_freed_memory, resident_bytes

VARIANTS = {"q4_1 (kept)": None, "q8_0": "q8_0"}   # name -> kvlab.load's weights=


def model_path(argument) -> Path:
    """The file to time: the argument, else $KVLAB_SMOLLM2_GGUF, else the named model
    smollm2-135m (fetched into the cache folder once); None where it cannot be had."""
    named = argument or os.environ.get("KVLAB_SMOLLM2_GGUF")
    if named:
        return Path(named)
    try:
        return kvlab.fetch("smollm2-135m")
    except kvlab.FetchError as error:
        print(f"skipped: {error}")
        return None


def decode_tokens_per_second(model, steps: int) -> float:
    prompt = np.arange(1000, 1016, dtype=np.int32)
    cache = model.new_cache(len(prompt) + steps)
    first = int(np.argmax(model.prefill(prompt, cache)))
    _, seconds = model.decode_steps(first, cache, steps)
    return 1.0 / float(np.median(seconds))


def prefill_tokens_per_second(model, n: int) -> float:
    prompt = (1000 + np.arange(n) % 40000).astype(np.int32)
    cache = model.new_cache(n)
    start = time.perf_counter()
    model.prefill(prompt, cache)
    return n / (time.perf_counter() - start)


def load_memory(path: Path, weights) -> dict:
    """In this (child) process: resident bytes the load added, and the weights' own."""
    import gguf  # noqa: F401  (the reader's import, not the weights, is not the load's cost)
    release_freed_memory()
    before = resident_bytes()
    model = kvlab.load(path, weights=weights)
    release_freed_memory()
    return {"added_bytes": resident_bytes() - before, "weights_bytes": model.weights_nbytes,
            "formats": sorted(set(model.weights.formats.values()))}


def memory_in_child(path: Path, weights) -> dict:
    out = subprocess.run([sys.executable, __file__, str(path), "--memory-of", weights or "kept"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="the .gguf file")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--prompt", type=int, default=256, help="prefill length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)   # the child's job
    args = parser.parse_args(argv)
    path = model_path(args.model)
    if path is None:
        return 0
    if not path.is_file():
        print(f"skipped: no model at {path}")
        return 0
    if args.memory_of:
        print(json.dumps(load_memory(path, None if args.memory_of == "kept" else args.memory_of)))
        return 0

    kvlab.set_num_threads(args.threads)
    file_bytes = path.stat().st_size
    memory = {name: memory_in_child(path, weights) for name, weights in VARIANTS.items()}
    models = {name: kvlab.load(path, weights=weights) for name, weights in VARIANTS.items()}
    names = list(VARIANTS)
    for name in names:                                   # warm up
        decode_tokens_per_second(models[name], 4)
    decode = {name: [] for name in names}
    prefill = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):   # the two take turns
            decode[name].append(decode_tokens_per_second(models[name], args.steps))
            prefill[name].append(prefill_tokens_per_second(models[name], args.prompt))
    rows = []
    for name in names:
        rows.append({"variant": name, "formats": memory[name]["formats"],
                     "decode_tok_s": statistics.median(decode[name]),
                     "prefill_tok_s": statistics.median(prefill[name]),
                     "weights_bytes": memory[name]["weights_bytes"],
                     "load_added_bytes": memory[name]["added_bytes"],
                     "decode_rounds": decode[name], "prefill_rounds": prefill[name]})
    q4, q8 = rows
    # the speedup of each round's pair, then the median: the two ran side by side
    speedups = [a / b for a, b in zip(decode[names[0]], decode[names[1]])]
    result = {"model": str(path), "file_bytes": file_bytes, "threads": args.threads,
              "rounds": args.rounds, "steps": args.steps, "prompt": args.prompt,
              "decode_speedup_q4_1_over_q8_0": statistics.median(speedups),
              "prefill_speedup_q4_1_over_q8_0": q4["prefill_tok_s"] / q8["prefill_tok_s"],
              "variants": rows}

    print(f"{path.name} ({file_bytes / 1e6:.1f} MB), {args.threads} threads, "
          f"{args.rounds} alternating rounds, medians")
    print(f"{'weights':<14}{'formats':<13}{'decode tok/s':>13}{'prefill ' + str(args.prompt):>13}"
          f"{'weights MB':>12}{'RSS added MB':>14}")
    for row in rows:
        print(f"{row['variant']:<14}{'+'.join(row['formats']):<13}{row['decode_tok_s']:>13.1f}"
              f"{row['prefill_tok_s']:>13.1f}{row['weights_bytes'] / 1e6:>12.1f}"
              f"{row['load_added_bytes'] / 1e6:>14.1f}")
    print(f"decode: q4_1 {result['decode_speedup_q4_1_over_q8_0']:.2f}x q8_0's (median of "
          f"each round's ratio); prefill {result['prefill_speedup_q4_1_over_q8_0']:.2f}x; "
          f"q4_1 load added {q4['load_added_bytes'] / file_bytes:.2f}x the file's bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
