"""Serving measured in the units users feel: the Engine under a Poisson load.

    report = kvlab.serving.serve(model, kvlab.serving.workload(model, 40, rate=8.0), budget=256)
    report["ttft_p99_ms"], report["tpot_p50_ms"], report["tokens_per_s"]

workload() makes requests that arrive as a Poisson process (exponential gaps, seeded): each
a prompt cut from the model's own text and a number of new tokens. serve() runs them
through one Engine in real time: before each step it adds every request whose arrival time
has passed, stamped with that time (Engine.add_request(arrival_time=)), so time spent
waiting for a busy engine counts in the request's latency, as it does for a user. It
returns throughput and the p50/p99 of time to first token (TTFT), time per output token
after it (TPOT) and end-to-end latency (RequestOutput.metrics). `kvlab serve-bench` and
benchmarks/bench_serve.py print them for several rates and token budgets.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import numpy as np

from .engine import Engine
from .scheduler import SamplingParams

SAMPLE_TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
               "It is the east, and Juliet is the sun.\n")


def workload(model, n_requests: int, rate: float, seed: int = 0) -> List[Tuple[float, list, int]]:
    """(arrival second, prompt ids, new tokens) for each of n_requests, arriving `rate` a
    second on average: prompts of 8 to 95 tokens cut from a sample of the model's text, 16
    to 95 new tokens each."""
    if rate <= 0 or n_requests < 1:
        raise ValueError(f"need a positive rate and at least one request, got rate={rate}, "
                         f"n_requests={n_requests}")
    rng = np.random.default_rng(seed)
    text = model.encode(SAMPLE_TEXT * 8)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(8, 96))
        start = int(rng.integers(0, len(text) - length))
        requests.append((float(arrival), text[start:start + length], int(rng.integers(16, 96))))
    return requests


def serve(model, requests: list, budget: int = 256, num_blocks: int = 512,
          block_size: int = 16) -> dict:
    """Run `requests` (workload()'s) through one Engine in real time; its throughput and
    the percentiles of its requests' latencies, in milliseconds."""
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget)
    start = time.perf_counter()
    pending = sorted(requests, key=lambda r: r[0])
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, new_tokens = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens),
                               arrival_time=start + arrival)
        if engine.has_work:
            engine.step()
        elif pending:                                   # idle until the next arrival
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    metrics = [out.metrics for out in engine.outputs.values()]
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    e2e = [m.e2e for m in metrics]

    def ms(values, q):
        return 1e3 * float(np.percentile(values, q)) if values else float("nan")

    return {"budget": budget, "requests": len(metrics), "seconds": seconds,
            "tokens_per_s": sum(m.output_tokens for m in metrics) / seconds,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
            "steps": len(engine.metrics)}


TABLE_HEAD = (f"{'rate/s':>7}{'budget':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}"
              f"{'p99':>8}{'e2e p50':>10}{'p99':>9}   (ms)")


def table_row(rate: float, row: dict) -> str:
    return (f"{rate:>7g}{row['budget']:>8}{row['tokens_per_s']:>9.0f}{row['ttft_p50_ms']:>10.1f}"
            f"{row['ttft_p99_ms']:>9.1f}{row['tpot_p50_ms']:>10.2f}{row['tpot_p99_ms']:>8.2f}"
            f"{row['e2e_p50_ms']:>10.1f}{row['e2e_p99_ms']:>9.1f}")


def sweep(model, rates, budgets, n_requests: int = 40, seed: int = 0, out=print) -> list:
    """serve() at every rate and budget (the same requests at one rate for every budget),
    each row printed as it comes; the rows."""
    serve(model, workload(model, 4, 100.0, seed), budgets[0])          # warm up
    out(TABLE_HEAD)
    rows = []
    for rate in rates:
        requests = workload(model, n_requests, rate, seed)
        for budget in budgets:
            row = {"rate": rate, **serve(model, requests, budget)}
            rows.append(row)
            out(table_row(rate, row))
    return rows
