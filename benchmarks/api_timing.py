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

Nor does it see decode of a real model's shape read from a GGUF file (issue 37 asked whether
SmolLM2 decode had slowed: the loader, grouped-query attention and the Q4_1 and Q8_0
products are all on that path), so it also writes SmolLM2-135M's shape (30 layers, 9 query
and 3 KV heads, vocabulary 49,152, tied Q8_0 embedding, Q4_1 layers, as the file kvlab
fetches) with random blocks to a temporary GGUF file, loads it and times the load and
single-sequence decode on one thread by CPU seconds; `python api_timing.py decode` prints
those alone.
"""
from __future__ import annotations

import inspect
import os
import sys
import tempfile
import time

import numpy as np

import kvlab
from kvlab import weight_formats
from kvlab.loaders import save_gguf
from kvlab.weights import MATRICES


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


# SmolLM2-135M's shape and formats (kvlab.registry's file: Q4_1 layers, Q8_0 tied embedding)
SMOLLM2_SHAPE = dict(dim=576, hidden_dim=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                     vocab_size=49152, max_seq_len=512, tied_embeddings=True,
                     rope_interleaved=True)


def random_blocks(shape: tuple, fmt: str, rng: np.random.Generator) -> np.ndarray:
    """A matrix in a block format of random codes with small scales (values within about
    +-0.08, as Weights.random's): made from bytes, far cheaper than quantizing floats."""
    array = weight_formats.empty(shape, fmt)
    codes = weight_formats.as_bytes(array)
    codes[...] = rng.integers(0, 256, size=codes.shape, dtype=np.uint8)
    if fmt == "q8_0":
        array["d"] = 0.08 / 128
    else:                                       # q4_1: d * (0 .. 15) + m
        array["d"], array["m"] = 0.01, -0.08
    return array


def smollm2_shaped_gguf(path: str) -> None:
    config = kvlab.ModelConfig(name="random SmolLM2-135M shape", **SMOLLM2_SHAPE)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in kvlab.Weights.expected_shapes(config).items():
        if name in MATRICES:
            arrays[name] = random_blocks(shape, "q8_0" if name == "token_embedding" else "q4_1",
                                         rng)
        else:
            arrays[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    arrays["classifier"] = arrays["token_embedding"]
    save_gguf(path, config, kvlab.Weights(**arrays))


def smollm2_shaped_decode() -> None:
    """Load a SmolLM2-shaped GGUF file (loads per CPU second) and decode 24 tokens after a
    32-token prompt (tokens per CPU second), one thread, best of 3. A few seconds."""
    kvlab.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "smollm2-shape.gguf")
        smollm2_shaped_gguf(path)
        seconds = []
        for _ in range(3):
            start = time.process_time()
            model = kvlab.load(path)
            seconds.append(time.process_time() - start)
        print("load_smollm2_shape_gguf_per_cpu_s", 1 / min(seconds))
    prompt = (np.arange(32, dtype=np.int32) * 7919 + 1) % model.config.vocab_size
    steps, best = 24, float("inf")
    for attempt in range(4):                   # the first touches the weights' pages
        cache = model.new_cache(len(prompt) + steps)
        model.prefill(prompt, cache)
        token, start = 5, time.process_time()
        for _ in range(steps):
            token = int(np.argmax(model.decode(token, cache)))
        if attempt:
            best = min(best, time.process_time() - start)
    print("decode_smollm2_shape_gguf_1_thread_cpu_tok_s", steps / best)


def main() -> None:
    if sys.argv[1:] == ["prefill"]:
        weight_bound_prefill()
        return
    if sys.argv[1:] == ["decode"]:
        smollm2_shaped_decode()
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
    smollm2_shaped_decode()


if __name__ == "__main__":
    main()
