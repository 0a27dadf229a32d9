"""Reliability of kvlab.serving and `kvlab serve-bench` (issue 35): what a hostile caller
tried, and what each now gives.

Findings fixed (each test below fails without its fix):
- serve() with a NaN arrival time (as workload(rate=nan) made one) busy-looped forever:
  workload(rate=nan) now gives a ValueError naming rate, and serve() refuses a NaN, infinite,
  negative or non-number arrival (ValueError naming requests[i]'s arrival time) before the
  engine is made.
- `kvlab serve-bench --rates 0.001` waited ~1,000 s per arrival without a word: each rate's
  arrivals are computed from the seed before the model loads, and a rate whose run would
  wait past --max-seconds (default 600) for its last arrival is refused (exit 2, naming the
  rate, how long it would take and --max-seconds); the waiting of all runs is printed up
  front, and every wait of a second or more is shown on stderr (serve(progress=)).
  serve() itself refuses a request arriving past max_seconds (default 600).
- an unwritable --json path (in a missing folder, or a folder) failed only after every run:
  --json and --plot are tried before the model loads (exit 2, "nothing was run"); an
  existing file is left as it was and a new one is not left behind.

Class closed (kvlab.arguments; a wrong type is an ArgumentTypeError, both TypeError and
ValueError; every refusal names the argument and happens before anything runs):
- workload / arrival_times: n_requests (bool, float, str, 0, -1, > MAX_REQUESTS 100,000),
  rate (NaN, +-inf, 0, -1, bool, str, 1e-310 whose mean gap 1/rate overflows), seed (-1,
  1.5, bool, str, None).
- serve: budget and num_blocks (0, bool, float, 2**31), block_size (also past the core's
  MAX_BLOCK_SIZE), memory (a non-string, an unknown name), max_seconds (NaN, inf, 0, -1,
  bool), progress (not callable); requests (a string, a number, an empty list, more than
  MAX_REQUESTS, an item that is not a triple), each request's arrival (NaN, inf, -1, bool,
  str, past max_seconds), prompt (empty, ids < 0 or >= vocab, floats, an empty text) and new
  tokens (0, bool, 2.5, past the model's context), and a request that can never fit the
  pool: all refused before the run, even a bad request arriving last (no earlier request
  runs first).
- sweep: rates, budgets, memories (not a list, empty, a bad item), out (not callable),
  n_requests, seed, max_seconds, and every rate's workload against max_seconds, before the
  warm-up; table_row's rate; plot's rows (empty, not dicts, missing fields, rate <= 0,
  budget not a count, negative or infinite numbers; NaN numbers, as serve() gives where no
  request had a TPOT, are drawn as "none measured" where plot() used to raise matplotlib's
  "Data cannot be log-scaled"), path and title.
- serve-bench options: --rates (0, nan, inf, abc, 1e-320), --budgets (0, 1.5, 2**31),
  --requests (> 100,000), --seed (-1), --max-seconds (0, nan), all refused with exit 2 before
  the model loads.
- Values from callables: serving reads no user clock (time.perf_counter, the Engine's
  default clock); the return values of out= and progress= are ignored. The Engine's own
  clock, drafter and trace-sink checks are the engine's surface, not this file's.
"""
import io
import json
import math
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvlab
from kvlab import arguments, cli, serving


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@contextmanager
def within(seconds: float):
    """Fail, not hang, if the block takes longer than `seconds` (a hang was the bug)."""
    def expired(*_):
        raise TimeoutError(f"took more than {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def prompt(model, n=8):
    return model.encode(serving.SAMPLE_TEXT)[:n]


# ---- the findings ------------------------------------------------------------------------

def test_a_nan_arrival_is_refused_not_served_forever(model):
    with within(10), pytest.raises(ValueError, match="rate must be a finite number"):
        serving.workload(model, 3, rate=float("nan"))
    for bad in (float("nan"), float("inf"), -1.0):
        with within(10), pytest.raises(ValueError, match=r"requests\[0\]'s arrival time"):
            serving.serve(model, [(bad, prompt(model), 4)])


def test_a_request_arriving_too_late_is_refused_at_once(model):
    started = time.perf_counter()
    with within(10), pytest.raises(ValueError, match="past max_seconds=600.*hours"):
        serving.serve(model, [(0.0, prompt(model), 4), (20_000.0, prompt(model), 4)])
    with within(10), pytest.raises(ValueError, match="past max_seconds=1"):
        serving.serve(model, [(1.5, prompt(model), 4)], max_seconds=1.0)
    with within(10), pytest.raises(ValueError, match="past max_seconds=600"):
        serving.sweep(model, [0.001], [16], n_requests=40, out=lambda line: None)
    assert time.perf_counter() - started < 5


def test_waits_are_shown_and_a_long_max_seconds_is_honoured(model):
    heard = []
    with within(30):
        report = serving.serve(model, [(1.2, prompt(model), 2)], max_seconds=2.0,
                               progress=heard.append)
    assert report["requests"] == 1 and report["seconds"] >= 1.2
    assert len(heard) == 1 and heard[0].startswith("waiting 1.") and "request 1 of 1" in heard[0]


def test_serve_bench_refuses_a_rate_that_would_take_hours_before_loading(capsys):
    with within(20):
        assert cli.main(["serve-bench", "--rates", "50,0.001", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--rates 0.001" in err and "hours" in err and "--max-seconds is 600" in err
    assert "nothing was run" in err and "nonexistent" not in err     # before the model loads
    # a larger --max-seconds lets it through to the model (which then fails to load here)
    with within(20):
        assert cli.main(["serve-bench", "--rates", "0.01", "--requests", "2",
                         "--max-seconds", "1000", "--model", "/nonexistent"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_serve_bench_says_how_long_it_waits(capsys, tmp_path):
    with within(60):
        assert cli.main(["serve-bench", "--rates", "300", "--requests", "3", "--budgets", "16",
                         "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "1 run, waiting for their arrivals alone" in out


@pytest.mark.parametrize("where", ["missing_folder", "folder"])
def test_an_unwritable_json_or_plot_path_is_refused_before_any_run(capsys, tmp_path, where):
    path = tmp_path / "no" / "such" / "out.json" if where == "missing_folder" else tmp_path
    for option in ("--json", "--plot"):
        with within(20):
            assert cli.main(["serve-bench", "--rates", "200", option, str(path),
                             "--model", "/nonexistent"]) == 2
        err = capsys.readouterr().err
        assert f"{option} {path}" in err and "nothing was run" in err
        assert "nonexistent" not in err                      # before the model loads


def test_a_writable_json_path_is_left_as_it_was_when_the_run_fails(capsys, tmp_path):
    existing, new = tmp_path / "old.json", tmp_path / "new.json"
    existing.write_text('{"kept": 1}')
    for path in (existing, new):
        assert cli.main(["serve-bench", "--rates", "200", "--json", str(path),
                         "--model", "/nonexistent"]) == 2
        assert "nonexistent" in capsys.readouterr().err
    assert json.loads(existing.read_text()) == {"kept": 1} and not new.exists()


# ---- the class: every argument ---------------------------------------------------------

BAD_COUNTS = [True, 2.0, "3", None, 0, -1]
BAD_REALS = [float("nan"), float("inf"), -float("inf"), 0, -1.0, True, "1", None]


@pytest.mark.parametrize("bad", BAD_COUNTS + [serving.MAX_REQUESTS + 1])
def test_workload_refuses_a_bad_n_requests(model, bad):
    with pytest.raises(ValueError, match="n_requests"):
        serving.workload(model, bad, 10.0)
    with pytest.raises(ValueError, match="n_requests"):
        serving.arrival_times(bad, 10.0)


@pytest.mark.parametrize("bad", BAD_REALS + [1e-310])
def test_workload_refuses_a_bad_rate(model, bad):
    with within(10), pytest.raises(ValueError, match="rate"):
        serving.workload(model, 3, bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0", None])
def test_workload_refuses_a_bad_seed(model, bad):
    with pytest.raises(ValueError, match="seed"):
        serving.workload(model, 3, 10.0, seed=bad)


def test_arrival_times_are_the_workloads(model):
    requests = serving.workload(model, 50, 7.0, seed=3)
    assert np.array_equal(serving.arrival_times(50, 7.0, seed=3), [r[0] for r in requests])
    # a huge but finite rate is fine: everything arrives at once
    assert serving.arrival_times(3, 1e300)[-1] < 1e-290


@pytest.mark.parametrize("name,bad", [
    *[("budget", b) for b in (0, True, 16.0, 2**31)],
    *[("num_blocks", b) for b in (0, False, 1.5, 2**31)],
    *[("block_size", b) for b in (0, True, 16.0, serving.core.MAX_BLOCK_SIZE + 1)],
    *[("max_seconds", b) for b in (float("nan"), float("inf"), 0, -1, True)],
    ("memory", 3), ("memory", "swap"), ("progress", 3)])
def test_serve_refuses_each_bad_argument(model, name, bad):
    with within(10), pytest.raises(ValueError, match=name):
        serving.serve(model, [(0.0, prompt(model), 2)], **{name: bad})


def requests_with(model, **bad):
    good = {"arrival": 0.0, "prompt": prompt(model), "new": 2}
    good.update(bad)
    return [(0.0, prompt(model), 2), (good["arrival"], good["prompt"], good["new"])]


@pytest.mark.parametrize("requests,match", [
    ("abc", "requests must be a list"), (5, "requests must be a list"),
    ([], "at least one request"), ([(0.0, [1, 2])], r"requests\[0\] must be"),
    ([[0.0, [1], 2, 3]], r"requests\[0\] must be"), (["abc"], r"requests\[0\] must be"),
])
def test_serve_refuses_a_bad_request_list(model, requests, match):
    with within(10), pytest.raises(ValueError, match=match):
        serving.serve(model, requests)


@pytest.mark.parametrize("field,bad,match", [
    ("arrival", True, "arrival time must be a number"),
    ("arrival", "1", "arrival time must be a number"),
    ("arrival", -0.5, "arrival time must be at least 0"),
    ("prompt", [], "prompt: token ids must be a non-empty"),
    ("prompt", [-1, 3], "prompt: token id -1 is out of range"),
    ("prompt", [3, 256], "prompt: token id 256 is out of range"),
    ("prompt", [1.5, 2.0], "prompt: token ids must be integers"),
    ("prompt", "", "prompt: the prompt has no tokens"),
    ("new", 0, "new tokens must be at least 1"),
    ("new", True, "new tokens must be an integer"),
    ("new", 2.5, "new tokens must be an integer"),
    ("new", 600, "exceeds the model's context of 512"),
])
def test_serve_refuses_a_bad_request_before_any_runs(model, field, bad, match):
    """The bad request is the second; the first, good, one never runs (no wait, no step)."""
    requests = requests_with(model, **{field: bad})
    requests[1] = (5.0,) + requests[1][1:] if field != "arrival" else requests[1]
    started = time.perf_counter()
    with within(10), pytest.raises(ValueError, match=r"requests\[1\].*" + match):
        serving.serve(model, requests)
    assert time.perf_counter() - started < 3                      # did not wait for 5 s


def test_serve_refuses_a_request_that_never_fits_its_pool(model):
    with within(10), pytest.raises(ValueError, match="could never run in this engine's pool"):
        serving.serve(model, [(0.0, prompt(model, 60), 90)], num_blocks=4, block_size=16)


def test_serve_takes_a_text_prompt_and_numpy_values(model):
    report = serving.serve(model, [(np.float64(0.0), "ROMEO:", np.int64(3)),
                                   (0, np.array(prompt(model)), 2)], budget=np.int32(32))
    assert report["requests"] == 2 and report["budget"] == 32


@pytest.mark.parametrize("kwargs,match", [
    ({"rates": []}, "rates must hold at least one"), ({"rates": "50"}, "rates must be a list"),
    ({"rates": [50, float("nan")]}, r"rates\[1\] must be a finite"),
    ({"rates": [0]}, r"rates\[0\] must be more than 0"),
    ({"budgets": []}, "budgets must hold"), ({"budgets": [1.5]}, r"budgets\[0\]"),
    ({"budgets": [True]}, r"budgets\[0\]"), ({"memories": []}, "memories must hold"),
    ({"memories": ["swap"]}, "memory must be one of"), ({"out": 5}, "out must be a function"),
    ({"n_requests": 0}, "n_requests"), ({"seed": -1}, "seed"),
    ({"max_seconds": float("nan")}, "max_seconds"), ({"progress": "x"}, "progress"),
])
def test_sweep_refuses_each_bad_argument_before_the_warm_up(model, kwargs, match):
    printed = []
    args = {"rates": [200.0], "budgets": [16], "n_requests": 2, "out": printed.append}
    args.update(kwargs)
    with within(10), pytest.raises(ValueError, match=match):
        serving.sweep(model, **args)
    assert printed == []


def test_table_row_and_plot_refuse_bad_rows(tmp_path):
    row = {"rate": 10.0, "memory": "paged", "budget": 16, "tokens_per_s": 5.0,
           "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_p50_ms": float("nan"),
           "tpot_p99_ms": float("nan"), "e2e_p50_ms": 3.0, "e2e_p99_ms": 4.0}
    with pytest.raises(ValueError, match="rate must be a finite"):
        serving.table_row(float("nan"), row)
    assert "paged" in serving.table_row(10.0, row)
    for rows, match in [([], "rows must hold"), ("x", "rows must be a list"),
                        ([5], r"rows\[0\] must be a dict"), ([{"rate": 1.0}], "has no memory"),
                        ([{**row, "rate": 0.0}], r"rows\[0\]\['rate'\]"),
                        ([{**row, "budget": 1.5}], r"rows\[0\]\['budget'\]"),
                        ([{**row, "ttft_p50_ms": -1.0}], "ttft_p50_ms"),
                        ([{**row, "tokens_per_s": float("inf")}], "tokens_per_s")]:
        with pytest.raises(ValueError, match=match):
            serving.plot(rows, tmp_path / "x.png")
    serving.plot([row], tmp_path / "nan.png")           # no TPOT measured: drawn, not a crash
    assert (tmp_path / "nan.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="path must be a file path"):
        serving.plot([row], 5)
    png = io.BytesIO()                                  # as a notebook shows it
    serving.plot([row], png)
    assert png.getvalue().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="title must be text"):
        serving.plot([row], tmp_path / "x.png", title=5)


@pytest.mark.parametrize("option,value", [
    ("--rates", "inf"), ("--rates", "1e-320"), ("--rates", "50,"), ("--budgets", "2147483648"),
    ("--requests", "100001"), ("--seed", "-1"), ("--max-seconds", "0"),
    ("--max-seconds", "nan")])
def test_serve_bench_refuses_each_bad_option_before_loading(capsys, option, value):
    with within(20):
        if option == "--max-seconds":         # argparse's own refusal: SystemExit(2)
            with pytest.raises(SystemExit) as stop:
                cli.main(["serve-bench", option, value, "--model", "/nonexistent"])
            assert stop.value.code == 2
        else:
            assert cli.main(["serve-bench", option, value, "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert option in err and "nonexistent" not in err


# ---- fuzzing: one bad argument at a time, never a hang ---------------------------------

BAD = st.one_of(st.sampled_from([float("nan"), float("inf"), -float("inf"), True, False, None,
                                 "1", b"1", [1], 2**64, -2**64, -1, 0, 0.0, 1.5, -1e-300]),
                st.floats(max_value=0.0), st.integers(max_value=0))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["budget", "num_blocks", "block_size", "max_seconds"]), bad=BAD)
def test_fuzz_serve_arguments(model, name, bad):
    with within(10), pytest.raises(ValueError, match=name):
        serving.serve(model, [(0.0, [1, 2, 3], 2)], **{name: bad})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrival=st.one_of(st.floats(allow_nan=True, allow_infinity=True), BAD),
       new=st.one_of(st.integers(-5, 600), BAD))
def test_fuzz_a_request_is_served_or_refused_quickly(model, arrival, new):
    """Any arrival and new-token count: served (when 0 <= arrival <= 0.3 s and 1 <= new <=
    509) or refused with a ValueError, within seconds; never a hang."""
    with within(20):
        try:
            report = serving.serve(model, [(arrival, [1, 2, 3], new)], max_seconds=0.3)
        except ValueError:
            return
    assert report["requests"] == 1
    assert 0 <= float(arrival) <= 0.3 and 1 <= new <= 509 and not isinstance(new, bool)
