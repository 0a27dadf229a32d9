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

Every argument is checked before anything runs (kvlab.arguments: counts are integers, not
bools or floats; rates and seconds are finite numbers above zero), and so is every request
of a list given to serve(): its arrival a finite number of seconds from 0 to max_seconds,
its prompt token ids of the model, its new tokens a count that fits the model's context and
the pool. A run waits in real time for its last arrival, so serve() refuses one whose last
request arrives past max_seconds (600 by default) rather than wait for hours without a word,
and progress= hears of each wait of a second or more.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import arguments
from ._core import core
from .engine import Engine
from .errors import ContextLengthError
from .model import as_token_array
from .scheduler import SamplingParams, requests_fit
from .slo import SLO, StepCost, VirtualClock, goodput_report

SAMPLE_TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
               "It is the east, and Juliet is the sun.\n")


MAX_REQUESTS = 100_000      # requests in one workload: each is served in real time
MAX_SECONDS = 600.0         # the latest arrival serve() waits for unless told otherwise


def _checked_rate(n_requests, rate, seed) -> Tuple[int, float, int]:
    n_requests = arguments.positive(n_requests, "n_requests", MAX_REQUESTS)
    rate = arguments.real(rate, "rate", above=0.0)
    seed = arguments.integer(seed, "seed", 0)
    if not math.isfinite(1.0 / rate):
        raise ValueError(f"rate must be a number of requests a second whose mean gap "
                         f"1/rate is a finite number of seconds, got rate={rate}")
    return n_requests, rate, seed


def _arrivals(rng: np.random.Generator, n_requests: int, rate: float) -> np.ndarray:
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    if not np.isfinite(arrivals).all():
        raise ValueError(f"rate={rate} requests a second puts arrivals past the largest "
                         f"float: give a larger rate")
    return arrivals


def arrival_times(n_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """The arrival seconds of workload(model, n_requests, rate, seed)'s requests, without
    a model: how long a run of them waits, known before anything loads."""
    n_requests, rate, seed = _checked_rate(n_requests, rate, seed)
    return _arrivals(np.random.default_rng(seed), n_requests, rate)


def workload(model, n_requests: int, rate: float, seed: int = 0) -> List[Tuple[float, list, int]]:
    """(arrival second, prompt ids, new tokens) for each of n_requests (1 to MAX_REQUESTS),
    arriving `rate` a second on average (a finite number above 0): prompts of 8 to 95
    tokens cut from a sample of the model's text, 16 to 95 new tokens each. seed: an
    integer from 0."""
    n_requests, rate, seed = _checked_rate(n_requests, rate, seed)
    rng = np.random.default_rng(seed)
    text = model.encode(SAMPLE_TEXT * 8)
    arrivals = _arrivals(rng, n_requests, rate)
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(8, 96))
        start = int(rng.integers(0, len(text) - length))
        requests.append((float(arrival), text[start:start + length], int(rng.integers(16, 96))))
    return requests


MEMORIES = ("paged", "contiguous")


def check_memory(memory: str, model=None) -> None:
    """Refuse a memory name serve() does not know, or a context too long to emulate."""
    if not isinstance(memory, str) or memory not in MEMORIES:
        raise ValueError(f"memory must be one of {', '.join(MEMORIES)}, got {memory!r}")
    if memory == "contiguous" and model is not None and \
            model.config.max_seq_len > core.MAX_BLOCK_SIZE:
        raise ValueError(f"memory='contiguous' holds each request's whole context as one "
                         f"block, and blocks hold at most {core.MAX_BLOCK_SIZE} positions: "
                         f"this model's context is {model.config.max_seq_len}")


