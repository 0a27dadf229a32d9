"""kvlab.slo: SLOs and goodput counted by hand, the step cost model, and serving on the
virtual clock (the same report bit for bit, run after run, with no sleeping)."""
import dataclasses
import math
import time
import types

import numpy as np

import pytest

import kvlab
from kvlab import serving
from kvlab.engine_outputs import RequestMetrics
from kvlab.slo import (CALIBRATED, SLO, StepCost, StepWork, VirtualClock, goodput,
                       goodput_report)


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def metrics(ttft, tokens, e2e=None):
    """Made-up metrics: arrival at 10 s, the first token ttft later, the end at e2e."""
    first = None if ttft is None else 10.0 + ttft
    return RequestMetrics(arrival_time=10.0, first_token_time=first,
                          finished_time=10.0 + (e2e if e2e is not None else ttft or 0.0),
                          output_tokens=tokens)


def test_goodput_counts_the_requests_within_both_targets_by_hand():
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    made_up = [
        metrics(0.2, 11, e2e=0.2 + 10 * 0.05),    # served: TTFT 0.2, TPOT 0.05
        metrics(0.5, 3, e2e=0.5 + 2 * 0.1),       # served: both exactly on target
        metrics(0.6, 5, e2e=0.6 + 4 * 0.01),      # TTFT missed
        metrics(0.1, 5, e2e=0.1 + 4 * 0.2),       # TPOT missed
        metrics(0.9, 5, e2e=0.9 + 4 * 0.2),       # both missed: counted as TTFT
        metrics(0.3, 1),                          # one token, no TPOT: judged by TTFT, served
        metrics(0.7, 1),                          # one token, TTFT missed
        metrics(None, 0, e2e=0.4),                # failed before its first token
    ]
    report = goodput_report(made_up, slo, seconds=4.0)
    assert report["requests"] == 8
    assert (report["served"], report["missed_ttft"], report["missed_tpot"],
            report["failed"]) == (3, 3, 1, 1)
    assert report["goodput"] == 3 / 4.0 == goodput(made_up, slo, 4.0)
    assert report["slo_ttft_ms"] == 500.0 and report["slo_tpot_ms"] == 100.0
    ttfts = [m.ttft for m in made_up if m.ttft is not None]
    assert report["ttft_p99_ms"] == 1e3 * float(np.percentile(ttfts, 99))
    assert [slo.meets(m) for m in made_up] == [True, True, False, False, False, True, False,
                                               False]
    assert slo.misses(made_up[2]) == "ttft" and slo.misses(made_up[3]) == "tpot"
    assert math.isnan(goodput_report([], slo, 1.0)["ttft_p99_ms"])


def test_a_failed_request_misses_the_slo_whatever_its_times(model):
    engine = kvlab.Engine(model, num_blocks=32, clock=VirtualClock(StepCost.for_model(model)))
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_new_tokens=3))
    engine.run(progress=False)
    (output,) = engine.outputs.values()
    slo = SLO(1e3, 1e3)
    assert goodput_report([output], slo, 1.0)["served"] == 1
    output.outputs[0].finish_reason = "error: step 1: ValueError: made up"
    assert goodput_report([output], slo, 1.0)["failed"] == 1


@pytest.mark.parametrize("bad", [(0, 0.1), (0.1, 0), (-1, 0.1), (float("nan"), 0.1),
                                 (float("inf"), 0.1), (True, 0.1), ("0.5", 0.1), (0.5, None)])
def test_bad_slos_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match="ttft_s|tpot_s"):
        SLO(*bad)


@pytest.mark.parametrize("text", ["500", "500,50,5", "a,b", "0,50", "500,-1", "nan,5", "", "5,inf"])
def test_bad_slo_texts_are_refused(text):
    with pytest.raises(ValueError, match="SLO"):
        SLO.from_ms(text)


def test_slo_from_ms():
    assert SLO.from_ms("500,50") == SLO(0.5, 0.05)


def test_goodput_refuses_what_it_cannot_count():
    with pytest.raises(TypeError, match="slo"):
        goodput_report([], (0.5, 0.1), 1.0)
    with pytest.raises(ValueError, match="seconds"):
        goodput_report([], SLO(0.5, 0.1), 0.0)


