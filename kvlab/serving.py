"""Serving measured in the units users feel: the Engine under a Poisson load.

    report = kvlab.serving.serve(model, kvlab.serving.workload(model, 40, rate=8.0), budget=256)
    report["ttft_p99_ms"], report["tpot_p50_ms"], report["tokens_per_s"]

workload() makes requests that arrive as a Poisson process (exponential gaps, seeded): each
a prompt cut from the model's own text and a number of new tokens. serve() runs them
through one Engine in real time: before each step it adds every request whose arrival time
has passed, stamped with that time (Engine.add_request(arrival_time=)), so time spent
waiting for a busy engine counts in the request's latency, as it does for a user. It
returns throughput and the p50/p99 of time to first token (TTFT), time per output token
after it (TPOT) and end-to-end latency (RequestOutput.metrics), on a paged pool or on
contiguous caches of the same bytes. `kvlab serve-bench` and benchmarks/bench_serve.py print
them for several rates, token budgets and memories, and plot() draws them.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import numpy as np

from ._core import core
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


MEMORIES = ("paged", "contiguous")


def check_memory(memory: str, model=None) -> None:
    """Refuse a memory name serve() does not know, or a context too long to emulate."""
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {', '.join(MEMORIES)}, got {memory!r}")
    if memory == "contiguous" and model is not None and \
            model.config.max_seq_len > core.MAX_BLOCK_SIZE:
        raise ValueError(f"memory='contiguous' holds each request's whole context as one "
                         f"block, and blocks hold at most {core.MAX_BLOCK_SIZE} positions: "
                         f"this model's context is {model.config.max_seq_len}")


def serve(model, requests: list, budget: int = 256, num_blocks: int = 512,
          block_size: int = 16, memory: str = "paged") -> dict:
    """Run `requests` (workload()'s) through one Engine in real time; its throughput and
    the percentiles of its requests' latencies, in milliseconds.

    memory="paged" gives the engine num_blocks blocks of block_size positions;
    "contiguous" gives it the same bytes as blocks of a whole context
    (config.max_seq_len positions), one per request, reserved whole from its admission to
    its end, as contiguous caches are (Orca batched continuously this way)."""
    check_memory(memory, model)
    if memory == "contiguous":
        context = model.config.max_seq_len
        if num_blocks * block_size < context:
            raise ValueError(f"{num_blocks} blocks of {block_size} hold less than one context "
                             f"of {context} positions: no contiguous cache fits")
        num_blocks, block_size = num_blocks * block_size // context, context
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

    return {"memory": memory, "budget": budget, "requests": len(metrics), "seconds": seconds,
            "tokens_per_s": sum(m.output_tokens for m in metrics) / seconds,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
            "steps": len(engine.metrics)}


TABLE_HEAD = (f"{'rate/s':>7}{'memory':>11}{'budget':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}"
              f"{'TPOT p50':>10}{'p99':>8}{'e2e p50':>10}{'p99':>9}   (ms)")


def table_row(rate: float, row: dict) -> str:
    return (f"{rate:>7g}{row['memory']:>11}{row['budget']:>8}{row['tokens_per_s']:>9.0f}"
            f"{row['ttft_p50_ms']:>10.1f}"
            f"{row['ttft_p99_ms']:>9.1f}{row['tpot_p50_ms']:>10.2f}{row['tpot_p99_ms']:>8.2f}"
            f"{row['e2e_p50_ms']:>10.1f}{row['e2e_p99_ms']:>9.1f}")


def sweep(model, rates, budgets, n_requests: int = 40, seed: int = 0, out=print,
          memories=("paged",)) -> list:
    """serve() at every rate, budget and memory (the same requests at one rate for all of
    them), each row printed as it comes; the rows."""
    for memory in memories:               # before the warm-up, not after it
        check_memory(memory, model)
    serve(model, workload(model, 4, 100.0, seed), budgets[0])          # warm up
    out(TABLE_HEAD)
    rows = []
    for rate in rates:
        requests = workload(model, n_requests, rate, seed)
        for memory in memories:
            for budget in budgets:
                row = {"rate": rate, **serve(model, requests, budget, memory=memory)}
                rows.append(row)
                out(table_row(rate, row))
    return rows


def plot(rows: list, path, title: str = "") -> None:
    """Against the request rate (log): throughput, left; the time to first token, middle;
    the time per output token, right; p50 solid and p99 dashed, one color per memory and
    budget. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    series = sorted({(r["memory"], r["budget"]) for r in rows})
    for i, (memory, budget) in enumerate(series):
        mine = sorted((r for r in rows if (r["memory"], r["budget"]) == (memory, budget)),
                      key=lambda r: r["rate"])
        color, rates = f"C{i}", [r["rate"] for r in mine]
        axes[0].plot(rates, [r["tokens_per_s"] for r in mine], "o-", color=color, ms=3,
                     label=f"{memory}, max_batch_tokens={budget}")
        for ax, metric in zip(axes[1:], ("ttft", "tpot")):
            ax.plot(rates, [r[f"{metric}_p50_ms"] for r in mine], "o-", color=color, ms=3)
            ax.plot(rates, [r[f"{metric}_p99_ms"] for r in mine], "s--", color=color, ms=3)
    axes[0].set_ylabel("generated tokens per second")
    axes[1].set_ylabel("time to first token, ms (log)")
    axes[2].set_ylabel("time per output token, ms (log)")
    all_rates = sorted({r["rate"] for r in rows})
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(all_rates, [f"{rate:g}" for rate in all_rates])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("requests arriving per second (log)")
        ax.grid(alpha=0.3, which="both")
    for ax in axes[1:]:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_one_two_five))
        ax.yaxis.set_minor_formatter(FuncFormatter(_one_two_five))
        ax.set_title("solid: p50, dashed: p99", fontsize=9)
    axes[0].set_title(title or "Poisson arrivals", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _one_two_five(value: float, _position) -> str:
    """A log axis's tick label at 1, 2 and 5 times a power of ten, none elsewhere."""
    if value <= 0:
        return ""
    power = 10.0 ** np.floor(np.log10(value))
    return f"{value:g}" if round(value / power) in (1, 2, 5) else ""