def _checked_requests(model, requests, max_seconds: float) -> List[Tuple[float, list, int]]:
    """`requests` as (arrival, prompt ids, new tokens) triples, each checked as the Engine
    would check it on arrival, so that a bad one is refused before the run, not after the
    requests before it have run: arrival a finite number of seconds from 0 to
    max_seconds, prompt token ids of the model (or a text to encode), new tokens a count."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise arguments.ArgumentTypeError(
            f"requests must be a list of (arrival seconds, prompt, new tokens) triples, "
            f"such as workload() gives, got {type(requests).__name__}")
    if not requests:
        raise ValueError("requests must hold at least one request, got none")
    if len(requests) > MAX_REQUESTS:
        raise ValueError(f"requests must hold at most {MAX_REQUESTS:,} requests, "
                         f"got {len(requests):,}")
    checked = []
    context = model.config.max_seq_len
    window = model.config.sliding_window
    for i, request in enumerate(requests):
        name = f"requests[{i}]"
        if isinstance(request, (str, bytes)) or not isinstance(request, Sequence) \
                or len(request) != 3:
            raise arguments.ArgumentTypeError(
                f"{name} must be an (arrival seconds, prompt, new tokens) triple, got "
                f"{arguments.shown(request)}")
        arrival, prompt, new_tokens = request
        arrival = arguments.real(arrival, f"{name}'s arrival time", low=0.0)
        if arrival > max_seconds:
            raise ValueError(
                f"{name} arrives at {arrival:,.1f} s, past max_seconds={max_seconds:g}: "
                f"serve() waits for every arrival in real time, so this run would take at "
                f"least {_duration(arrival)}. Pass a larger max_seconds to wait that long, "
                f"or arrivals closer together (a larger rate)")
        new_tokens = arguments.positive(new_tokens, f"{name}'s new tokens")
        try:
            if isinstance(prompt, str):
                ids = model.encode(prompt)
                if not ids:
                    raise ValueError("the prompt has no tokens")
            else:
                ids = as_token_array(prompt, model.config.vocab_size).tolist()
        except TypeError as error:
            raise arguments.ArgumentTypeError(f"{name}'s prompt: {error}") from None
        except ValueError as error:
            raise ValueError(f"{name}'s prompt: {error}") from None
        if len(ids) + new_tokens > context:
            raise ContextLengthError(f"{name}: prompt ({len(ids)} tokens) + new tokens "
                                     f"({new_tokens}) exceeds the model's context of "
                                     f"{context} tokens")
        if window is not None and len(ids) + new_tokens - 1 > window:
            raise ContextLengthError(f"{name}: prompt ({len(ids)} tokens) + new tokens "
                                     f"({new_tokens}) pass the model's sliding window of "
                                     f"{window} positions, which the Engine does not roll")
        checked.append((arrival, ids, new_tokens))
    return checked


def _duration(seconds: float) -> str:
    """12 s, 3.5 minutes, 11.6 hours, 2.3 days"""
    for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.0f} s"


def _checked_progress(progress):
    if progress is not None and not callable(progress):
        raise arguments.ArgumentTypeError(f"progress must be a function taking a line of "
                                          f"text, or None, got {type(progress).__name__}")
    return progress


CLOCKS = ("wall", "virtual")


def serve(model, requests: list, budget: int = 256, num_blocks: int = 512,
          block_size: int = 16, memory: str = "paged", *, max_seconds: float = MAX_SECONDS,
          progress: Optional[Callable[[str], None]] = None, clock: str = "wall",
          slo: Optional[SLO] = None, cost: Optional[StepCost] = None,
          engine_options: Optional[dict] = None, outputs: bool = False,
          meter: Optional[Callable[[], float]] = None) -> dict:
    """Run `requests` (workload()'s) through one Engine; its throughput and the percentiles
    of its requests' latencies, in milliseconds, and with an SLO (kvlab.slo.SLO) its goodput
    (requests a second served within both targets: kvlab.slo.goodput_report's fields).

    clock="wall" runs in real time; clock="virtual" runs on a kvlab.slo.VirtualClock priced
    by `cost` (default StepCost.for_model(model)): arrivals come on the virtual clock, an
    idle engine skips to the next one without sleeping, and every step moves the clock by
    what it computed, so the report is the same, bit for bit, on every machine and run.

    memory="paged" gives the engine num_blocks blocks of block_size positions;
    "contiguous" gives it the same bytes as blocks of a whole context
    (config.max_seq_len positions), one per request, reserved whole from its admission to
    its end, as contiguous caches are (Orca batched continuously this way).
    engine_options: more keyword arguments for kvlab.Engine (preemption=, speculate=, the
    plug-ins: see Engine). outputs=True adds "outputs": every request's RequestOutput, by
    its index in the arrival order. meter: with clock="virtual", CPU seconds of plug-ins in
    another process to charge as well (kvlab.slo.VirtualClock's meter).

    Every request is checked before the run (see _checked_requests): on the wall clock, a
    request arriving past max_seconds (600 by default) is refused, as the run would wait
    for it in real time. progress: None, or a function given a line of text each time the
    engine idles a second or more of wall time until the next arrival."""
    check_memory(memory, model)
    budget = arguments.positive(budget, "budget")
    num_blocks = arguments.positive(num_blocks, "num_blocks")
    block_size = arguments.positive(block_size, "block_size", core.MAX_BLOCK_SIZE)
    max_seconds = arguments.real(max_seconds, "max_seconds", above=0.0)
    progress = _checked_progress(progress)
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {arguments.shown(clock)}")
    if slo is not None and not isinstance(slo, SLO):
        raise arguments.ArgumentTypeError(f"slo must be a kvlab.slo.SLO or None, got "
                                          f"{arguments.shown(slo)}")
    if cost is not None and (clock != "virtual" or not isinstance(cost, StepCost)):
        raise ValueError("cost prices the steps of clock='virtual': give a kvlab.slo.StepCost "
                         "with clock='virtual', or no cost")
    if meter is not None and clock != "virtual":
        raise ValueError("meter charges plug-in CPU time to clock='virtual': give it with "
                         "clock='virtual', or no meter")
    if engine_options is not None and not isinstance(engine_options, dict):
        raise arguments.ArgumentTypeError(f"engine_options must be a dict of Engine keyword "
                                          f"arguments, got {arguments.shown(engine_options)}")
    pending = sorted(_checked_requests(model, requests, max_seconds if clock == "wall"
                                       else math.inf), key=lambda r: r[0])
    virtual = clock == "virtual"
    engine = _engine(model, pending, budget, num_blocks, block_size, memory,
                     dict(engine_options or {}),
                     VirtualClock(cost or StepCost.for_model(model), meter=meter) if virtual
                     else time.perf_counter)
    seconds = (_run_virtual if clock == "virtual" else _run_wall)(engine, pending, progress)
    report = _report(engine, memory, budget, seconds, clock, slo)
    if outputs:
        report["outputs"] = dict(engine.outputs)
    return report


def _engine(model, pending, budget, num_blocks, block_size, memory, options, clock) -> Engine:
    """serve()'s engine, after checking that each request could run in its pool alone."""
    if memory == "contiguous":
        context = model.config.max_seq_len
        if num_blocks * block_size < context:
            raise ValueError(f"{num_blocks} blocks of {block_size} hold less than one context "
                             f"of {context} positions: no contiguous cache fits")
        num_blocks, block_size = num_blocks * block_size // context, context
    for name in ("num_blocks", "block_size", "max_batch_tokens", "clock"):
        if name in options:
            raise ValueError(f"engine_options may not set {name}: serve() sets it")
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    max_batch_tokens=budget, clock=clock, **options)
    for i, (_, ids, new_tokens) in enumerate(pending):    # could it ever run, alone?
        why = requests_fit(len(ids), SamplingParams(max_new_tokens=new_tokens),
                           engine.pool.block_size, engine.pool.num_blocks,
                           engine.pool.max_blocks_per_seq)
        if why is not None:
            raise ValueError(f"a request arriving at {pending[i][0]:g} s could never run in "
                             f"this engine's pool: {why}")
    return engine


def _run_wall(engine: Engine, pending: list, progress) -> float:
    """Serve `pending` in real time: before each step, add every request whose arrival
    time has passed, stamped with it; sleep while idle. Returns the seconds it took."""
    start = time.perf_counter()
    next_request = 0
    while next_request < len(pending) or engine.has_work:
        now = time.perf_counter() - start
        next_request = _arrive(engine, pending, next_request, now, start)
        if engine.has_work:
            engine.step()
        elif next_request < len(pending):               # idle until the next arrival
            arrival = pending[next_request][0]
            wait = arrival - (time.perf_counter() - start)
            if progress is not None and wait >= 1.0:
                progress(f"waiting {wait:,.1f} s for request {next_request + 1} of "
                         f"{len(pending)}, arriving at {arrival:,.1f} s")
            time.sleep(max(0.0, wait))
    return time.perf_counter() - start


def _run_virtual(engine: Engine, pending: list, progress) -> float:
    """Serve `pending` on the engine's VirtualClock (which starts at 0, the arrivals'
    origin): the same loop as _run_wall's, an idle engine skipping to the next arrival.
    Returns the virtual seconds it took."""
    clock = engine._clock
    next_request = 0
    while next_request < len(pending) or engine.has_work:
        next_request = _arrive(engine, pending, next_request, clock(), 0.0)
        if engine.has_work:
            engine.step()
        elif next_request < len(pending):
            clock.wait_until(pending[next_request][0])
    return clock()


def _arrive(engine: Engine, pending: list, next_request: int, now: float,
            start: float) -> int:
    """Add the requests from pending[next_request] on that arrived by `now` (seconds from
    `start`), each stamped with its arrival; the index of the first still to come."""
    while next_request < len(pending) and pending[next_request][0] <= now:
        arrival, prompt, new_tokens = pending[next_request]
        next_request += 1
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens),
                           arrival_time=start + arrival)
    return next_request


