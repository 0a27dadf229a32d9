"""Preemption by swapping against preemption by recompute: bytes moved against tokens run.

1. One sequence of N tokens, for several N: the time to swap it out to host memory and
   back in (PagedPool.swap_out + swap_in: its K and V copied twice, its blocks freed and
   taken again) against the time to recompute it (free it, then prefill its N tokens into
   fresh blocks), on the bundled model with its context raised to fit the largest N. The
   two are timed in turn, round after round, so a slow spell of the machine hits both; each
   reports the median of its rounds. Pools without a prefix cache, so that neither finds
   the other's blocks. Swapping moves 2 x n_layers x kv_dim x N values in the pool's
   format; recompute runs the whole model over N tokens (attention growing with N), so the
   ratio recompute / swap grows with N and with the model's size per KV byte.
2. The Engine on a small workload with a pool too small for it (preemptions), once with
   preemption="recompute" and once with "swap", in turn: total time, preemptions, tokens
   recomputed, blocks and bytes swapped. The generated tokens must be the same (checked).

    python benchmarks/bench_swap.py [--contexts 64,256,1024] [--dtypes fp32,int8]
                                    [--repeats 15] [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab.serving import SAMPLE_TEXT

BLOCK_SIZE = 16


def long_context(model: kvlab.Model, context: int) -> kvlab.Model:
    """The same weights with a context of at least `context` positions (RoPE's angles are
    computed per position: nothing else depends on max_seq_len)."""
    if context <= model.config.max_seq_len:
        return model
    return kvlab.Model(model.config.replace(max_seq_len=context), model.weights,
                       model.tokenizer)


def bench_one_sequence(model: kvlab.Model, n: int, dtype: str, repeats: int) -> dict:
    tokens = (model.encode(SAMPLE_TEXT) * (n // 8 + 1))[:n]
    blocks = -(-n // BLOCK_SIZE)
    pool = model.new_paged_pool(2 * blocks + 2, BLOCK_SIZE, dtype=dtype, max_seqs=4,
                                prefix_cache=False)
    seq = pool.new_sequence()
    model.prefill(tokens, seq)
    times = {"swap_out": [], "swap_in": [], "swap": [], "recompute": []}
    nbytes = 0
    for _ in range(repeats):
        start = time.perf_counter()
        host = pool.swap_out(seq)
        middle = time.perf_counter()
        seq = pool.swap_in(host)
        end = time.perf_counter()
        times["swap_out"].append(middle - start)
        times["swap_in"].append(end - middle)
        times["swap"].append(end - start)
        nbytes = host.nbytes
        del host
        start = time.perf_counter()
        pool.free(seq)
        seq = pool.new_sequence()
        model.prefill(tokens, seq)
        times["recompute"].append(time.perf_counter() - start)
    # the claim behind the comparison: both give a sequence that goes on the same way
    swapped = pool.swap_in(pool.swap_out(seq))
    recomputed = pool.new_sequence()
    model.prefill(tokens, recomputed)
    assert np.array_equal(model.decode(1, swapped), model.decode(1, recomputed))
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = [r / s for r, s in zip(times["recompute"], times["swap"])]   # each round's
    return {"tokens": n, "dtype": dtype, "blocks": blocks, "bytes_moved": nbytes,
            "swap_out_s": median["swap_out"], "swap_in_s": median["swap_in"],
            "swap_s": median["swap"], "recompute_s": median["recompute"],
            "recompute_over_swap": median["recompute"] / median["swap"],
            "recompute_over_swap_range": [min(ratios), max(ratios)], "rounds": repeats,
            "swap_GBps": 2 * nbytes / median["swap"] / 1e9}


def engine_workload(model: kvlab.Model, n_requests: int, seed: int = 0) -> list:
    """Prompts of 48 to 160 tokens cut from the model's own text, 24 to 64 new tokens each,
    greedy."""
    rng = np.random.default_rng(seed)
    text = model.encode(SAMPLE_TEXT * 12)
    requests = []
    for _ in range(n_requests):
        length = int(rng.integers(48, 161))
        start = int(rng.integers(0, len(text) - length))
        requests.append((text[start:start + length],
                         kvlab.SamplingParams(max_new_tokens=int(rng.integers(24, 65)),
                                              stop_at_eos=False)))
    return requests


def serve(model: kvlab.Model, requests: list, num_blocks: int, preemption: str) -> dict:
    pool = model.new_paged_pool(num_blocks, BLOCK_SIZE)
    engine = kvlab.Engine(model, pool, max_batch_tokens=256, preemption=preemption)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    outputs = engine.run(progress=False)
    seconds = time.perf_counter() - start
    m = engine.metrics
    return {"preemption": preemption, "seconds": seconds, "steps": len(m),
            "preemptions": sum(s.preemptions for s in m),
            "prefill_tokens": sum(s.prefill_tokens for s in m),
            "recomputed_tokens": sum(s.recomputed_tokens for s in m),
            "swapped_out_blocks": sum(s.swapped_out_blocks for s in m),
            "swapped_out_bytes": sum(s.swapped_out_bytes for s in m),
            "swapped_in_bytes": sum(s.swapped_in_bytes for s in m),
            "tokens": {rid: out.outputs[0].tokens for rid, out in outputs.items()}}


def bench_engine(model: kvlab.Model, n_requests: int, repeats: int) -> dict:
    requests = engine_workload(model, n_requests)
    # room for the largest request alone and a bit more: most cannot run together
    largest = max(-(-(len(p) + sp.max_new_tokens) // BLOCK_SIZE) for p, sp in requests)
    num_blocks = largest + largest // 2
    runs = {"recompute": [], "swap": []}
    for _ in range(repeats):                       # in turn, as the sequence timings
        for preemption in runs:
            runs[preemption].append(serve(model, requests, num_blocks, preemption))
    rows = []
    for preemption, results in runs.items():
        row = dict(results[0])
        row["seconds"] = statistics.median(r["seconds"] for r in results)
        row["seconds_range"] = [min(r["seconds"] for r in results),
                                max(r["seconds"] for r in results)]
        rows.append(row)
    assert rows[0].pop("tokens") == rows[1].pop("tokens"), "the modes generated different tokens"
    return {"requests": n_requests, "num_blocks": num_blocks, "block_size": BLOCK_SIZE,
            "generated_tokens": sum(sp.max_new_tokens for _, sp in requests), "runs": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="64,256,1024", help="sequence lengths N")
    parser.add_argument("--dtypes", default="fp32,int8", help="cache formats of the pool")
    parser.add_argument("--repeats", type=int, default=15, help="rounds per measurement")
    parser.add_argument("--requests", type=int, default=16, help="engine workload size")
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds, fp32 only, 8 requests (well under a minute)")
    parser.add_argument("--json", default="benchmarks/results/swap.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.dtypes, args.requests = 5, "fp32", 8
    contexts = [int(n) for n in args.contexts.split(",")]
    base = kvlab.load()
    model = long_context(base, max(contexts) + 1)

    c = model.config
    print(f"swap out + in vs recompute of one sequence: bundled model ({c.n_layers} layers, "
          f"{c.n_kv_heads} KV heads x {c.head_dim}), blocks of {BLOCK_SIZE}, "
          f"{kvlab.get_num_threads()} threads, median of {args.repeats} rounds")
    print(f"{'tokens':>7}{'dtype':>6}{'bytes moved':>13}{'swap out':>10}{'swap in':>10}"
          f"{'swap':>10}{'GB/s':>7}{'recompute':>11}{'recompute/swap':>16}")
    sequences = []
    for dtype in args.dtypes.split(","):
        for n in contexts:
            r = bench_one_sequence(model, n, dtype, args.repeats)
            sequences.append(r)
            print(f"{n:>7}{dtype:>6}{r['bytes_moved']:>13,}{r['swap_out_s'] * 1e6:>8.0f}us"
                  f"{r['swap_in_s'] * 1e6:>8.0f}us{r['swap_s'] * 1e6:>8.0f}us"
                  f"{r['swap_GBps']:>7.2f}{r['recompute_s'] * 1e3:>9.2f}ms"
                  f"{r['recompute_over_swap']:>15.0f}x")

    engine = bench_engine(base, args.requests, 1 if args.quick else 3)
    print(f"\nEngine: {engine['requests']} requests (prompts 48-160 tokens, "
          f"{engine['generated_tokens']} tokens generated, greedy) on {engine['num_blocks']} "
          f"blocks of {BLOCK_SIZE}; same tokens in both modes")
    print(f"{'preemption':>11}{'seconds':>9}{'steps':>7}{'preempted':>11}{'prefill tok':>13}"
          f"{'recomputed':>12}{'swapped blk':>13}{'swapped bytes':>15}")
    for r in engine["runs"]:
        print(f"{r['preemption']:>11}{r['seconds']:>9.2f}{r['steps']:>7}{r['preemptions']:>11}"
              f"{r['prefill_tokens']:>13}{r['recomputed_tokens']:>12}"
              f"{r['swapped_out_blocks']:>13}{r['swapped_out_bytes']:>15,}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": "bundled", "threads": kvlab.get_num_threads(),
                                           "repeats": args.repeats, "sequences": sequences,
                                           "engine": engine}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
