"""Timings of the matrix products where they are the work, for benchmarks/ab.py (issue 37):
batched decode of the course's real model and 256-token prefill on weight-bound shapes.

    python benchmarks/ab.py run benchmarks/products_timing.py before after --rounds 3
    python benchmarks/products_timing.py [batch|prefill]      # one part alone

* batch: SmolLM2-135M (its Q4_1 file loaded as Q8_0; kvlab.fetch("smollm2-135m"), skipped
  where it cannot be had), `forward_batch` decode steps through a paged pool at batch 1, 2,
  4, 8 and 16 (int8 products stream four rows below 8 tokens; with AVX-512 VNNI they pack
  panels from 13), each sequence after a 16-token prompt, three ways: Q8_0 weights with
  int8 activations (the default), Q8_0 weights with float32 activations, float32 weights.
* prefill: a 256-token prompt into a fresh cache on llama2.c's stories15M and stories110M
  shapes (random weights, seed 0), float32 weights, Q8_0 with int8 activations, Q8_0 with
  float32 activations.

One thread, CPU seconds (time.process_time): on a machine shared with other jobs the wall
clock mostly measures the neighbours. Prints "name value" lines, tokens per CPU second,
higher is better. Standalone (ab.py runs it against old builds): imports nothing of its own.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import kvlab

STEPS = 16
BATCHES = (1, 2, 4, 8, 16)
SHAPES = {   # llama2.c's checkpoint shapes (vocabulary 32,000)
    "15M": dict(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6),
    "110M": dict(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12),
}


def best_cpu_rate(work, amount: float, repeats: int) -> float:
    """amount / CPU seconds of the fastest of `repeats` runs of work() (which returns the
    CPU seconds of its timed part)."""
    return amount / min(work() for _ in range(repeats))


def batch_decode_seconds(model, batch: int) -> float:
    """CPU seconds of STEPS forward_batch decode steps of `batch` sequences (prompts untimed)."""
    pool = model.new_paged_pool(num_blocks=batch * 3 + 4, block_size=16)
    seqs = [pool.new_sequence() for _ in range(batch)]
    prompt = (1000 + np.arange(16 * batch, dtype=np.int32) * 37) % model.config.vocab_size
    model.forward_batch(seqs, [prompt[16 * i:16 * (i + 1)] for i in range(batch)])
    start = time.process_time()
    for step in range(STEPS):
        model.forward_batch(seqs, [prompt[i + step:i + step + 1] for i in range(batch)])
    seconds = time.process_time() - start
    for seq in seqs:
        pool.free(seq)
    return seconds


def smollm2_variants() -> dict:
    try:
        path = kvlab.fetch("smollm2-135m")
    except kvlab.FetchError as error:
        print(f"skipped: {error}")
        return {}
    q8 = kvlab.load(path, weights="q8_0")
    return {"q8_0_int8": q8,
            "q8_0_fp32act": kvlab.Model(q8.config, q8.weights, activations="fp32"),
            "fp32": kvlab.load(path, weights="fp32")}


def time_batches() -> None:
    for name, model in smollm2_variants().items():
        batch_decode_seconds(model, 1)                     # touch the weights' pages
        for batch in BATCHES:
            rate = best_cpu_rate(lambda: batch_decode_seconds(model, batch), batch * STEPS, 3)
            print(f"smollm2_{name}_batch{batch}_decode_cpu_tok_s", rate)


def time_prefill() -> None:
    tokens = (np.arange(256, dtype=np.int32) * 7919 + 1) % 32000
    for shape, dims in SHAPES.items():
        config = kvlab.ModelConfig(vocab_size=32000, max_seq_len=512,
                                   name=f"random stories{shape} shape", **dims)
        weights = kvlab.Weights.random(config, seed=0)
        q8 = weights.converted("q8_0")
        models = {"f32": kvlab.Model(config, weights),
                  "q8_0_int8": kvlab.Model(config, q8, activations="int8"),
                  "q8_0_fp32act": kvlab.Model(config, q8, activations="fp32")}
        for name, model in models.items():
            def prefill(model=model) -> float:
                cache = model.new_cache(256)
                start = time.process_time()
                model.prefill(tokens, cache)
                return time.process_time() - start
            prefill()
            print(f"prefill_256_{shape}_{name}_cpu_tok_s", best_cpu_rate(prefill, 256, 3))


def main() -> None:
    kvlab.set_num_threads(1)
    parts = sys.argv[1:] or ["batch", "prefill"]
    if "batch" in parts:
        time_batches()
    if "prefill" in parts:
        time_prefill()


if __name__ == "__main__":
    main()
