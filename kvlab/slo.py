"""Service-level objectives, goodput, and a clock that counts work instead of seconds.

A server is judged by the requests it serves well enough, not by its tokens per second:
an SLO states a target time to first token (TTFT) and a target time per output token after
it (TPOT), and goodput counts the requests a second that met both (DistServe's measure).

    slo = kvlab.slo.SLO(ttft_s=0.5, tpot_s=0.05)
    slo.meets(output.metrics)                     # one request
    kvlab.slo.goodput(engine.outputs.values(), slo, seconds)   # requests/s within both

Serving measured in wall-clock seconds depends on the machine and on whatever else runs on
it, so the same run gives other numbers on a shared machine, and a grade must not. A
VirtualClock gives the Engine (Engine(clock=)) a time that moves only when a step is done,
by what that step computed, priced by a StepCost: seconds per step, per token run through
the model, per K/V row read by attention, per byte swapped. The prices were measured once on
the real Engine (benchmarks/calibrate_step_cost.py, which recomputes them) and are stored
here, so a run on virtual time gives the same numbers, bit for bit, on every machine;
kvlab.serving.serve(clock="virtual") runs a whole workload that way, arrivals included.

This file holds records and arithmetic only: it runs no model and no engine (kvlab.serving
does), and a StepCost is a model of the machine, not a measurement of the run.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Optional

import numpy as np

from . import arguments


# ---- SLOs and goodput ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, init=False)
class SLO:
    """Targets for one request: its time to first token at most ttft_s seconds, and its time
    per output token after the first at most tpot_s seconds (both finite and above 0)."""
    ttft_s: float
    tpot_s: float

    def __init__(self, ttft_s: float, tpot_s: float):
        object.__setattr__(self, "ttft_s", arguments.real(ttft_s, "ttft_s", above=0.0))
        object.__setattr__(self, "tpot_s", arguments.real(tpot_s, "tpot_s", above=0.0))

    @classmethod
    def from_ms(cls, text: str) -> "SLO":
        """'TTFT_MS,TPOT_MS' (the command line's --slo 500,50) as an SLO."""
        if not isinstance(text, str):
            raise arguments.ArgumentTypeError(f"an SLO must be text 'TTFT_MS,TPOT_MS', got "
                                              f"{arguments.shown(text)}")
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"an SLO is two numbers of milliseconds, 'TTFT_MS,TPOT_MS' "
                             f"(such as 500,50), got {text!r}")
        try:
            ttft, tpot = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"an SLO is two numbers of milliseconds, 'TTFT_MS,TPOT_MS' "
                             f"(such as 500,50), got {text!r}") from None
        return cls(arguments.real(ttft, "the SLO's TTFT (ms)", above=0.0) / 1e3,
                   arguments.real(tpot, "the SLO's TPOT (ms)", above=0.0) / 1e3)

    def misses(self, metrics) -> Optional[str]:
        """Why a request's metrics (RequestOutput.metrics) miss this SLO: "failed" (no first
        token), "ttft", "tpot", or None where they meet it. A request of one generated token
        has no TPOT (no token after the first): it is judged by its TTFT alone, as a user
        who got the whole answer at the first token waited for nothing more."""
        ttft = getattr(metrics, "ttft", None) if metrics is not None else None
        if ttft is None:
            return "failed"
        if not ttft <= self.ttft_s:
            return "ttft"
        tpot = metrics.tpot
        if tpot is not None and not tpot <= self.tpot_s:
            return "tpot"
        return None

    def meets(self, metrics) -> bool:
        """Whether a request's metrics meet both targets (see misses())."""
        return self.misses(metrics) is None


def _why_missed(output, slo: SLO) -> Optional[str]:
    """As SLO.misses, for a RequestOutput (a failed sequence misses it whatever its times)
    or a bare RequestMetrics."""
    sequences = getattr(output, "outputs", None) or []
    if any(str(s.finish_reason).startswith("error") for s in sequences):
        return "failed"
    return slo.misses(getattr(output, "metrics", output))