def _report(engine: Engine, memory: str, budget: int, seconds: float, clock: str,
            slo: Optional[SLO]) -> dict:
    outputs = list(engine.outputs.values())
    metrics = [out.metrics for out in outputs]
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    e2e = [m.e2e for m in metrics]

    def ms(values, q):
        return 1e3 * float(np.percentile(values, q)) if values else float("nan")

    report = {"memory": memory, "budget": budget, "requests": len(metrics), "seconds": seconds,
              "tokens_per_s": sum(m.output_tokens for m in metrics) / seconds,
              "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
              "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
              "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
              "steps": len(engine.metrics), "clock": clock}
    if slo is not None:
        report.update(goodput_report(outputs, slo, seconds))
    return report


TABLE_HEAD = (f"{'rate/s':>7}{'memory':>11}{'budget':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}"
              f"{'TPOT p50':>10}{'p99':>8}{'e2e p50':>10}{'p99':>9}   (ms)")


def table_row(rate: float, row: dict) -> str:
    rate = arguments.real(rate, "rate", above=0.0)
    return (f"{rate:>7g}{row['memory']:>11}{row['budget']:>8}{row['tokens_per_s']:>9.0f}"
            f"{row['ttft_p50_ms']:>10.1f}"
            f"{row['ttft_p99_ms']:>9.1f}{row['tpot_p50_ms']:>10.2f}{row['tpot_p99_ms']:>8.2f}"
            f"{row['e2e_p50_ms']:>10.1f}{row['e2e_p99_ms']:>9.1f}"
            + (f"{row['goodput']:>10.2f}{row['served']:>5}/{row['requests']}"
               if "goodput" in row else ""))