def test_a_step_that_computes_more_costs_more():
    for cost in CALIBRATED.values():
        base = StepWork(tokens=10, sequences=2, kv_rows_read=500, swapped_bytes=0)
        for more in (StepWork(11, 2, 500, 0), StepWork(10, 3, 500, 0),
                     StepWork(10, 2, 900, 0), StepWork(10, 2, 500, 4096)):
            assert cost.seconds(more) > cost.seconds(base) > cost.seconds(StepWork())
    with pytest.raises(ValueError, match="token_s"):
        StepCost(step_s=0.0, token_s=-1.0, sequence_s=0.0, kv_row_s=0.0, swap_byte_s=0.0)
    with pytest.raises(TypeError, match="StepWork"):
        CALIBRATED["shakespeare-1m"].seconds(3)


def test_the_engine_reports_the_rows_attention_read(model):
    engine = kvlab.Engine(model, num_blocks=32, max_batch_tokens=4)
    engine.add_request(list(range(1, 7)), kvlab.SamplingParams(max_new_tokens=2,
                                                               stop_at_eos=False))
    rows = [engine.step().kv_rows_read for _ in range(3)]
    # a prompt of 6 in chunks of 4 and 2, then one decode at position 6
    assert rows == [1 + 2 + 3 + 4, 5 + 6, 7]


def test_the_virtual_clock_moves_by_each_steps_price(model):
    cost = StepCost.for_model(model)
    clock = VirtualClock(cost)
    engine = kvlab.Engine(model, num_blocks=32, clock=clock)
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_new_tokens=4))
    total = 0.0
    while engine.has_work:
        total += cost.seconds(StepWork.of(engine.step()))
        assert clock() == total
    (output,) = engine.outputs.values()
    assert output.metrics.finished_time == total and clock.steps == len(engine.metrics)
    assert clock.wait_until(total - 1.0) == total and clock.wait_until(total + 2) == total + 2


def test_a_meter_charges_each_step_what_it_grew_by(model):
    """VirtualClock(meter=): plug-in CPU seconds read from outside (a grader's worker) are
    charged to the step they grew in, after its priced work; a meter that reads less than
    before (it never should) charges nothing, and the clock never goes back."""
    cost = StepCost.for_model(model)
    readings = iter([0.5, 0.5, 0.502, 0.502, 0.501, 0.510])   # the first when the clock is made
    clock = VirtualClock(cost, meter=lambda: next(readings))
    work = StepWork(tokens=3, sequences=1, kv_rows_read=6)
    charged = [clock.charge(work) for _ in range(5)]
    steps = np.diff([0.0] + charged)
    extra = steps - cost.seconds(work)
    assert extra == pytest.approx([0.0, 0.002, 0.0, 0.0, 0.009 - 0.001], abs=1e-12)
    assert clock.plugin_cpu_s == pytest.approx(0.010)
    assert cost.seconds(dataclasses.replace(work, plugin_cpu_s=0.25)) == cost.seconds(work) + 0.25
    for bad in (lambda: -1.0, lambda: float("nan"), lambda: "1"):
        with pytest.raises((TypeError, ValueError), match="meter"):
            VirtualClock(cost, meter=bad)
    with pytest.raises(TypeError, match="meter"):
        VirtualClock(cost, meter=0.5)


def test_a_run_with_a_meter_is_slower_by_what_it_charged(model):
    """serve(meter=) charges the engine's steps; a meter that never grows changes nothing,
    bit for bit; one that grows by a millisecond a step makes every step that much longer.
    A meter without the virtual clock is refused."""
    requests = serving.workload(model, 8, rate=400.0, seed=5)
    plain = serving.serve(model, requests, budget=32, num_blocks=24, clock="virtual")
    idle = serving.serve(model, requests, budget=32, num_blocks=24, clock="virtual",
                         meter=lambda: 0.0)
    assert idle == plain
    readings = iter(range(10_000))
    busy = serving.serve(model, requests, budget=32, num_blocks=24, clock="virtual",
                         meter=lambda: 1e-3 * next(readings))
    assert busy["seconds"] > plain["seconds"] and busy["seconds"] >= 1e-3 * busy["steps"]
    assert busy["ttft_p99_ms"] > plain["ttft_p99_ms"]
    with pytest.raises(ValueError, match="meter"):
        serving.serve(model, requests, meter=lambda: 0.0)


