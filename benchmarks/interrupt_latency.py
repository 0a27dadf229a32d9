"""How long Ctrl-C takes to stop a long call: from the SIGINT to the KeyboardInterrupt.

    python benchmarks/interrupt_latency.py [--rounds 5] [--json interrupt_latency.json]
                                           [--gguf SmolLM2.gguf] [--only engine]

Each round starts a call that would run for many seconds (an uncached forward over 8,000
tokens, a prefill of 6,000, 8,000 decode steps in C, one kvlab.Engine step prefilling 4
prompts of 2,000 tokens) on the bundled model given room for 9,000 positions, sends this
process SIGINT a random 0.2-0.8 s into it, and measures the time until the call has raised.
The C core looks at Python's signals between the chunks of a long forward (about
KV_CHUNK_FLOPS of work each) and between decode steps, at most every 20 ms; the engine
between the forward calls it splits a long step into. --gguf adds an Engine step on that
model (2 prompts of 600 tokens: SmolLM2-135M takes seconds). --only keeps the calls whose
name has that word. Prints a table (median and worst per call) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time

import numpy as np

import kvlab


def latency(call, delay: float) -> float:
    """Seconds from a SIGINT sent `delay` s into call() to call() raising; inf if it ended first."""
    sent = {}

    def fire():
        time.sleep(delay)
        sent["at"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=fire)
    thread.start()
    try:
        call()
    except KeyboardInterrupt:
        stopped = time.perf_counter()
        thread.join()
        return stopped - sent["at"]
    thread.join()
    return float("inf")


def engine_step(model, prompts: int, length: int, rng):
    """One Engine.step() call prefilling `prompts` random prompts of `length` tokens at
    once, each round on a fresh engine made before the clock starts."""
    def build():
        engine = kvlab.Engine(model, num_blocks=prompts * (length // 16 + 2), block_size=16,
                              max_batch_tokens=prompts * length)
        for _ in range(prompts):
            engine.add_request(rng.integers(0, model.config.vocab_size, length).tolist(),
                               kvlab.SamplingParams(max_new_tokens=2))
        return engine.step
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="interrupt_latency.json")
    parser.add_argument("--gguf", help="also an Engine step on this model")
    parser.add_argument("--only", default="", help="the calls whose name has this word")
    args = parser.parse_args()
    base = kvlab.load()
    model = kvlab.Model(base.config.replace(max_seq_len=9000), base.weights, base.tokenizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 8000)

    def decode():
        cache = model.new_cache(9000)
        model.decode_steps(int(np.argmax(model.prefill([1, 2, 3], cache))), cache, 8000)

    # each a function that makes the call to interrupt (the making is not timed)
    calls = {"forward, 8,000 tokens, no cache": lambda: lambda: model.forward(tokens),
             "prefill, 6,000 tokens": lambda: lambda: model.prefill(tokens[:6000],
                                                                    model.new_cache(6000)),
             "decode_steps, 8,000 steps": lambda: decode,
             "Engine.step, 4 x 2,000 tokens": engine_step(model, 4, 2000, rng)}
    if args.gguf:
        calls["Engine.step, gguf, 2 x 600 tokens"] = engine_step(kvlab.load(args.gguf), 2, 600, rng)
    rows = []
    for name, make in calls.items():
        if args.only.lower() not in name.lower():
            continue
        seconds = [latency(make(), float(rng.uniform(0.2, 0.8))) for _ in range(args.rounds)]
        rows.append({"call": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "worst_s": max(seconds)})
    print(f"{'call':<36} {'median (ms)':>11} {'worst (ms)':>10}   threads {kvlab.get_num_threads()}")
    for r in rows:
        print(f"{r['call']:<36} {1e3 * r['median_s']:>11.1f} {1e3 * r['worst_s']:>10.1f}")
    with open(args.json, "w") as f:
        json.dump({"threads": kvlab.get_num_threads(), "rounds": args.rounds, "calls": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