GOODPUT_HEAD = f"{'goodput':>10} served"   # after TABLE_HEAD's columns, with an SLO


def _checked_list(values, name: str, check) -> list:
    """A non-empty list, tuple or array of values, each checked by check(value, name[i])."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise arguments.ArgumentTypeError(f"{name} must be a list, got "
                                          f"{arguments.shown(values)}")
    if len(values) == 0:
        raise ValueError(f"{name} must hold at least one value, got none")
    return [check(value, f"{name}[{i}]") for i, value in enumerate(values)]


def sweep(model, rates, budgets, n_requests: int = 40, seed: int = 0, out=print,
          memories=("paged",), *, max_seconds: float = MAX_SECONDS,
          progress: Optional[Callable[[str], None]] = None, clock: str = "wall",
          slo: Optional[SLO] = None) -> list:
    """serve() at every rate, budget and memory (the same requests at one rate for all of
    them), each row printed as it comes; the rows. Every argument, and every rate's
    workload (its last arrival at most max_seconds away on the wall clock: see serve()),
    is checked before the warm-up runs (none on the virtual clock, which nothing warms).
    slo: a kvlab.slo.SLO adds each run's goodput (requests a second served within it)."""
    rates = _checked_list(rates, "rates", lambda v, name: arguments.real(v, name, above=0.0))
    budgets = _checked_list(budgets, "budgets", arguments.positive)
    memories = _checked_list(memories, "memories", lambda v, name: v)
    for memory in memories:               # before the warm-up, not after it
        check_memory(memory, model)
    if not callable(out):
        raise arguments.ArgumentTypeError(f"out must be a function taking a line of text, "
                                          f"got {type(out).__name__}")
    max_seconds = arguments.real(max_seconds, "max_seconds", above=0.0)
    progress = _checked_progress(progress)
    workloads = [workload(model, n_requests, rate, seed) for rate in rates]
    for requests in workloads:
        _checked_requests(model, requests, max_seconds if clock == "wall" else math.inf)
    if clock == "wall":
        serve(model, workload(model, 4, 100.0, seed), budgets[0])          # warm up
    out(TABLE_HEAD + (GOODPUT_HEAD if slo is not None else ""))
    rows = []
    for rate, requests in zip(rates, workloads):
        for memory in memories:
            for budget in budgets:
                row = {"rate": rate, **serve(model, requests, budget, memory=memory,
                                             max_seconds=max_seconds, progress=progress,
                                             clock=clock, slo=slo)}
                rows.append(row)
                out(table_row(rate, row))
    return rows


