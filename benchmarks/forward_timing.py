"""Timings of the C core's forward paths, for benchmarks/ab.py: prefill (one chunk, and a
long call in chunks), decode (the C loop and a call per token), a batched decode step
through a paged pool, and the one-layer uncached pass, on the bundled model and, where
../shared/models holds it (or $KVLAB_SHARED), stories260K. Issue 36 gave model.c one chunk
loop and a chunk view in place of a struct copied and patched; this is what may not slow.

    python benchmarks/ab.py run benchmarks/forward_timing.py before after --rounds 5

One thread, and CPU seconds rather than wall seconds: on a machine shared with other jobs
the wall clock mostly measures the neighbours (two runs a minute apart differed by 1.5x
here), while a single-threaded call's CPU time moves by a few per cent. Prints "name value"
lines, tokens per CPU second, higher is better.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import kvlab


def best_rate(work, amount: float, repeats: int = 5) -> float:
    """amount / CPU seconds of the fastest of `repeats` runs of work()."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return amount / best


def stories260k():
    """stories260K from the shared models, or None where they are not here."""
    base = Path(os.environ.get("KVLAB_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    folder = (base / "models" if (base / "models").is_dir() else base) / "stories260K"
    if not (folder / "stories260K.bin").is_file():
        return None
    return kvlab.load(folder / "stories260K.bin", tokenizer=folder / "tok512.bin")


def time_model(name: str, model: kvlab.Model) -> None:
    m = kvlab.Model(model.config.replace(max_seq_len=2048), model.weights, model.tokenizer)
    tokens = np.arange(1200, dtype=np.int32) % m.config.vocab_size

    def prefill(n):
        return lambda: m.prefill(tokens[:n], m.new_cache(n + 8))
    print(f"{name}_prefill_256_tok_s", best_rate(prefill(256), 256))
    print(f"{name}_prefill_1200_chunked_tok_s", best_rate(prefill(1200), 1200, 3))

    def decode_c_loop():
        cache = m.new_cache(300)
        m.prefill(tokens[:32], cache)
        m.decode_steps(1, cache, 200)
    print(f"{name}_decode_c_loop_tok_s", best_rate(decode_c_loop, 200))

    def decode_per_call():
        cache = m.new_cache(300)
        m.prefill(tokens[:32], cache)
        for i in range(100):
            m.decode(i % m.config.vocab_size, cache)
    print(f"{name}_decode_python_tok_s", best_rate(decode_per_call, 100))

    def batch_decode():
        pool = m.new_paged_pool(num_blocks=128, block_size=16)
        seqs = [pool.new_sequence() for _ in range(8)]
        m.forward_batch(seqs, [tokens[i * 30:(i + 1) * 30] for i in range(8)])
        for step in range(40):
            m.forward_batch(seqs, [tokens[step:step + 1]] * 8)
    print(f"{name}_batch8_decode_tok_s", best_rate(batch_decode, 8 * 40, 3))

    def one_layer():
        m.forward(tokens, uncached_kv="one_layer")
    print(f"{name}_uncached_one_layer_1200_tok_s", best_rate(one_layer, 1200, 3))


def main() -> None:
    kvlab.set_num_threads(1)
    time_model("bundled", kvlab.load())
    small = stories260k()
    if small is not None:
        time_model("stories260k", small)


if __name__ == "__main__":
    main()