def goodput_report(outputs: Iterable, slo: SLO, seconds: float) -> Dict[str, float]:
    """The requests of `outputs` (RequestOutputs, or their RequestMetrics) that met `slo`,
    a second of `seconds` (the run's length, above 0): goodput, with what it is made of:
    requests, served (met both targets), missed_ttft, missed_tpot (a request that misses
    TTFT is counted there alone), failed, and the p99 TTFT and TPOT in ms (NaN where none)."""
    if not isinstance(slo, SLO):
        raise arguments.ArgumentTypeError(f"slo must be a kvlab.slo.SLO, got {arguments.shown(slo)}")
    seconds = arguments.real(seconds, "seconds", above=0.0)
    counts = {"failed": 0, "ttft": 0, "tpot": 0, None: 0}
    ttft, tpot = [], []
    for output in outputs:
        counts[_why_missed(output, slo)] += 1
        metrics = getattr(output, "metrics", output)
        if metrics is not None and metrics.ttft is not None:
            ttft.append(metrics.ttft)
            if metrics.tpot is not None:
                tpot.append(metrics.tpot)
    return {"requests": sum(counts.values()), "served": counts[None],
            "missed_ttft": counts["ttft"], "missed_tpot": counts["tpot"],
            "failed": counts["failed"], "goodput": counts[None] / seconds,
            "slo_ttft_ms": 1e3 * slo.ttft_s, "slo_tpot_ms": 1e3 * slo.tpot_s,
            "ttft_p99_ms": _p99_ms(ttft), "tpot_p99_ms": _p99_ms(tpot)}


def goodput(outputs: Iterable, slo: SLO, seconds: float) -> float:
    """Requests a second served within both of slo's targets (goodput_report's goodput)."""
    return goodput_report(outputs, slo, seconds)["goodput"]


def _p99_ms(values) -> float:
    return 1e3 * float(np.percentile(values, 99)) if values else float("nan")


