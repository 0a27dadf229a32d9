"""How long Ctrl-C takes to stop a long call: from the SIGINT to the KeyboardInterrupt.

    python benchmarks/interrupt_latency.py [--rounds 5] [--json interrupt_latency.json]
                                           [--gguf SmolLM2.gguf] [--only engine] [--long]

Each round starts a call that would run for many seconds (an uncached forward over 8,000
tokens, a prefill of 6,000, 8,000 decode steps in C, one kvlab.Engine step prefilling 4
prompts of 2,000 tokens) on the bundled model given room for 9,000 positions, sends this
process SIGINT a random 0.2-0.8 s into it, and measures the time until the call has raised.
The C core looks at Python's signals between the chunks of a long forward (about
KV_CHUNK_FLOPS of work each) and between decode steps, at most every 20 ms; the engine
between the forward calls it splits a long step into. --gguf adds an Engine step on that
model (2 prompts of 600 tokens: SmolLM2-135M takes seconds). --long adds calls at a long
context on llama2.c's 110M shape (random weights, or --gguf's when it has that shape): a
prefill of 960 tokens after 8,000 cached positions, where every chunk is the shortest
(KV_CHUNK_MIN, 96 tokens) and still 25 times KV_CHUNK_FLOPS, and an Engine step feeding
300 tokens after 8,000 positions its prefix cache holds (calls of 96 tokens). Those stop
between layers (the C core looks inside a pass of more than KV_CHUNK_FLOPS). --only keeps
the calls whose name has that word. Prints a table (median and worst per call) and writes
JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from typing import Tuple

import numpy as np

import kvlab


def latency(call, delay: float) -> Tuple[float, float]:
    """Seconds from a SIGINT sent `delay` s into call() to call() raising, by the wall clock
    and as the process's CPU seconds over its threads (what the wall would read on an idle
    machine: on a loaded one the wall counts the others' turns too); inf if it ended first."""
    sent = {}

    def fire():
        time.sleep(delay)
        sent["at"] = time.perf_counter(), time.process_time()
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=fire)
    thread.start()
    try:
        call()
    except KeyboardInterrupt:
        stopped = time.perf_counter(), time.process_time()
        thread.join()
        return (stopped[0] - sent["at"][0],
                (stopped[1] - sent["at"][1]) / kvlab.get_num_threads())
    thread.join()
    return float("inf"), float("inf")


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


def long_context_model(gguf=None):
    """llama2.c's 110M shape given room for 9,000 positions: --gguf's weights if they have
    that shape, else random ones (the time a call takes depends on the shape alone)."""
    shape = dict(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12,
                 vocab_size=32000)
    if gguf is not None:
        model = kvlab.load(gguf)
        if all(getattr(model.config, k) == v for k, v in shape.items()):
            return kvlab.Model(model.config.replace(max_seq_len=9000), model.weights,
                               model.tokenizer)
    config = kvlab.ModelConfig(**shape, max_seq_len=9000, name="random 110M shape")
    return kvlab.Model(config, kvlab.Weights.random(config, seed=0))


def filled_rows(model, n: int, rng) -> np.ndarray:
    """n rows of K (or V) for every layer and head, as pool.append and cache.append take."""
    c = model.config
    return rng.standard_normal((n, c.n_layers, c.n_kv_heads, c.head_dim), np.float32)


def long_calls(model, rng) -> dict:
    """The --long calls (module text), each made after `past` positions are in place."""
    past, rows = 8000, filled_rows(model, 8000, rng)

    def prefill():
        cache = model.new_cache(9000)
        cache.append(rows, rows)
        tokens = rng.integers(0, model.config.vocab_size, 960)
        return lambda: model.prefill(tokens, cache)

    def engine_step():
        pool = model.new_paged_pool(num_blocks=(past + 300) // 16 + 2, block_size=16)
        prompt = rng.integers(0, model.config.vocab_size, past + 300).tolist()
        seq = pool.new_sequence()
        pool.append(seq, np.array(prompt[:past], np.int32), rows, rows)
        pool.free(seq)                       # its blocks stay in the prefix cache
        engine = kvlab.Engine(model, pool, max_batch_tokens=512)
        engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=2))
        return engine.step
    return {"prefill, 110M, 960 tokens after 8,000": prefill,
            "Engine.step, 110M, 300 tokens after 8,000": engine_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="interrupt_latency.json")
    parser.add_argument("--gguf", help="also an Engine step on this model")
    parser.add_argument("--only", default="", help="the calls whose name has this word")
    parser.add_argument("--long", action="store_true",
                        help="also calls at a long context on the 110M shape")
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
    if args.long:
        calls.update(long_calls(long_context_model(args.gguf), rng))
    rows = []
    for name, make in calls.items():
        if args.only.lower() not in name.lower():
            continue
        seconds, cpu = zip(*[latency(make(), float(rng.uniform(0.2, 0.8)))
                             for _ in range(args.rounds)])
        rows.append({"call": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "worst_s": max(seconds), "cpu_per_thread_s": cpu,
                     "cpu_median_s": statistics.median(cpu), "cpu_worst_s": max(cpu)})
    print(f"{'call':<42} {'median (ms)':>11} {'worst (ms)':>10}   CPU s / thread: median, "
          f"worst (ms)   threads {kvlab.get_num_threads()}")
    for r in rows:
        print(f"{r['call']:<42} {1e3 * r['median_s']:>11.1f} {1e3 * r['worst_s']:>10.1f}   "
              f"{1e3 * r['cpu_median_s']:>10.1f} {1e3 * r['cpu_worst_s']:>10.1f}")
    with open(args.json, "w") as f:
        json.dump({"threads": kvlab.get_num_threads(), "rounds": args.rounds, "calls": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
