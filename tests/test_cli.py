"""The `kvlab` command line, called in-process through kvlab.cli.main."""
import argparse
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


def test_demo_explains_the_repetition_and_the_positions_it_reserved(capsys, tmp_path):
    import kvlab
    model = kvlab.load()
    out_json = tmp_path / "demo.json"
    assert cli.main(["demo", "--max-new-tokens", "40", "--quiet", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "greedy decoding" in printed and "repeats" in printed
    # what the demo says it reserved is what the cache holds: prompt + new - 1 positions
    prompt_tokens = len(model.encode(cli.DEMO_PROMPT))
    positions = prompt_tokens + 40 - 1
    assert f"= {positions} positions for {prompt_tokens} prompt + 40 new tokens - 1" in printed
    assert "never run through the model" in printed
    c = model.config
    assert json.loads(out_json.read_text())["cache_nbytes"] == positions * 2 * c.n_layers * c.kv_dim * 4


def test_generate_and_info(capsys):
    assert cli.main(["generate", "--prompt", "KING:", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("KING:")
    assert cli.main(["info"]) == 0
    assert "parameters" in capsys.readouterr().out


def test_info_says_which_kernels_run_and_why(capsys):
    from kvlab import _kvlab
    assert cli.main(["info"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kernels")]
    assert f"{_kvlab.VARIANT} variant, fast tier: {_kvlab.VARIANT_REASON}" in line


def test_info_says_whether_the_gpu_can_be_used_and_why_not(capsys):
    # a student on Colab asks `kvlab info` before the CUDA lab: the line is kvlab.cuda's answer
    import kvlab.cuda
    assert cli.main(["info"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU")]
    reason = kvlab.cuda.why_not()
    expected = "usable (kvlab.cuda)" if reason is None else " ".join(reason.split())
    assert line.split(None, 1)[1] == expected


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


@pytest.mark.parametrize("options, said", [
    (["--top-k", "5"], "give --temperature above 0"),
    (["--top-p", "0.9"], "give --temperature above 0"),
    (["--window", "8"], "give --cache-dtype")])
def test_generate_refuses_options_that_would_change_nothing(capsys, options, said):
    # (they were ignored: greedy decoding with a top-k, an fp32 window beside an fp32 cache)
    assert cli.main(["generate", "--prompt", "KING:", *options]) == 2
    assert said in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "KING:", "--max-new-tokens", "2",
                     "--temperature", "0.8", "--cache-dtype", "int8", *options]) == 0


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


def _commands() -> dict:
    """Each subcommand's parser, by name."""
    parser = cli.build_parser()
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))


def test_the_description_is_the_docstrings_whole_first_paragraph(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    first_paragraph = " ".join(cli.__doc__.split("\n\n")[0].split())
    assert first_paragraph.endswith(".") and first_paragraph in shown
    # a first sentence that wraps onto a second line is not cut at the line's end
    monkeypatch.setattr(cli, "__doc__", "The command line: it runs\nthe model.\n\nMore.\n")
    assert cli.build_parser().description == "The command line: it runs the model."


def test_every_option_of_every_command_has_help_and_shows_its_default():
    for name, command in _commands().items():
        shown = " ".join(command.format_help().split())
        assert "(default: None)" not in shown and "(default: False)" not in shown, name
        for action in command._actions:
            assert action.help, f"kvlab {name} {'/'.join(action.option_strings) or action.dest}"
            if action.default in (None, False, argparse.SUPPRESS) or "default" in action.help:
                continue
            assert f"(default: {action.default})" in shown, (name, action.dest)
    shown = " ".join(_commands()["generate"].format_help().split())
    for default in ("(default: 100)", "(default: 0.0)", "(default: fp32)", "(default: 4)"):
        assert default in shown


def test_version_prints_kvlabs_version(capsys):
    import kvlab
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"kvlab {kvlab.__version__}\n"


def test_a_checkpoint_without_a_tokenizer_asks_for_the_command_line_option(capsys, tmp_path):
    import kvlab
    from kvlab.loaders import save_hf_llama
    bundled = kvlab.load()
    folder = tmp_path / "hf"
    save_hf_llama(folder, bundled.config, bundled.weights)    # config.json + safetensors only
    for command in (["generate", "--prompt", "KING:"], ["demo", "--quiet"], ["bench", "--quiet"]):
        assert cli.main(command + ["--model", str(folder)]) == 2
        err = capsys.readouterr().err
        assert "--tokenizer PATH" in err and "tokenizer=PATH" not in err, err
        assert f"kvlab {command[0]}" in err
    assert cli.main(["info", "--model", str(folder)]) == 0    # needs no tokenizer
    # the Python API keeps its own words: the keyword argument
    with pytest.raises(kvlab.TokenizerError, match="tokenizer=PATH"):
        kvlab.generate(kvlab.load(folder), "KING:", 2)


def test_bench_plot_without_matplotlib_fails_before_running_anything(capsys, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib fails
    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: pytest.fail("the benchmark ran"))
    out_png = tmp_path / "bench.png"
    assert cli.main(["bench", "--quiet", "--plot", str(out_png)]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "pip install matplotlib" in err and not out_png.exists()


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
