"""kvlab.serving and benchmarks/bench_serve.py: a Poisson load's requests all come back, with latencies that
make sense, and a short run writes its table's numbers to JSON."""
import json
import sys
from pathlib import Path

import pytest

import kvlab

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_serve  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def test_the_workload_arrives_in_order_at_about_the_rate(model):
    requests = kvlab.serving.workload(model, 200, rate=50.0, seed=1)
    arrivals = [r[0] for r in requests]
    assert arrivals == sorted(arrivals) and 2.0 < arrivals[-1] < 6.0     # 200 at 50/s: ~4 s
    assert all(8 <= len(prompt) < 96 and 16 <= new < 96 for _, prompt, new in requests)


def test_a_short_run_serves_every_request_and_writes_json(model, tmp_path):
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--rates", "200", "--requests", "6", "--budgets", "32",
                             "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["requests"] == 6 and run["tokens_per_s"] > 0
    assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"] <= run["e2e_p99_ms"]
    assert 0 < run["tpot_p50_ms"] <= run["tpot_p99_ms"]


def test_kvlab_serve_bench_prints_the_table(capsys, tmp_path):
    from kvlab import cli
    out = tmp_path / "serve.json"
    assert cli.main(["serve-bench", "--rates", "200", "--requests", "4", "--budgets", "16",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and json.loads(out.read_text())["runs"][0]["requests"] == 4
    assert "1 run, waiting for their arrivals alone" in printed          # said up front
    # bad arguments are named, before the model loads (more in test_reliability_serving.py)
    for option, value in [("--rates", "0"), ("--rates", "abc"), ("--rates", "nan"),
                          ("--budgets", "0"), ("--budgets", "1.5"), ("--memory", "swap")]:
        assert cli.main(["serve-bench", option, value, "--model", "/nonexistent"]) == 2
        assert f"{option} takes" in capsys.readouterr().err
    # a rate whose run would wait for hours, and a --json that cannot be written: refused
    # before the model loads, not after every run
    assert cli.main(["serve-bench", "--rates", "0.001", "--model", "/nonexistent"]) == 2
    assert "--max-seconds is 600" in capsys.readouterr().err
    assert cli.main(["serve-bench", "--json", str(tmp_path / "no" / "out.json"),
                     "--model", "/nonexistent"]) == 2
    assert "--json" in capsys.readouterr().err


def test_contiguous_memory_reserves_a_whole_context_per_request(model):
    # the same bytes as 512 blocks of 16 are 16 contiguous caches of the bundled model's 512
    requests = kvlab.serving.workload(model, 24, rate=500.0, seed=2)
    paged = kvlab.serving.serve(model, requests, budget=256, memory="paged")
    contiguous = kvlab.serving.serve(model, requests, budget=256, memory="contiguous")
    assert paged["requests"] == contiguous["requests"] == 24
    assert contiguous["memory"] == "contiguous" and paged["memory"] == "paged"
    # at most 16 requests hold a cache at once: more steps for the same tokens
    assert contiguous["steps"] > paged["steps"]
    with pytest.raises(ValueError, match="memory must be one of"):
        kvlab.serving.serve(model, requests, memory="virtual")
    with pytest.raises(ValueError, match="no contiguous cache fits"):
        kvlab.serving.serve(model, requests, num_blocks=2, memory="contiguous")
    # a context longer than a block may be is refused plainly, before anything runs
    long = kvlab.Model(model.config.replace(max_seq_len=8192), model.weights)
    with pytest.raises(ValueError, match="blocks hold at most 4096 positions: this model's "
                                         "context is 8192"):
        kvlab.serving.sweep(long, [100.0], [16], memories=("paged", "contiguous"))


def test_serve_bench_plots_both_memories(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from kvlab import cli
    png = tmp_path / "serve.png"
    assert cli.main(["serve-bench", "--rates", "300,600", "--requests", "4", "--budgets", "32",
                     "--memory", "paged,contiguous", "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "contiguous" in printed and png.stat().st_size > 10_000
