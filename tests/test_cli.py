"""The `kvlab` command line, called in-process through kvlab.cli.main."""
import json
import subprocess
import sys

import pytest

from kvlab import cli


def test_demo_reports_identical_text_and_a_speedup(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    assert cli.main(["demo", "--max-new-tokens", "40", "--quiet", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "identical text:   yes" in printed
    assert "speedup:" in printed and "per token" in printed
    result = json.loads(out_json.read_text())
    assert result["identical"] is True and result["speedup"] > 0


def test_generate_and_info(capsys):
    assert cli.main(["generate", "--prompt", "KING:", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("KING:")
    assert cli.main(["info"]) == 0
    assert "parameters" in capsys.readouterr().out


def test_weights_in_fewer_bytes_from_the_command_line(capsys):
    assert cli.main(["info", "--weights", "int8"]) == 0
    assert "1,164,288 B (1.1 MiB), q8_0, int8 activations" in capsys.readouterr().out
    assert cli.main(["info", "--weights", "q8_0", "--activations", "fp32"]) == 0
    assert "q8_0, fp32 activations" in capsys.readouterr().out
    assert cli.main(["generate", "--weights", "bf16", "--prompt", "KING:",
                     "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.startswith("KING:")


def test_generate_with_speculation_prints_the_same_text_and_what_it_saved(capsys):
    import kvlab
    base = ["generate", "--prompt", "ROMEO:\nROMEO:\nROMEO:", "--max-new-tokens", "40"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    for drafter in ("lookup", "layers:2", str(kvlab.MHA_MODEL)):
        assert cli.main(base + ["--speculate", drafter, "--draft-tokens", "3"]) == 0
        captured = capsys.readouterr()
        assert captured.out == plain                      # greedy: the same text
        assert "[speculation: " in captured.err and "drafts kept" in captured.err
    with pytest.raises(SystemExit, match="layers:N needs a number"):
        cli.main(base + ["--speculate", "layers:two"])


def test_generate_with_a_cache_policy_runs_past_the_context(capsys):
    import kvlab
    n = kvlab.load().config.max_seq_len + 10
    args = ["generate", "--prompt", "KING:", "--max-new-tokens", str(n)]
    assert cli.main(args + ["--cache-policy", "sinks:32"]) == 0
    captured = capsys.readouterr()
    assert f"[{n} tokens" in captured.err and "AttentionSinks(sinks=4, window=28)" in captured.err
    for bad in ("window", "window:x", "lru:8", "sinks:1"):
        with pytest.raises(SystemExit, match="--cache-policy"):
            cli.main(args + ["--cache-policy", bad])


def test_generate_on_a_quantized_cache(capsys):
    args = ["generate", "--prompt", "KING:", "--max-new-tokens", "20", "--cache-dtype", "int8"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("KING:")
    # 24 positions of int8 K and V (16 codes + a 4-byte scale per head), 6 layers, 2 heads
    assert f"int8 KV cache of {24 * 6 * 2 * 2 * 20:,} B" in captured.err


def test_missing_checkpoint_is_a_clean_error(capsys, tmp_path):
    assert cli.main(["info", "--model", str(tmp_path / "nope.bin")]) == 2
    assert "error" in capsys.readouterr().err


def test_python_dash_m_works_outside_the_source_tree(tmp_path):
    import os
    from pathlib import Path

    import kvlab
    # the same kvlab these tests import, run from a folder with no source tree in it
    env = {**os.environ, "PYTHONPATH": str(Path(kvlab.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-m", "kvlab", "info"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Model(" in result.stdout


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit):
        cli.main(["generate"])          # --prompt is required


def test_bench_writes_a_table_json_and_a_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert cli.main(["bench", "--max-new-tokens", "24", "--quiet", "--json", str(out_json),
                     "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "identical text: yes" in printed and "GFLOP (counted)" in printed
    result = json.loads(out_json.read_text())
    assert len(result["cached"]["step_seconds"]) == 24
    assert result["uncached"]["counts"]["flops_attention"] > result["cached"]["counts"]["flops_attention"]
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"
