"""Paged vs contiguous KV cache: decode attention time, and memory wasted.

1. Decode time over a cache filled to a given context, contiguous vs paged, for block
   sizes 8, 16, 32 and 128, measured side by side in one run. The model is built so that
   attention is nearly all of a decode step: one layer, dim 16, but 8 query heads and 2
   KV heads of head_dim 64 (the shape of one GQA layer of a real model), so each step
   reads the whole cache and almost no weights. The caches are filled with random K/V
   rows through cache.append / pool.append (prefilling 32K tokens would take minutes).
   The ratio paged/contiguous is what to read; absolute times are noisy here.
2. Memory: a realistic mix of request lengths served by contiguous caches (each reserves
   max_seq_len) and by one paged pool (blocks as needed): bytes allocated vs bytes holding
   tokens, measured from the real objects.

    python benchmarks/bench_paged.py [--contexts 128,1024,8192,32768] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import kvlab

BLOCK_SIZES = (8, 16, 32, 128)


def attention_model(max_seq_len: int) -> kvlab.Model:
    config = kvlab.ModelConfig(dim=16, hidden_dim=16, n_layers=1, n_heads=8, n_kv_heads=2,
                               head_dim=64, vocab_size=16, max_seq_len=max_seq_len)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=0))


def random_rows(config, n, rng):
    shape = (n, config.n_layers, config.n_kv_heads, config.head_dim)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def bench_decode(context: int, repeats: int, steps: int, rng) -> dict:
    model = attention_model(context + steps + 1)
    c = model.config
    keys, values = random_rows(c, context, rng)
    cache = model.new_cache(context + steps)
    cache.append(keys, values)

    def contiguous():
        for _ in range(steps):
            model.decode(1, cache)
        cache.truncate(context)

    variants = {"contiguous": contiguous}
    pools = []                      # keep every pool alive while it is being timed
    for block_size in BLOCK_SIZES:
        blocks = -(-(context + steps) // block_size) + 2
        # random rows under placeholder tokens: the prefix cache must not share them
        pool = model.new_paged_pool(blocks, block_size, max_blocks_per_seq=blocks,
                                    prefix_cache=False)
        base = pool.new_sequence()
        pool.append(base, np.zeros(context, dtype=np.int32), keys, values)
        pools.append(pool)

        def paged(pool=pool, base=base):
            # a fork shares every block, so decoding on it leaves `base` untouched
            child = pool.fork(base)
            for _ in range(steps):
                model.decode(1, child)
            pool.free(child)

        variants[f"paged_{block_size}"] = paged

    # Rounds alternate between the variants, so a slow spell of the machine hits all of
    # them alike; each keeps its best round (and every round's time, in "round_seconds").
    taken = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            taken[name].append((time.perf_counter() - start) / steps)
    best = {name: min(seconds) for name, seconds in taken.items()}
    result = {"context": context, "contiguous_s": best["contiguous"], "round_seconds": taken}
    for block_size in BLOCK_SIZES:
        result[f"paged_{block_size}_s"] = best[f"paged_{block_size}"]
        result[f"paged_{block_size}_ratio"] = best[f"paged_{block_size}"] / best["contiguous"]
    kv_bytes = 2 * c.n_layers * c.kv_dim * 4 * context
    result["kv_bytes_read"] = kv_bytes
    result["contiguous_GBps"] = kv_bytes / result["contiguous_s"] / 1e9
    return result


def bench_memory(n_requests: int, max_seq_len: int, block_size: int, rng) -> dict:
    """Request lengths from a long-tailed distribution, as in chat traffic."""
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=0.9, size=n_requests), 16, max_seq_len)
    lengths = lengths.astype(int)
    config = kvlab.ModelConfig(dim=16, hidden_dim=16, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=32, vocab_size=16, max_seq_len=max_seq_len)
    model = kvlab.Model(config, kvlab.Weights.random(config))
    per_token = 2 * config.n_layers * config.kv_dim * 4
    caches = [model.new_cache(max_seq_len) for _ in lengths]
    for cache, n in zip(caches, lengths):
        cache.append(*random_rows(config, int(n), rng))
    contiguous_bytes = sum(cache.nbytes for cache in caches)
    blocks_needed = sum(-(-int(n) // block_size) for n in lengths)
    pool = model.new_paged_pool(blocks_needed, block_size, prefix_cache=False)
    for n in lengths:
        pool.append(pool.new_sequence(), np.zeros(int(n), dtype=np.int32),
                    *random_rows(config, int(n), rng))
    stats = pool.stats()
    paged_bytes = stats.blocks_used * block_size * per_token
    used_bytes = int(lengths.sum()) * per_token
    return {"requests": n_requests, "max_seq_len": max_seq_len, "block_size": block_size,
            "mean_length": float(lengths.mean()), "token_bytes": used_bytes,
            "contiguous_bytes": contiguous_bytes, "paged_bytes": paged_bytes,
            "contiguous_waste_percent": 100 * (1 - used_bytes / contiguous_bytes),
            "paged_waste_percent": stats.fragmentation_percent,
            "contiguous_over_paged": contiguous_bytes / paged_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,512,2048,8192,32768")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default="benchmarks/results/paged.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    print(f"decode step over a filled cache (1 layer, 8 heads / 2 KV heads x 64), "
          f"{kvlab.get_num_threads()} threads; paged time as a ratio of contiguous")
    print(f"{'context':>8}{'contiguous':>13}{'GB/s':>7}" +
          "".join(f"{'bs ' + str(b):>9}" for b in BLOCK_SIZES))
    decode = []
    for context in (int(x) for x in args.contexts.split(",")):
        r = bench_decode(context, args.repeats, args.steps, rng)
        decode.append(r)
        print(f"{context:>8}{r['contiguous_s'] * 1e6:>11.1f}us{r['contiguous_GBps']:>7.1f}" +
              "".join(f"{r[f'paged_{b}_ratio']:>9.3f}" for b in BLOCK_SIZES))

    memory = bench_memory(n_requests=64, max_seq_len=2048, block_size=16, rng=rng)
    print(f"\nmemory for {memory['requests']} requests (mean length "
          f"{memory['mean_length']:.0f} tokens, max_seq_len {memory['max_seq_len']}):")
    print(f"  contiguous caches: {memory['contiguous_bytes']:>12,} B, "
          f"{memory['contiguous_waste_percent']:.1f} % holding nothing")
    print(f"  paged pool (16):   {memory['paged_bytes']:>12,} B, "
          f"{memory['paged_waste_percent']:.1f} % holding nothing "
          f"({memory['contiguous_over_paged']:.1f}x less memory)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"decode": decode, "memory": memory}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