def test_other_models_are_priced_by_size(model):
    smollm2 = CALIBRATED["SmolLM2-135M-Instruct.Q4_1"]
    assert StepCost.for_model(model) is CALIBRATED["shakespeare-1m"]

    renamed = types.SimpleNamespace(config=dataclasses.replace(model.config, name="mine"),
                                    n_params=model.n_params)
    scaled = StepCost.for_model(renamed)
    assert scaled.token_s == pytest.approx(smollm2.token_s * model.n_params / 134_515_008)


def test_virtual_serving_is_the_same_bit_for_bit_run_after_run(model):
    requests = serving.workload(model, 12, rate=400.0, seed=3)
    slo = SLO(0.005, 0.0005)
    started = time.perf_counter()
    first = serving.serve(model, requests, budget=32, num_blocks=24, clock="virtual", slo=slo)
    second = serving.serve(model, requests, budget=32, num_blocks=24, clock="virtual", slo=slo)
    assert first == second                       # every float equal, not close
    assert first["clock"] == "virtual" and first["requests"] == 12
    assert first["served"] + first["missed_ttft"] + first["missed_tpot"] + first["failed"] == 12
    assert first["goodput"] == first["served"] / first["seconds"]
    # arrivals 30 virtual seconds apart are not waited for in real time
    slow = [(30.0 * i, prompt, n) for i, (_, prompt, n) in enumerate(requests[:3])]
    report = serving.serve(model, slow, clock="virtual", slo=slo)
    assert report["seconds"] > 60.0 and time.perf_counter() - started < 60.0
    assert report["served"] == 3                 # alone, each meets a tight SLO


def test_more_load_gives_less_goodput_on_virtual_time(model):
    slo = SLO(0.01, 0.001)
    light = serving.serve(model, serving.workload(model, 16, rate=50.0), clock="virtual",
                          slo=slo, budget=32)
    heavy = serving.serve(model, serving.workload(model, 16, rate=5000.0), clock="virtual",
                          slo=slo, budget=32)
    assert light["served"] > heavy["served"]


def test_serve_refuses_bad_clock_and_slo(model):
    requests = serving.workload(model, 2, rate=100.0)
    with pytest.raises(ValueError, match="clock"):
        serving.serve(model, requests, clock="fast")
    with pytest.raises(TypeError, match="slo"):
        serving.serve(model, requests, slo=(0.5, 0.1))
    with pytest.raises(ValueError, match="cost"):
        serving.serve(model, requests, cost=CALIBRATED["shakespeare-1m"])
    with pytest.raises(ValueError, match="engine_options may not set clock"):
        serving.serve(model, requests, clock="virtual", engine_options={"clock": time.time})


def test_serve_bench_prints_goodput_on_virtual_time(capsys):
    from kvlab import cli
    argv = ["serve-bench", "--rates", "0.001,400", "--requests", "4", "--budgets", "16",
            "--slo", "50,5", "--virtual"]
    assert cli.main(argv) == 0          # 0.001/s: hours of arrivals, no waiting
    printed = capsys.readouterr().out
    assert "goodput" in printed and "virtual clock" in printed and " 4/4" in printed
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == printed
    assert cli.main(["serve-bench", "--slo", "50", "--model", "/nonexistent"]) == 2
    assert "SLO" in capsys.readouterr().err


def test_the_calibration_fit_recovers_known_prices_and_none_below_zero():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import calibrate_step_cost
    rng = np.random.default_rng(0)
    work = [StepWork(int(rng.integers(1, 300)), int(rng.integers(1, 30)),
                     int(rng.integers(0, 50_000)), int(rng.integers(0, 2)) * 4096)
            for _ in range(200)]
    true = StepCost(2e-4, 3e-5, 1e-5, 2e-7, 0.0)
    x = np.array([calibrate_step_cost.features(w) for w in work], dtype=np.float64)
    y = np.array([true.seconds(w) for w in work]) * (1 + 0.01 * rng.standard_normal(200))
    price = calibrate_step_cost.fit(x, y)
    assert (price >= 0).all()
    for got, want in zip(price[:4], (true.step_s, true.token_s, true.sequence_s, true.kv_row_s)):
        assert got == pytest.approx(want, rel=0.1)
    assert price[4] * 4096 < 0.01 * y.mean()   # bytes that cost nothing: next to no price
