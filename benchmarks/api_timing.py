"""Timings of the paths the Python API and the binding sit on, for benchmarks/ab.py.

Issue 19 moved the binding into files by object, gave the API one word per concept, split
the paged pool into a block manager and stores, and made the engine's tracer read events
instead of diffing the pool. None of that may slow the fast path: this script times what
those changes touch, on the bundled model (small, so the Python and binding overhead per
call shows), and prints "name value" lines, higher is better:

    python benchmarks/ab.py run benchmarks/api_timing.py before after --rounds 5

It runs against old and new builds alike (it spells SamplingParams' length limit the way
the build in use does).

The bundled model is too small to show the matrix kernels (issue 37: a 0.70x prefill
regression on the 110M shape went unseen here), so the script also times a 256-token
prefill on two threads over llama2.c's stories15M and stories110M shapes with random
weights, where the weight matrices' products are the work. `python api_timing.py prefill`
prints those two figures alone (what a bisection needs).
"""
from __future__ import annotations

import inspect
import sys
import time

import numpy as np

import kvlab


def best_rate(work, amount: float, repeats: int = 5) -> float:
    """amount / seconds of the fastest of `repeats` runs of work()."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return amount / best


def params(n_tokens: int):
    names = inspect.signature(kvlab.SamplingParams).parameters
    key = "max_new_tokens" if "max_new_tokens" in names else "max_tokens"
    return kvlab.SamplingParams(**{key: n_tokens, "stop_at_eos": False})


# llama2.c's checkpoint shapes (vocabulary 32,000, tied classifier), as bench_cpu.py has them
WEIGHT_BOUND_SHAPES = {
    "15M": dict(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6),
    "110M": dict(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12),
}


def weight_bound_prefill(threads: int = 2) -> None:
    """256-token prefill on the 15M and 110M shapes with Weights.random's weights (seed 0):
    on `threads` threads by the wall clock (the issue's figure), and on one thread by CPU
    seconds, which the neighbours' load on a shared machine moves far less (two threads
    wait at every barrier for a thread the scheduler took away). A few seconds per shape,
    most of it making the weights."""
    tokens = (np.arange(256, dtype=np.int32) * 7919 + 1) % 32000
    for name, shape in WEIGHT_BOUND_SHAPES.items():
        config = kvlab.ModelConfig(vocab_size=32000, max_seq_len=512,
                                   name=f"random stories{name} shape", **shape)
        model = kvlab.Model(config, kvlab.Weights.random(config, seed=0))

        def prefill():
            model.prefill(tokens, model.new_cache(256))
        kvlab.set_num_threads(threads)
        prefill()                           # the first pass touches the weights' pages
        print(f"prefill_256_{name}_random_{threads}_threads_tok_s",
              best_rate(prefill, 256, repeats=3))
        kvlab.set_num_threads(1)
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            prefill()
            best = min(best, time.process_time() - start)
        print(f"prefill_256_{name}_random_1_thread_cpu_tok_s", 256 / best)


def main() -> None:
    if sys.argv[1:] == ["prefill"]:
        weight_bound_prefill()
        return
    model = kvlab.load()
    kvlab.set_num_threads(1)              # the overhead per call, not the cores
    prompt = list(range(1, 33))
    n_new = 200

    def generate(fast):
        return lambda: kvlab.generate(model, prompt, n_new, fast=fast, stop_at_eos=False)
    print("decode_c_loop_tok_s", best_rate(generate(True), n_new))
    print("decode_python_loop_tok_s", best_rate(generate(False), n_new))

    tokens = np.arange(256, dtype=np.int32) % 256

    def prefill():
        model.prefill(tokens, model.new_cache(256))
    print("prefill_256_tok_s", best_rate(prefill, 256))

    def forward_uncached():
        model.forward(tokens[:64])
    print("forward_uncached_64_calls_s", best_rate(forward_uncached, 1))

    def engine(trace):
        def work():
            pool = model.new_paged_pool(num_blocks=256, block_size=16)
            eng = kvlab.Engine(model, pool, trace=[] if trace else None)
            for i in range(16):
                eng.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], params(32))
            eng.run(progress=False)
        return work
    print("engine_16x32_tok_s", best_rate(engine(False), 16 * 32, repeats=3))
    print("engine_16x32_traced_tok_s", best_rate(engine(True), 16 * 32, repeats=3))

    def pool_ops():
        pool = model.new_paged_pool(num_blocks=64, block_size=4)
        seqs = [pool.new_sequence() for _ in range(8)]
        for seq in seqs:
            model.prefill(tokens[:10], seq)
        for seq in seqs:
            pool.free(pool.fork(seq))
    print("pool_prefill_fork_free_rounds_s", best_rate(pool_ops, 1))

    weight_bound_prefill()


if __name__ == "__main__":
    main()