def plot(rows: list, path, title: str = "") -> None:
    """Against the request rate (log): throughput, left; the time to first token, middle;
    the time per output token, right; p50 solid and p99 dashed, one color per memory and
    budget. Needs matplotlib. rows: sweep()'s, each with a rate above 0 (the axis is
    logarithmic); path: a file path, or a file object (io.BytesIO, for a notebook);
    title: text."""
    rows = _checked_list(rows, "rows", _checked_row)
    if not isinstance(path, (str, os.PathLike)) and not callable(getattr(path, "write", None)):
        raise arguments.ArgumentTypeError(f"path must be a file path or a file object (as "
                                          f"matplotlib's savefig takes), got "
                                          f"{arguments.shown(path)}")
    if not isinstance(title, str):
        raise arguments.ArgumentTypeError(f"title must be text, got {arguments.shown(title)}")
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
    for ax, metric in zip(axes[1:], ("ttft", "tpot")):
        ax.set_title("solid: p50, dashed: p99", fontsize=9)
        if not any(r[f"{metric}_{q}_ms"] > 0 for r in rows for q in ("p50", "p99")):
            # NaN where no request had one (serve() of requests with 1 new token each has
            # no TPOT): a log axis of nothing fails, so say so instead
            ax.text(0.5, 0.5, "none measured", transform=ax.transAxes, ha="center")
            continue
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_one_two_five))
        ax.yaxis.set_minor_formatter(FuncFormatter(_one_two_five))
    axes[0].set_title(title or "Poisson arrivals", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


ROW_FIELDS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def _checked_row(row, name: str) -> dict:
    """One of sweep()'s rows, as plot() needs it: a rate above 0, a memory, a budget, and
    the numbers it draws (NaN where a run had none, as serve() gives)."""
    if not isinstance(row, dict):
        raise arguments.ArgumentTypeError(f"{name} must be a dict such as sweep() gives, got "
                                          f"{arguments.shown(row)}")
    missing = [key for key in ("rate", "memory", "budget") + ROW_FIELDS if key not in row]
    if missing:
        raise ValueError(f"{name} has no {', '.join(missing)}: plot() takes sweep()'s rows")
    arguments.real(row["rate"], f"{name}['rate']", above=0.0)
    arguments.positive(row["budget"], f"{name}['budget']")
    if not isinstance(row["memory"], str):
        raise arguments.ArgumentTypeError(f"{name}['memory'] must be text, got "
                                          f"{arguments.shown(row['memory'])}")
    for key in ROW_FIELDS:
        value = row[key]
        if not (isinstance(value, (float, np.floating)) and math.isnan(value)):
            arguments.real(value, f"{name}[{key!r}]", low=0.0)
    return row


def _one_two_five(value: float, _position) -> str:
    """A log axis's tick label at 1, 2 and 5 times a power of ten, none elsewhere."""
    if value <= 0:
        return ""
    power = 10.0 ** np.floor(np.log10(value))
    return f"{value:g}" if round(value / power) in (1, 2, 5) else ""
