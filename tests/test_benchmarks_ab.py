"""benchmarks/ab.py: the figures a timing script prints, and the best of them per version
over rounds that take the versions in turn."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab  # noqa: E402


def test_figures_are_the_name_value_lines():
    output = "decode tok/s 41.5\nwarming up\nprefill 7\nbad value x\n 3\n"
    assert ab.parse_figures(output) == {"decode tok/s": 41.5, "prefill": 7.0}


def test_run_keeps_the_best_value_of_each_version(tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setattr(ab, "STORE", store)
    for name in ("before", "after"):
        (store / name / "kvlab").mkdir(parents=True)
        (store / name / "kvlab" / "__init__.py").write_text(f"VERSION = {name!r}\n")
    # a kvlab beside the script, as the repository's is beside a script run from its root:
    # the saved copy must be the one imported
    (tmp_path / "kvlab").mkdir()
    (tmp_path / "kvlab" / "__init__.py").write_text("VERSION = 'the working tree'\n")
    # each run prints a figure that depends on the version imported and on the round;
    # the second round is the best
    script = tmp_path / "timing.py"
    script.write_text(
        "import pathlib, kvlab\n"
        "count = pathlib.Path(kvlab.VERSION + '.count')\n"
        "n = int(count.read_text()) + 1 if count.exists() else 1\n"
        "count.write_text(str(n))\n"
        "print('speed', (10 if kvlab.VERSION == 'after' else 5) * [3, 9, 4][n - 1])\n")
    best = ab.run(script, ["before", "after"], rounds=3)
    assert best == {"speed": {"before": 45.0, "after": 90.0}}


def test_a_failing_script_names_the_version(tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "STORE", tmp_path)
    (tmp_path / "broken" / "kvlab").mkdir(parents=True)
    script = tmp_path / "timing.py"
    script.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SystemExit, match="under broken"):
        ab.run(script, ["broken"], rounds=1)
