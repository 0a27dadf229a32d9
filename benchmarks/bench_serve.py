"""Serving measured in latency: the Engine under Poisson arrivals, at several request rates.

    python benchmarks/bench_serve.py [--rates 2,8,32] [--requests 40] [--budgets 64,256]
                                     [--json out.json]

Requests arrive as a Poisson process (exponential gaps, seeded) at each rate, each a prompt
of the bundled model's held-out text of random length and a random number of new tokens.
The load generator runs in real time: before each engine step it adds every request whose
arrival time has passed, stamped with that time (add_request(arrival_time=)), so time spent
waiting for a busy engine counts in the request's latency, as it does for a user. It
reports, per rate and per max_batch_tokens (chunked prefill's budget: a bigger budget
finishes prompts sooner, a smaller one keeps decode steps short):
  * throughput: generated tokens per second over the run;
  * TTFT (time to first token) and TPOT (time per output token after it), p50 and p99;
  * end-to-end latency p50 and p99.
Greedy decoding, fp32 cache, the bundled model (random prompts of its text).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvlab  # noqa: E402


def workload(model, n_requests: int, rate: float, seed: int) -> list:
    """(arrival second, prompt ids, new tokens) for each request, arrivals at `rate` a
    second on average."""
    rng = np.random.default_rng(seed)
    text = model.encode("ROMEO:\nBut soft, what light through yonder window breaks?\n"
                        "It is the east, and Juliet is the sun.\n" * 8)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(8, 96))
        start = int(rng.integers(0, len(text) - length))
        requests.append((float(arrival), text[start:start + length], int(rng.integers(16, 96))))
    return requests


def serve(model, requests: list, budget: int) -> dict:
    """Run the requests through one Engine in real time; their latencies and throughput."""
    engine = kvlab.Engine(model, num_blocks=512, block_size=16, max_batch_tokens=budget)
    start = time.perf_counter()
    pending = list(requests)
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, new_tokens = pending.pop(0)
            engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens),
                               arrival_time=start + arrival)
        if engine.has_work:
            engine.step()
        elif pending:                                   # idle until the next arrival
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    metrics = [out.metrics for out in engine.outputs.values()]
    ttft = np.array([m.ttft for m in metrics])
    tpot = np.array([m.tpot for m in metrics if m.tpot is not None])
    e2e = np.array([m.e2e for m in metrics])
    tokens = sum(m.output_tokens for m in metrics)
    return {"budget": budget, "requests": len(metrics), "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)),
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)),
            "e2e_p50_ms": 1e3 * float(np.percentile(e2e, 50)),
            "e2e_p99_ms": 1e3 * float(np.percentile(e2e, 99)),
            "steps": len(engine.metrics)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="2,8,32", help="requests a second, comma-separated")
    parser.add_argument("--requests", type=int, default=40, help="requests per run")
    parser.add_argument("--budgets", default="64,256", help="max_batch_tokens values")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = kvlab.load()
    rates = [float(r) for r in args.rates.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    serve(model, workload(model, 4, 100.0, args.seed), budgets[0])       # warm up
    rows = []
    print(f"{'rate/s':>7}{'budget':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}"
          f"{'p99':>8}{'e2e p50':>10}{'p99':>9}   (ms)")
    for rate in rates:
        requests = workload(model, args.requests, rate, args.seed)
        for budget in budgets:
            row = {"rate": rate, **serve(model, requests, budget)}
            rows.append(row)
            print(f"{rate:>7g}{budget:>8}{row['tokens_per_s']:>9.0f}{row['ttft_p50_ms']:>10.1f}"
                  f"{row['ttft_p99_ms']:>9.1f}{row['tpot_p50_ms']:>10.2f}{row['tpot_p99_ms']:>8.2f}"
                  f"{row['e2e_p50_ms']:>10.1f}{row['e2e_p99_ms']:>9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": "bundled", "threads": kvlab.get_num_threads(),
                                               "requests_per_run": args.requests, "runs": rows},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
