"""The graded labs (kvlab.grading, kvlab/labs/, instructor/): every starter scores 0, every
reference solution scores full marks, and every planted mistake loses exactly the points
of the tests meant to catch it. Also what the grader does with broken submissions, the
results.json it writes, and the `kvlab lab` / `kvlab grade` commands."""
import ast
import json
from pathlib import Path

import pytest

pytest.importorskip("kvlab._kvlab")
from kvlab import cli  # noqa: E402
from kvlab.grading import LABS, grade, start_lab  # noqa: E402

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"
MISTAKES = sorted((INSTRUCTOR / "mistakes").glob("*/*.py"))


def expected_failures(path: Path) -> set:
    """The EXPECTED_FAILURES list a mistake file declares (read without running it)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "EXPECTED_FAILURES":
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} declares no EXPECTED_FAILURES")


@pytest.mark.parametrize("lab", list(LABS))
def test_every_lab_has_its_files(lab):
    spec = LABS[lab]
    for path in (spec.starter, spec.grader, spec.instructions, INSTRUCTOR / "solutions" / f"{lab}.py"):
        assert path.is_file(), f"lab {lab} is missing {path}"
    assert list((INSTRUCTOR / "mistakes" / lab).glob("*.py")), f"lab {lab} has no planted mistakes"
    assert "NotImplementedError" in spec.starter.read_text()


@pytest.mark.parametrize("lab", list(LABS))
def test_the_starter_scores_zero(lab):
    report = grade(lab, LABS[lab].starter)
    assert report.max_score >= 5 and len(report.tests) >= 4, report.summary()
    assert report.score == 0, report.summary()
    # a student who has written nothing is told so, test by test
    assert all("not written yet" in t.output for t in report.tests), report.summary()


@pytest.mark.parametrize("lab", list(LABS))
def test_the_reference_solution_scores_full_marks(lab):
    report = grade(lab, INSTRUCTOR / "solutions" / f"{lab}.py")
    assert report.score == report.max_score > 0, report.summary()


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{p.parent.name}/{p.stem}" for p in MISTAKES])
def test_a_planted_mistake_loses_the_right_points(mistake, tmp_path):
    lab = mistake.parent.name
    # the mistake's functions come after the solution's, so they replace them
    submission = tmp_path / f"{lab}.py"
    submission.write_text((INSTRUCTOR / "solutions" / f"{lab}.py").read_text() + "\n\n"
                          + mistake.read_text())
    report = grade(lab, submission)
    expected = expected_failures(mistake)
    assert expected <= {t.name.split(":")[0] for t in report.tests}, "unknown test names"
    assert set(report.failed()) == expected, report.summary()
    lost = sum(t.max_score for t in report.tests if t.name.split(":")[0] in expected)
    assert report.score == report.max_score - lost


def test_a_file_that_does_not_import_scores_zero_and_says_why(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def kv_bytes_per_token(:\n")
    report = grade("cache_size", broken)
    assert report.score == 0 and report.tests
    assert all("could not import your file" in t.output and "SyntaxError" in t.output
               for t in report.tests), report.summary()


def test_an_endless_loop_costs_only_its_own_tests(tmp_path):
    solution = (INSTRUCTOR / "solutions" / "cache_size.py").read_text()
    looping = tmp_path / "looping.py"
    looping.write_text(solution + "\n\ndef max_requests(*args, **kwargs):\n    while True:\n        pass\n")
    report = grade("cache_size", looping, test_timeout=5.0)
    assert set(report.failed()) == {"test_max_requests", "test_max_requests_returns_a_whole_number"}
    assert all("ran too long" in t.output for t in report.tests if not t.passed)


def test_a_submission_that_exits_or_hangs_at_import_is_graded_zero(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import os\nos._exit(3)\n")
    report = grade("cache_size", exits)
    assert report.score == 0 and len(report.tests) >= 4 and "did not finish" in report.output
    hangs = tmp_path / "hangs.py"
    hangs.write_text("while True:\n    pass\n")
    report = grade("cache_size", hangs, test_timeout=1.0)
    assert report.score == 0 and all("ran too long" in t.output for t in report.tests)


def test_results_json_is_gradescope_shaped(tmp_path):
    out = tmp_path / "results.json"
    report = grade("cache_size", INSTRUCTOR / "solutions" / "cache_size.py", results=out)
    data = json.loads(out.read_text())
    assert data["score"] == data["max_score"] == report.max_score
    assert sum(t["max_score"] for t in data["tests"]) == data["max_score"]
    for test in data["tests"]:
        assert set(test) >= {"name", "score", "max_score", "output", "visibility"}
        assert test["visibility"] in ("visible", "hidden", "after_due_date", "after_published")


def test_lab_start_copies_the_starter_and_will_not_overwrite(tmp_path, capsys):
    assert cli.main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in LABS)
    assert cli.main(["lab", "start", "cache_size", str(tmp_path)]) == 0
    copied = tmp_path / "cache_size.py"
    assert copied.read_text() == LABS["cache_size"].starter.read_text()
    assert (tmp_path / "cache_size.md").is_file()
    copied.write_text("# my work\n")
    assert cli.main(["lab", "start", "cache_size", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err and copied.read_text() == "# my work\n"
    with pytest.raises(ValueError, match="no lab named"):
        start_lab("no_such_lab", tmp_path)


def test_kvlab_grade_prints_a_summary_and_writes_results(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["grade", "cache_size", str(LABS["cache_size"].starter)]) == 0
    out = capsys.readouterr().out
    assert "lab cache_size: 0 /" in out and "FAIL" in out
    assert json.loads((tmp_path / "results.json").read_text())["score"] == 0
