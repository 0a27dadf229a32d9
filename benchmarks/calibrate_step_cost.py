"""The prices of kvlab.slo.StepCost, measured on the real Engine: the calibration behind the
virtual clock.

    python benchmarks/calibrate_step_cost.py [--model shakespeare-1m|smollm2-135m] [--json out]

Runs the Engine, one thread, on mixed work (prompts of 8 to 200 tokens arriving while
others decode, chunked prefill at two budgets, a pool small enough to preempt by swapping)
and times every step in CPU seconds (time.process_time: robust to other programs on a shared
machine, as wall time is not). Each step's work is read from its StepResult
(kvlab.slo.StepWork.of), and the five prices (per step, token, sequence, K/V row read, byte
swapped) are fitted by least squares with no price below zero. It prints them as the
CALIBRATED entry to paste into kvlab/slo.py, and the fit's error on the steps measured.

The stored prices are a model of one machine, rounded to 3 digits; they are what makes a
virtual run the same everywhere, not a promise of any machine's speed. Rerun this script
to price another machine, or a model the table lacks. The engine runs here with its own
scheduler and no drafter, so their Python is in the step's and the sequence's prices; the
CPU time of plug-ins in another process (lab 15's grader) is not priced but measured
(StepWork.plugin_cpu_s, kvlab/grading/plugin_cpu.py), and counts as the seconds it is.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

import kvlab
from kvlab.slo import StepWork

FIELDS = ("step_s", "token_s", "sequence_s", "kv_row_s", "swap_byte_s")


def features(work: StepWork) -> list:
    return [1.0, work.tokens, work.sequences, work.kv_rows_read, work.swapped_bytes]


def measure(model, seed: int = 0, rounds: int = 3) -> tuple:
    """(features, CPU seconds) of every step of `rounds` mixed runs."""
    rng = np.random.default_rng(seed)
    text = model.encode(kvlab.serving.SAMPLE_TEXT * 16)
    rows, seconds = [], []
    for budget, blocks, preemption in itertools.islice(
            itertools.cycle([(64, 48, "swap"), (256, 256, "recompute"), (128, 24, "swap")]),
            rounds):
        engine = kvlab.Engine(model, num_blocks=blocks, block_size=16, max_batch_tokens=budget,
                              preemption=preemption)
        pending = []
        for _ in range(24):
            length = int(rng.integers(8, 200))
            start = int(rng.integers(0, len(text) - length))
            pending.append((text[start:start + length], int(rng.integers(4, 80))))
        while pending or engine.has_work:
            for _ in range(int(rng.integers(0, 3))):      # arrivals between steps
                if pending:
                    prompt, new = pending.pop()
                    engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new))
            if not engine.has_work:
                continue
            started = time.process_time()
            result = engine.step()
            seconds.append(time.process_time() - started)
            rows.append(features(StepWork.of(result)))
    return np.array(rows, dtype=np.float64), np.array(seconds)


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every price from 0: the best of the fits on each subset of the
    columns whose prices all come out non-negative (5 columns: 32 small fits), the others 0.
    Columns are scaled to unit norm first so that bytes and steps weigh alike."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_error = np.zeros(x.shape[1]), float(np.sum(y * y))
    for k in range(1, x.shape[1] + 1):
        for columns in itertools.combinations(range(x.shape[1]), k):
            coef, *_ = np.linalg.lstsq(xs[:, columns], y, rcond=None)
            if (coef < 0).any():
                continue
            error = float(np.sum((xs[:, columns] @ coef - y) ** 2))
            if error < best_error:
                best, best_error = np.zeros(x.shape[1]), error
                best[list(columns)] = coef
    return best / scale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shakespeare-1m",
                        help="shakespeare-1m (bundled) or smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the steps and the fit here")
    args = parser.parse_args(argv)
    kvlab.set_num_threads(1)
    model = kvlab.load(None if args.model == "shakespeare-1m" else args.model)
    x, y = measure(model, rounds=args.rounds)
    price = fit(x, y)
    predicted = x @ price
    error = np.abs(predicted - y) / np.maximum(y, 1e-9)
    name = model.config.name
    print(f"{len(y)} steps of {model!r}: {y.sum():.2f} CPU s measured, "
          f"{predicted.sum():.2f} s predicted; median error per step {np.median(error):.1%}, "
          f"p90 {np.percentile(error, 90):.1%}")
    print(f'    "{name}": StepCost(' + ", ".join(
        f"{f}={float(f'{p:.3g}'):.3g}" for f, p in zip(FIELDS, price)) + "),")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "prices": dict(zip(FIELDS, price.tolist())),
                       "features": x.tolist(), "seconds": y.tolist()}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
