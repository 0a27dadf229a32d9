"""Timings of kvlab.Engine's step, for benchmarks/ab.py: the Python around the one forward
call (planning, choosing tokens, the pool's bookkeeping), on the bundled model, whose
forward calls are small enough for that overhead to show. Prints "name value" lines,
tokens per CPU second, higher is better:

    python benchmarks/ab.py run benchmarks/engine_timing.py before after --rounds 5

Greedy and sampled (n=2) requests on a roomy pool, sampled speculation with prompt lookup,
and a pool tight enough to preempt by recomputing and by swapping. It runs against old and
new builds alike (the Engine's arguments have not changed).
"""
from __future__ import annotations

import time

import numpy as np

import kvlab
from kvlab.speculative import PromptLookup


def best_rate(work, amount: float, repeats: int = 3) -> float:
    """amount / CPU seconds of the fastest of `repeats` runs of work(). CPU time, not the
    wall clock: on a machine shared with other work a process waits for a core by turns,
    which the wall clock counts and the CPU time does not (one thread: see main)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return amount / best


def main() -> None:
    model = kvlab.load()
    kvlab.set_num_threads(1)              # the overhead per step, not the cores
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(16)]
    looping = model.encode("ROMEO:\n") + kvlab.generate(model, "ROMEO:\n", 60).tokens

    def served(new_tokens, num_blocks=256, block_size=16, n=1, temperature=0.0, **options):
        def work():
            engine = kvlab.Engine(model, model.new_paged_pool(num_blocks, block_size), **options)
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, kvlab.SamplingParams(
                    max_new_tokens=new_tokens, n=n, temperature=temperature, seed=i,
                    stop_at_eos=False))
            engine.run(progress=False)
        return work

    print("engine_greedy_16x32_tok_s", best_rate(served(32), 16 * 32))
    print("engine_sampled_16x2x32_tok_s", best_rate(served(32, n=2, temperature=0.8), 16 * 2 * 32))
    for mode in ("recompute", "swap"):
        print(f"engine_tight_{mode}_16x32_tok_s",
              best_rate(served(32, num_blocks=24, block_size=8, preemption=mode), 16 * 32))

    def speculative():
        engine = kvlab.Engine(model, model.new_paged_pool(256, 16), speculate=PromptLookup(),
                              draft_tokens=4)
        for i in range(16):
            engine.add_request(looping[i:i + 24], kvlab.SamplingParams(
                max_new_tokens=32, temperature=0.8, seed=i, stop_at_eos=False))
        engine.run(progress=False)
    print("engine_speculative_sampled_16x32_tok_s", best_rate(speculative, 16 * 32))


if __name__ == "__main__":
    main()
