"""Continuous batching: throughput against batch size, and requests served in one memory budget.

1. Throughput: B requests of the same shape (a 16-token prompt, 64 new tokens, greedy)
   run together by kvlab.Engine, for B = 1 .. 64, on the bundled model and on random
   weights shaped like stories15M (dim 288, 6 layers, 6 heads, vocab 32000: about 15 M
   parameters). A decode step reads every weight once for the whole batch, so tokens/s
   grows with B until the arithmetic (not the weight reads) is the limit.
2. One KV memory budget (the bytes of 16 contiguous caches of 512 positions), 96 requests
   of long-tailed lengths, on both models:
     - static batching with contiguous caches: 16 requests at a time, each reserving 512
       positions, the next 16 starting when the slowest of the batch is done;
     - the paged engine: the same bytes as a pool of 16-token blocks, requests admitted
       whenever blocks are free (continuous batching), preempted when they run out.
   Reported: requests running at once (peak and mean), tokens/s, and total time.

    python benchmarks/bench_engine.py [--sizes 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import kvlab

REPO = Path(__file__).resolve().parents[1]


def stories15m_shape() -> kvlab.Model:
    config = kvlab.ModelConfig(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6,
                               vocab_size=32000, max_seq_len=512, name="random stories15M shape")
    return kvlab.Model(config, kvlab.Weights.random(config, seed=0))


def throughput(model: kvlab.Model, batch: int, new_tokens: int = 64, prompt_len: int = 16) -> dict:
    rng = np.random.default_rng(batch)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 4
    pool = model.new_paged_pool(num_blocks=blocks, block_size=16, max_seqs=max(batch, 1))
    engine = kvlab.Engine(model, pool, max_batch_tokens=max(256, batch * prompt_len))
    for _ in range(batch):
        prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
        engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
    start = time.perf_counter()
    engine.run(progress=False)
    seconds = time.perf_counter() - start
    generated = batch * new_tokens
    return {"model": model.config.name, "batch": batch, "seconds": seconds,
            "tokens_per_s": generated / seconds, "steps": len(engine.metrics)}


def workload(model: kvlab.Model, n_requests: int, max_len: int, seed: int = 0) -> list:
    """Long-tailed lengths: most requests are short, a few run long (up to max_len in all)."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n_requests):
        prompt = rng.integers(0, model.config.vocab_size, int(rng.integers(8, 64))).tolist()
        new = int(min(max_len - 64, max(4, rng.lognormal(np.log(max_len / 8), 0.9))))
        requests.append((prompt, kvlab.SamplingParams(max_new_tokens=new, stop_at_eos=False)))
    return requests


def serve(model, pool, requests, static_batch: int = 0) -> dict:
    """All requests to the end; with static_batch, only that many at a time, each group
    running until its last request is done."""
    groups = [requests[i:i + static_batch] for i in range(0, len(requests), static_batch)] \
        if static_batch else [requests]
    running, generated = [], 0
    start = time.perf_counter()
    for group in groups:
        engine = kvlab.Engine(model, pool, max_batch_tokens=512)
        for prompt, params in group:
            engine.add_request(prompt, params)
        while engine.has_work:
            step = engine.step()
            running.append(step.batch_size)
            generated += sum(len(t) for t in step.new_tokens.values())
    seconds = time.perf_counter() - start
    preemptions = 0 if static_batch else sum(m.preemptions for m in engine.metrics)
    return {"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds,
            "peak_running": max(running), "mean_running": float(np.mean(running)),
            "steps": len(running), "preemptions": preemptions}


def memory_budget(model: kvlab.Model, n_requests: int, n_static: int = 16) -> dict:
    max_len = model.config.max_seq_len
    budget = kvlab.kv_cache_bytes(model.config, max_len, n_static, dtype="fp32")
    requests = workload(model, n_requests, max_len)
    # static: the same memory as n_static contiguous caches of max_len positions, served
    # n_static requests at a time, each batch waiting for its slowest request (blocks of
    # 256 positions are handed out as a request grows, but the batch cap keeps it static)
    assert max_len % 256 == 0
    static_pool = model.new_paged_pool(num_blocks=max_len // 256 * n_static, block_size=256)
    assert static_pool.nbytes == budget
    static = serve(model, static_pool, requests, static_batch=n_static)
    paged_pool = model.new_paged_pool(num_blocks=budget // (16 * model.config.n_layers * 2 *
                                                            model.config.kv_dim * 4),
                                      block_size=16)
    assert paged_pool.nbytes == budget
    paged = serve(model, paged_pool, requests)
    return {"model": model.config.name, "max_len": max_len, "budget_bytes": budget,
            "requests": n_requests,
            "tokens": sum(p.max_new_tokens for _, p in requests), "static": static, "paged": paged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "engine.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    print(f"kvlab {kvlab.__version__}, {kvlab.get_num_threads()} threads\n")
    print("1. Throughput against batch size (16-token prompts, 64 new tokens each, greedy)")
    rows = []
    for model in (kvlab.load(), stories15m_shape()):
        base = None
        print(f"  {model.config.name} ({model.config.n_params() / 1e6:.1f} M parameters)")
        print(f"  {'batch':>7}{'tokens/s':>11}{'vs batch 1':>12}")
        for batch in sizes:
            row = throughput(model, batch)
            base = base or row["tokens_per_s"]
            row["speedup"] = row["tokens_per_s"] / base
            rows.append(row)
            print(f"  {batch:>7}{row['tokens_per_s']:>11,.0f}{row['speedup']:>11.2f}x")

    print(f"\n2. One KV memory budget, {args.requests} requests of long-tailed lengths")
    budgets = []
    for model in (kvlab.load(), stories15m_shape()):
        budget = memory_budget(model, args.requests)
        budgets.append(budget)
        print(f"  {budget['model']}: budget {budget['budget_bytes']:,} B = 16 contiguous caches "
              f"of {budget['max_len']} positions; {budget['tokens']:,} tokens to generate")
        print(f"  {'':<36}{'running (peak / mean)':>22}{'tokens/s':>10}{'seconds':>9}"
              f"{'preempted':>10}")
        for name, label in (("static", "static batches, contiguous caches"),
                            ("paged", "paged pool, continuous batching")):
            r = budget[name]
            print(f"  {label:<36}{r['peak_running']:>12} / {r['mean_running']:>6.1f}"
                  f"{r['tokens_per_s']:>11,.0f}{r['seconds']:>9.2f}{r['preemptions']:>10}")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": kvlab.get_num_threads(), "throughput": rows,
                               "memory_budget": budgets}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