# ---- what a step computed, and what it costs ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one Engine step computed, as the engine counts it (the same numbers as its
    StepResult): tokens run through the model (prompt chunks, decoded tokens, drafts), the
    sequences in the forward call, the K/V rows attention read (a token at position p reads
    p + 1 rows, in every layer), and the K/V bytes copied to host memory and back; and
    plugin_cpu_s, the CPU seconds plug-ins running in another process (a grader's worker)
    spent beyond what the step's own prices cover, as measured from outside them
    (VirtualClock's meter; 0 for kvlab's own plug-ins, whose work the prices hold)."""
    tokens: int = 0
    sequences: int = 0
    kv_rows_read: int = 0
    swapped_bytes: int = 0
    plugin_cpu_s: float = 0.0

    @classmethod
    def of(cls, result) -> "StepWork":
        """The work of a StepResult."""
        return cls(tokens=result.prefill_tokens + result.decode_tokens + result.drafted,
                   sequences=result.batch_size, kv_rows_read=result.kv_rows_read,
                   swapped_bytes=result.swapped_out_bytes + result.swapped_in_bytes)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds for one Engine step, linear in its work:

        step_s + token_s * tokens + sequence_s * sequences + kv_row_s * kv_rows_read
               + swap_byte_s * swapped_bytes

    step_s is the step's fixed cost (planning, the call into the core); token_s a token's
    pass through every weight matrix; sequence_s a sequence's own bookkeeping and sampling;
    kv_row_s one K/V row read by one token's attention (all layers); swap_byte_s one byte
    copied between the pool and host memory. Every price is a finite number from 0."""
    step_s: float
    token_s: float
    sequence_s: float
    kv_row_s: float
    swap_byte_s: float

    def __post_init__(self):
        for field in dataclasses.fields(self):
            arguments.real(getattr(self, field.name), field.name, low=0.0)

    def seconds(self, work: StepWork) -> float:
        """The step's seconds; plug-in CPU seconds count as they are (the prices are CPU
        seconds of one thread too), after the priced work."""
        if not isinstance(work, StepWork):
            raise arguments.ArgumentTypeError(f"work must be a kvlab.slo.StepWork, got "
                                              f"{arguments.shown(work)}")
        priced = (self.step_s + self.token_s * work.tokens + self.sequence_s * work.sequences
                  + self.kv_row_s * work.kv_rows_read + self.swap_byte_s * work.swapped_bytes)
        return priced + work.plugin_cpu_s if work.plugin_cpu_s else priced

    @classmethod
    def for_model(cls, model) -> "StepCost":
        """The calibrated prices of a model the kit ships or fetches (CALIBRATED, by the
        model's config name); for another model, SmolLM2's prices scaled by its size: tokens
        by parameters, K/V rows by n_layers * kv_dim. A model of its own, a machine of its
        own: run benchmarks/calibrate_step_cost.py to price it."""
        name = getattr(model.config, "name", "") or ""
        if name in CALIBRATED:
            return CALIBRATED[name]
        base = CALIBRATED[SMOLLM2]
        c = model.config
        params = model.n_params / SMOLLM2_PARAMS
        rows = c.n_layers * c.n_kv_heads * c.head_dim / SMOLLM2_KV_WIDTH
        return cls(base.step_s, base.token_s * params, base.sequence_s,
                   base.kv_row_s * rows, base.swap_byte_s)


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
SMOLLM2_PARAMS = 134_515_008
SMOLLM2_KV_WIDTH = 30 * 3 * 64          # n_layers * n_kv_heads * head_dim

# Measured by benchmarks/calibrate_step_cost.py (CPU seconds of one thread on the kit's
# 2-core build machine, 2026-12-06; fp32 pool of blocks of 16; 761 steps of the bundled model,
# median error per step 7.4 %; 304 steps of SmolLM2, 5.8 %), rounded to 3 digits. SmolLM2's
# fit could not tell its swap price from 0 (its few swaps cost little beside its tokens): a
# byte copied costs the same whatever the model, so it takes the bundled model's.
CALIBRATED: Dict[str, StepCost] = {
    "shakespeare-1m": StepCost(step_s=2.59e-4, token_s=3.17e-5, sequence_s=1.45e-5,
                               kv_row_s=1.86e-7, swap_byte_s=3.1e-10),
    SMOLLM2: StepCost(step_s=4.79e-3, token_s=2.02e-3, sequence_s=6.55e-4,
                      kv_row_s=1.96e-6, swap_byte_s=3.1e-10),
}


class VirtualClock:
    """A clock for Engine(clock=) that moves only by work: calling it gives the time now
    (seconds from `start`); the engine calls charge(work) at the end of each step, before
    it reads the time its tokens were chosen at, which moves it by cost.seconds(work); a
    driver idle until the next arrival moves it with wait_until(). Nothing else moves it,
    so a run on it gives the same times on every machine and under any load.

    meter: None, or a function giving the CPU seconds that plug-ins in another process
    have spent so far beyond what the prices cover (a grader's measure of its worker,
    kvlab.grading.plugin_cpu); each step is also charged what it grew by since the last
    step (StepWork.plugin_cpu_s), so that work done outside the engine is not free. Such
    a run is as repeatable as that code's CPU time, no more; without a meter (kvlab's own
    plug-ins) it is bit for bit."""

    def __init__(self, cost: StepCost, start: float = 0.0,
                 meter: Optional[Callable[[], float]] = None):
        if not isinstance(cost, StepCost):
            raise arguments.ArgumentTypeError(f"cost must be a kvlab.slo.StepCost, got "
                                              f"{arguments.shown(cost)}")
        if meter is not None and not callable(meter):
            raise arguments.ArgumentTypeError(f"meter must be a function giving CPU seconds, "
                                              f"or None, got {arguments.shown(meter)}")
        self.cost, self.meter = cost, meter
        self._now = arguments.real(start, "start", low=0.0)
        self._metered = self._read_meter() if meter is not None else 0.0
        self.steps = 0
        self.plugin_cpu_s = 0.0          # all the meter charged so far

    def __call__(self) -> float:
        return self._now

    def charge(self, work: StepWork) -> float:
        """The time after a step that did `work` (and, with a meter, the plug-ins' CPU
        seconds since the last step)."""
        if self.meter is not None:
            metered = self._read_meter()
            grown = max(0.0, metered - self._metered)
            self._metered = max(metered, self._metered)
            work = dataclasses.replace(work, plugin_cpu_s=work.plugin_cpu_s + grown)
            self.plugin_cpu_s += grown
        self._now += self.cost.seconds(work)
        self.steps += 1
        return self._now

    def _read_meter(self) -> float:
        return arguments.real(self.meter(), "the meter's CPU seconds", low=0.0)

    def wait_until(self, when: float) -> float:
        """Idle until `when` (no earlier than now: the clock never goes back)."""
        when = arguments.real(when, "when")
        if when > self._now:
            self._now = when
        return self._now

    def __repr__(self) -> str:
        return f"VirtualClock(now={self._now:.6f} s after {self.steps} steps)"

