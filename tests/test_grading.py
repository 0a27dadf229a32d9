"""The graded labs end to end (kvlab/grading, kvlab/labs, instructor/): every starter scores 0,
every reference solution full marks, every planted mistake loses exactly the points of the
tests meant to catch it; the public checks; what a student sees for a broken file; the
results.json; and the `kvlab lab` / `kvlab check` / `kvlab grade` commands.

What a submission cannot do to its grade is in test_grading_cheats.py; the parts (values on
the wire, the import policy, worker processes) in test_grading_parts.py; the Gradescope
package in test_autograder.py.
"""
import ast
import importlib.util
import json
import re
import zlib
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pytest
from c_edits import apply_edit, declared
from grader_tests import grader_tests

pytest.importorskip("kvlab._kvlab")
import kvlab  # noqa: E402
from kvlab import cli  # noqa: E402
from kvlab.grading import LABS, check, grade, start_lab  # noqa: E402
from named_models import require_named_models  # noqa: E402
from trimmed_graders import slow_tests, unreachable, without_tests  # noqa: E402

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"
CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
MISTAKES = sorted((INSTRUCTOR / "mistakes").glob("*/*.py"))
C_MISTAKES = sorted((INSTRUCTOR / "mistakes").glob("*/*.edit"))    # a C lab's (c_edits.py)


def graders(lab):
    return INSTRUCTOR / "graders" / f"{lab}.py"


def hidden(lab, submission, seed=1, tests=None, **options):
    require_named_models(LABS[lab].models)        # cache_eviction's curves run SmolLM2
    return grade(lab, submission, tests=tests or graders(lab), seed=seed, **options)


def solution(lab):
    return INSTRUCTOR / "solutions" / f"{lab}{LABS[lab].suffix}"


def timed_tests(tests_path):
    """The tests whose passing depends on the machine's speed (the kernel lab's bandwidth
    tests): the suite checks what they say, not whether this machine was fast enough."""
    return {t.__name__ for t in grader_tests(tests_path) if getattr(t, "timed", False)}


def assert_full_marks_but_for_speed(report, tests_path):
    """Every test passed, or (a timed one) failed only for the share it measured."""
    timed = timed_tests(tests_path)
    assert set(report.failed()) <= timed, report.summary()
    assert all("reached" in t.output and "of the read bandwidth" in t.output
               for t in report.tests if not t.passed), report.summary()


def expected_failures(path: Path) -> set:
    """The EXPECTED_FAILURES list a mistake file declares (read without running it)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "EXPECTED_FAILURES":
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} declares no EXPECTED_FAILURES")


@pytest.mark.parametrize("lab", list(LABS))
def test_every_lab_has_its_files(lab):
    spec = LABS[lab]
    for path in (spec.starter, spec.checks, spec.instructions, graders(lab), solution(lab)):
        assert path.is_file(), f"lab {lab} is missing {path}"
    planted = "*.py" if spec.language == "python" else "*.edit"
    assert list((INSTRUCTOR / "mistakes" / lab).glob(planted)), f"lab {lab} has no planted mistakes"
    assert ("NotImplementedError" if spec.language == "python" else "NOT_WRITTEN()") \
        in spec.starter.read_text()


@pytest.mark.parametrize("lab", list(LABS))
def test_the_points_the_lab_list_shows_are_the_hidden_tests_points(lab):
    assert sum(t.points for t in grader_tests(graders(lab))) == LABS[lab].points


def test_the_package_holds_no_grading_tests():
    """The hidden tests are in instructor/ only: the installed package (the wheel, in CI)
    has the public checks and nothing of the graders."""
    package = Path(kvlab.__file__).resolve().parent
    names = {t.__name__ for lab in LABS for t in grader_tests(graders(lab))}
    public = {t.__name__ for lab in LABS for t in grader_tests(LABS[lab].checks)}
    for path in package.rglob("*.py"):
        assert not path.name.startswith("test_"), f"{path} looks like a test file in the package"
        words = set(re.findall(r"\w+", path.read_text()))
        leaked = (names - public) & words
        assert not leaked, f"{path} names hidden tests {sorted(leaked)}"
    assert not list(package.rglob("graders")) and not list(package.rglob("solutions"))


@pytest.mark.parametrize("lab", list(LABS))
def test_the_starter_scores_zero_and_is_told_what_is_missing(lab):
    report = hidden(lab, LABS[lab].starter)
    assert report.max_score == LABS[lab].points and len(report.tests) >= 4, report.summary()
    assert report.score == 0, report.summary()
    assert all("not written yet" in t.output for t in report.tests), report.summary()


@pytest.mark.parametrize("lab", list(LABS))
@pytest.mark.parametrize("seed", [1, 2])
def test_the_reference_solution_scores_full_marks(lab, seed):
    report = hidden(lab, solution(lab), seed=seed)
    assert report.max_score == LABS[lab].points, report.summary()
    assert_full_marks_but_for_speed(report, graders(lab))
    assert report.graded_with == "hidden tests" and report.seed == seed


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{p.parent.name}/{p.stem}" for p in MISTAKES])
def test_a_planted_mistake_loses_the_right_points(mistake, tmp_path):
    lab = mistake.parent.name
    # the mistake's functions come after the solution's, so they replace them
    submission = tmp_path / f"{lab}.py"
    submission.write_text((INSTRUCTOR / "solutions" / f"{lab}.py").read_text() + "\n\n"
                          + mistake.read_text())
    seed = zlib.crc32(mistake.stem.encode())           # a different draw for each mistake
    expected = expected_failures(mistake)
    # A slow test (lab 13's runs on SmolLM2, about 31 s of CPU) that the mistake provably
    # cannot reach is left out: it would run only the solution's code, its outcome the
    # reference solution's on this draw (graded in full above, on two), and would only
    # cost CI time. The proof is read from the code (tests/support/trimmed_graders.py);
    # where it cannot be made, the test runs and must pass.
    left_out = {test for test in slow_tests(graders(lab)) - expected
                if unreachable(test, graders(lab), solution(lab), mistake.read_text())}
    report = hidden(lab, submission, seed=seed,
                    tests=without_tests(graders(lab), left_out, tmp_path))
    assert expected <= {t.function for t in report.tests}, "unknown test names"
    assert set(report.failed()) == expected, report.summary()
    lost = sum(t.max_score for t in report.tests if t.function in expected)
    assert report.score == report.max_score - lost


def test_a_mistake_leaves_out_only_the_slow_tests_it_provably_cannot_reach(tmp_path):
    """What the test above leaves out: lab 13's whole-model test calls only search_scales,
    whose code a wrong fold_into_norm is not part of; a wrong rounding is (search_scales
    calls it), and so is anything the proof cannot follow."""
    lab, kl = "weight_quantization", "test_your_scales_beat_round_to_nearest_on_smollm2"
    folder = INSTRUCTOR / "mistakes" / lab

    def reaches(mistake_source, test=kl, lab=lab):
        return not unreachable(test, graders(lab), solution(lab), mistake_source)
    assert slow_tests(graders(lab)) == {kl, "test_your_search_on_smollm2s_layers"}
    assert not reaches((folder / "fold_multiplies_the_norm.py").read_text())
    assert not reaches((folder / "fold_multiplies_the_norm.py").read_text(),
                       "test_your_search_on_smollm2s_layers")
    for name in ("scale_not_stored_as_half", "scales_from_the_largest_activation"):
        assert reaches((folder / f"{name}.py").read_text()), name
    fold = (folder / "fold_multiplies_the_norm.py").read_text()
    # code run at import, a decorator, a name bound to what a call returns: anything goes
    for added in ("print('hi')\n", "@staticmethod\ndef f():\n    pass\n", "g = len([])\n",
                  "def f(x=len([])):\n    pass\n"):
        assert reaches(fold + added), added
    # a name the solution's search uses, bound over again
    assert reaches(fold + "channel_scales = fold_into_norm\n")
    # the submission handed to kvlab's own code (cache_eviction's curves): not followed
    assert reaches("def rotate(x, shift, inv_freq, interleaved):\n    return x\n",
                   "test_sinks_curve_on_smollm2", "cache_eviction")
    assert reaches("def sink_rows(length, n_keep, sinks):\n    return None\n",
                   "test_heavy_hitters_curve_on_smollm2", "cache_eviction")
    # and the grader written without them lacks exactly them (read, not loaded: loading
    # runs its prepare(), SmolLM2's load)
    def functions(path):
        return [node.name for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.FunctionDef)]
    trimmed = without_tests(graders(lab), {kl}, tmp_path)
    assert functions(trimmed) == [name for name in functions(graders(lab)) if name != kl]
    assert without_tests(graders(lab), set(), tmp_path) == graders(lab)


@pytest.mark.parametrize("mistake", C_MISTAKES, ids=[f"{p.parent.name}/{p.stem}" for p in C_MISTAKES])
def test_a_planted_mistake_in_c_loses_the_right_points(mistake, tmp_path):
    """A C lab's mistakes are edits of one of its solutions (tests/support/c_edits.py); the
    tests a mistake fails include the timed ones, which check every output first."""
    lab = mistake.parent.name
    submission = tmp_path / f"{lab}.c"
    submission.write_text(apply_edit(mistake, INSTRUCTOR / "solutions"))
    report = hidden(lab, submission, seed=zlib.crc32(mistake.stem.encode()))
    expected = declared(mistake, "EXPECTED_FAILURES")
    assert expected <= {t.function for t in report.tests}, "unknown test names"
    # every mistake is wrong on the timed layer too, so none of what it keeps or loses
    # depends on this machine's speed (its base, the plain tier transcribed, is slow)
    assert timed_tests(graders(lab)) <= expected
    assert set(report.failed()) == expected, report.summary()
    lost = sum(t.max_score for t in report.tests if t.function in expected)
    assert report.score == report.max_score - lost


@pytest.mark.parametrize("lab", list(LABS))
def test_the_public_checks_pass_the_solution_and_fail_the_starter(lab):
    good = check(lab, solution(lab))
    assert good.max_score >= 3 and good.graded_with == "public checks", good.summary()
    assert_full_marks_but_for_speed(good, LABS[lab].checks)
    assert good.seed is None
    starter = check(lab, LABS[lab].starter)
    assert starter.score == 0 and all("not written yet" in t.output for t in starter.tests)


def test_without_instructor_grade_uses_the_public_checks_and_says_so(monkeypatch):
    # as installed from a wheel: no instructor/ beside the package, none named
    monkeypatch.setattr("kvlab.grading.runner.find_instructor", lambda explicit=None: None)
    report = grade("cache_size", INSTRUCTOR / "solutions" / "cache_size.py")
    assert report.graded_with == "public checks" and report.score == report.max_score
    assert "public checks" in report.summary()


def test_a_syntax_error_is_reported_once_with_its_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\n\ndef kv_bytes_per_token(:\n    pass\n")
    report = hidden("cache_size", broken)
    assert report.score == 0 and report.tests
    assert "syntax error at line 3" in report.output, report.output
    assert all(t.output == "not graded: your file has a syntax error (see above)" for t in report.tests)
    assert report.summary().count("line 3") == 1


@pytest.mark.parametrize("what, bytes_added, said", [
    ("a NUL byte", b"\n# \x00\n", "not graded"),
    ("an expression nested past the parser", b"\nx = " + b"-" * 3000 + b"1\n", "not graded"),
    ("an expression nested past the source check", b"\nx = " + b"-" * 600 + b"1\n",
     "not graded")])
def test_a_file_python_cannot_read_scores_zero_and_says_why(tmp_path, what, bytes_added, said):
    # (these raised out of the judge: ValueError on some Pythons for the NUL byte, and
    # RecursionError for deep nesting, so Gradescope got no results.json)
    path = tmp_path / "cache_size.py"
    path.write_bytes((INSTRUCTOR / "solutions" / "cache_size.py").read_bytes() + bytes_added)
    report = hidden("cache_size", path)
    assert report.score == 0 and report.tests, what
    assert all(t.output.startswith(said) for t in report.tests), report.tests[0].output
    assert "line None" not in report.output


def utf7_submission(tmp_path, first_line: bytes):
    """The cache_size solution saved so that, read as utf-7, a line the check reads as a
    comment ("+AAo-" is a newline in utf-7) writes a marker file; and that marker."""
    marker = tmp_path / "ran"
    solution = (INSTRUCTOR / "solutions" / "cache_size.py").read_text()
    # utf-7 gives '+' a meaning: the solution's one '+=' said without it
    solution = solution.replace("per_token += 2 * config.n_layers * config.n_kv_heads * 4",
                                "per_token = per_token - (-2 * config.n_layers * config.n_kv_heads * 4)")
    hidden_code = f"open({str(marker)!r}, 'w').write('ran')".encode("utf-7")
    path = tmp_path / "cache_size.py"
    path.write_bytes(first_line + solution.encode() + b"\n# +AAo-" + hidden_code + b"\n")
    return path, marker


@pytest.mark.parametrize("first_line", [b"# coding: utf-7\n", b"# coding: latin-1\n",
                                        b"# coding: no-such-encoding\n",
                                        b"\r# coding: utf-7\n", b"  \r# coding: utf-7\n"],
                         ids=["utf-7", "latin-1", "unknown", "after a lone CR",
                              "after spaces and a lone CR"])
def test_a_file_in_another_encoding_is_not_graded(tmp_path, first_line):
    # Python runs a file in the encoding its coding line names (and finds that line after
    # a lone \r, as tokenize.detect_encoding does not), the check reads UTF-8: in utf-7,
    # "+AAo-" is a newline to Python and part of a comment to the check, so code the check
    # never saw would run. Refused before anything runs.
    path, marker = utf7_submission(tmp_path, first_line)
    report = hidden("cache_size", path)
    assert report.score == 0 and "encoding" in report.output, report.output
    assert not marker.exists()


def test_the_worker_runs_the_text_the_check_read_whatever_the_bytes_declare(tmp_path,
                                                                            monkeypatch):
    # the deeper guard: with the judge's encoding check out of the way, the worker compiles
    # the checked text (a str: its coding line means nothing), so the payload stays a
    # comment and the solution is graded as the check read it
    from kvlab.grading import judge
    monkeypatch.setattr(judge.tokenize, "detect_encoding", lambda readline: ("utf-8", []))
    path, marker = utf7_submission(tmp_path, b"\r# coding: utf-7\n")
    # the judge in this process (grade() starts one of its own), its workers as always
    report = judge.Judge(LABS["cache_size"], path, graders("cache_size"), "hidden tests",
                         seed=1).run()
    assert not marker.exists(), "code the check never read ran"
    assert report.score == report.max_score, report.summary()


def test_a_byte_order_mark_is_not_code(tmp_path):
    # Windows editors may save UTF-8 with a BOM; Python runs such a file, and so grading does
    path = tmp_path / "cache_size.py"
    path.write_bytes(b"\xef\xbb\xbf" + (INSTRUCTOR / "solutions" / "cache_size.py").read_bytes())
    report = hidden("cache_size", path)
    assert report.score == report.max_score, report.summary()


def test_an_import_error_is_reported_once_with_its_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\n\nx = 1 / 0\n")
    report = hidden("cache_size", broken)
    assert report.score == 0
    assert "could not be imported" in report.output and "ZeroDivisionError" in report.output
    assert "line 3 of your file" in report.output
    assert all("see above" in t.output for t in report.tests)


def test_failure_messages_carry_no_pytest_internals_or_addresses(tmp_path):
    wrong = tmp_path / "attention.py"
    wrong.write_text((INSTRUCTOR / "solutions" / "attention.py").read_text() + """

def attend(q, keys, values):
    return np.zeros_like(q) + 1
""")
    report = hidden("attention", wrong)
    text = report.summary() + json.dumps(report.gradescope())
    assert report.score < report.max_score
    for noise in ("0x7f", " at 0x", "np.False_", "where np.", "assert np", "Traceback"):
        assert noise not in text, (noise, text)
    failed = [t for t in report.tests if not t.passed]
    assert all(t.output.count("\n") < 10 for t in failed), [t.output for t in failed]
    assert any("off by up to" in t.output and "expected" in t.output for t in failed)


def test_an_endless_loop_costs_only_its_own_tests_and_says_where_it_was(tmp_path):
    solution = (INSTRUCTOR / "solutions" / "cache_size.py").read_text()
    looping = tmp_path / "looping.py"
    looping.write_text(solution + "\n\ndef max_requests(*args, **kwargs):\n    while True:\n        pass\n")
    line = len(solution.splitlines()) + 4                  # the loop's `while` or `pass`
    # 6 s: every test of this grading has the limit, and the honest ones (filling real caches
    # through the lent model, many round trips) must finish within it on a CI machine that
    # runs the other half of the tests beside this one (.ci/run)
    report = hidden("cache_size", looping, test_timeout=6.0)
    assert set(report.failed()) == {"test_max_requests", "test_max_requests_returns_a_whole_number"}
    for test in report.tests:
        if not test.passed:
            assert "ran too long" in test.output and "in max_requests" in test.output, test.output
            assert f"line {line} " in test.output or f"line {line + 1} " in test.output
            assert "0x" not in test.output and "most recent call" not in test.output


def test_a_function_the_file_lacks_is_named(tmp_path):
    partial = tmp_path / "partial.py"
    partial.write_text("def kv_bytes_per_token(n_layers, n_kv_heads, head_dim, size):\n"
                       "    return 2 * n_layers * n_kv_heads * head_dim * size\n")
    report = hidden("cache_size", partial)
    lacking = [t for t in report.tests if t.function == "test_max_requests"][0]
    assert "your file defines no `max_requests`" in lacking.output, lacking.output


def test_trying_things_under_main_is_not_refused(tmp_path):
    trying = tmp_path / "cache_size.py"
    trying.write_text((INSTRUCTOR / "solutions" / "cache_size.py").read_text() + """

if __name__ == "__main__":
    import kvlab
    print(measure_resident_growth(kvlab.load(), 128, 8), kvlab.kv_cache_bytes)
""")
    report = hidden("cache_size", trying)
    assert report.score == report.max_score, report.summary()


def test_a_submission_that_exits_or_hangs_at_import_scores_zero(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    report = hidden("cache_size", exits)
    assert report.score == 0 and len(report.tests) >= 4 and "SystemExit" in report.output
    ends = tmp_path / "ends.py"
    ends.write_text("import os\nos._exit(0)\n")
    report = hidden("cache_size", ends)
    assert report.score == 0 and "exit status 0" in report.output
    hangs = tmp_path / "hangs.py"
    hangs.write_text("while True:\n    pass\n")
    report = hidden("cache_size", hangs, test_timeout=1.0)
    assert report.score == 0 and "ran too long while it was imported" in report.output
    assert all("see above" in t.output for t in report.tests)


def test_printed_output_is_shown_with_a_failed_test_and_bounded(tmp_path):
    chatty = tmp_path / "chatty.py"
    chatty.write_text((INSTRUCTOR / "solutions" / "cache_size.py").read_text() + """

def kv_bytes_per_token(*args):
    print("my debugging line")
    print("x" * 1_000_000)
    return 0
""")
    report = hidden("cache_size", chatty)
    failed = [t for t in report.tests if not t.passed]
    assert failed and all("your code printed" in t.output for t in failed)
    assert all(len(t.output) < 3000 for t in report.tests)


def test_results_json_is_gradescope_shaped(tmp_path):
    out = tmp_path / "results.json"
    report = hidden("cache_size", INSTRUCTOR / "solutions" / "cache_size.py", results=out)
    data = json.loads(out.read_text())
    assert data["score"] == report.max_score == sum(t["max_score"] for t in data["tests"])
    assert set(data) <= {"score", "execution_time", "output", "output_format", "visibility",
                         "stdout_visibility", "extra_data", "tests", "leaderboard"}
    for test in data["tests"]:
        assert set(test) <= {"score", "max_score", "status", "name", "name_format", "number",
                             "output", "output_format", "tags", "visibility", "extra_data"}
        assert test["status"] in ("passed", "failed")
        assert test["visibility"] in ("visible", "hidden", "after_due_date", "after_published")
        assert isinstance(test["score"], float) and isinstance(test["name"], str)


def test_a_passed_test_that_returns_a_string_reports_it(tmp_path):
    tests = tmp_path / "grader.py"
    tests.write_text('from kvlab.grading.testkit import points\n\n'
                     '@points(1)\ndef test_measured(sub, rng):\n'
                     '    """a measured test"""\n    return "you reached 7, the line 5"\n\n'
                     '@points(1)\ndef test_plain(sub, rng):\n    """a plain test"""\n')
    out = tmp_path / "results.json"
    report = grade("cache_size", INSTRUCTOR / "solutions" / "cache_size.py", tests=tests,
                   seed=1, results=out)
    said = "you reached 7, the line 5"
    assert report.score == 2 and [t.output for t in report.tests] == [said, ""]
    assert [t["output"] for t in json.loads(out.read_text())["tests"]] == [said, ""]
    assert "         " + said in report.summary().splitlines()


def test_the_capstones_goodput_tiers_give_the_goodput_and_the_line_when_they_pass():
    report = hidden("serving_capstone", solution("serving_capstone"))
    tiers = [t for t in report.tests if t.function.startswith("test_goodput_reaches")]
    assert len(tiers) == 3 and all(t.passed for t in tiers), report.summary()
    for t in tiers:
        assert re.search(r"your goodput [\d.]+ requests/s.*this tier needs [\d.]+$", t.output), \
            t.output


def test_the_capstones_trial_draws_its_workload_as_the_grader_does():
    from kvlab.labs.serving_capstone.workload import draw, trial
    spec = importlib.util.spec_from_file_location("capstone_grader", graders("serving_capstone"))
    grader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grader)
    assert grader.draw_workload(np.random.default_rng(5)) == \
        draw(np.random.default_rng(5), grader.text())
    requests = trial(kvlab.load(), seed=3)
    assert requests == trial(kvlab.load(), seed=3) != trial(kvlab.load(), seed=4)
    lengths = [len(prompt) for _, prompt, _ in requests]
    assert len(requests) == 48 and all(4 <= n < 24 or 100 <= n < 300 for n in lengths)
    assert 20 <= sum(n < 24 for n in lengths) <= 44          # 70 % short, give or take
    assert all(8 <= new < 64 for _, _, new in requests)
    arrivals = [t for t, _, _ in requests]
    assert arrivals == sorted(arrivals) and 120 < 48 / arrivals[-1] < 450
    assert "trial(model" in LABS["serving_capstone"].starter.read_text()


def test_lab_start_copies_the_starter_and_will_not_overwrite(tmp_path, capsys):
    assert cli.main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed and f"{LABS[name].points} points" in listed for name in LABS)
    assert cli.main(["lab", "start", "cache_size", str(tmp_path)]) == 0
    copied = tmp_path / "cache_size.py"
    assert copied.read_text() == LABS["cache_size"].starter.read_text()
    assert (tmp_path / "cache_size.md").is_file()
    copied.write_text("# my work\n")
    assert cli.main(["lab", "start", "cache_size", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err and copied.read_text() == "# my work\n"
    with pytest.raises(ValueError, match="no lab named"):
        start_lab("no_such_lab", tmp_path)


def test_a_lab_in_c_starts_with_its_header_and_lists_what_its_grader_refuses(tmp_path):
    """The C lab's starter comes with the header it is built against; its instructions end
    with what cbuild's check refuses, and a file using each name listed is refused."""
    from kvlab.grading import cbuild
    assert cli.main(["lab", "start", "decode_kernel", str(tmp_path)]) == 0
    for name in ("decode_kernel.c", "decode_kernel.h", "decode_kernel.md"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "decode_kernel.h").read_bytes() == \
        (LABS["decode_kernel"].folder / "decode_kernel.h").read_bytes()
    (tmp_path / "decode_kernel.h").write_text("/* mine */\n")
    assert cli.main(["lab", "start", "decode_kernel", str(tmp_path)]) == 2    # not overwritten
    section = LABS["decode_kernel"].instructions_text().split("## What the grader refuses")[1]
    names = re.findall(r"`([^`]+)`", section.split("- the names")[1])
    assert names and set(names) == set(cbuild.DENIED_NAMES)
    for name in names:
        assert cbuild.check_c_source(f"int f(void) {{ return {name}; }}\n", "decode_kernel.h"), name
    for header in ("dlfcn.h", "unistd.h", "Python.h", "../csrc/kvlab.h"):
        assert cbuild.check_c_source(f"#include <{header}>\n", "decode_kernel.h"), header
    for spelled in ("%:include <dlfcn.h>", "??=include <dlfcn.h>", "#include HEADER",
                    "# include_next <stdio.h>", "#inc\\\nlude <dlfcn.h>", "int x = dl\\\nopen;"):
        assert cbuild.check_c_source(spelled + "\n", "decode_kernel.h"), spelled
    allowed = '#include "decode_kernel.h"\n#include <immintrin.h>\n/* dlopen, fork */\n' \
              'const char *s = "system";\n'
    assert cbuild.check_c_source(allowed, "decode_kernel.h") == []
    lines = cbuild.check_c_source("int a;\n#define LONG \\\n  1\nint b = sys\\\ntem;\n", "x.h")
    assert [v.line for v in lines] == [4], lines        # the line the joined line starts on


def test_the_c_check_reads_names_however_they_are_spelled_or_built():
    """Ways past a list of names that need no macro trick of their own: a trigraph that
    splices a line, attributes that run code at load or name a symbol in a string, token
    pasting, a pragma's string, Python's C API declared by hand. Each compiled and loaded
    (tried while writing this): Python ran from a constructor, dlopen reached by weakref."""
    from kvlab.grading import cbuild
    spellings = {
        "void *f(void) { return dlop??/\nen; }": "dlopen",
        "static void go(void) __attribute__((__constructor__));": "constructor",
        "static void go(void) __attribute__ ((destructor));": "destructor",
        "[[gnu::constructor]] static void go(void) {}": "constructor",
        "static void go(void) {}\n__attribute__((section(\".init_array\"))) void (*p)(void) = go;":
            "section",
        "static void *o(const char *, int) __attribute__((weakref(\"dlopen\")));": "weakref",
        "void f(void) __attribute__((ifunc(\"pick\")));": "ifunc",
        "#define J(a, b) a##b\nvoid *x = J(dl, open);": "##",
        "#define J(a, b) a%:%:b\n": "##",
        "extern int PyRun_SimpleString(const char *);": "PyRun_SimpleString",
        "_Pragma(\"redefine_extname o dlopen\") extern void *o(const char *, int);": "dlopen",
        "extern struct r_debug _r_debug;": "_r_debug",
        "extern int _Fork(void);": "_Fork",
        "int pid(void) { return __fork(); }": "__fork",
        "extern int __libc_system(const char *);": "__libc_system",
        "extern int __clone(int (*)(void *), void *, int, void *, ...);": "__clone",
    }
    for source, named in spellings.items():
        found = cbuild.check_c_source(source + "\n", "decode_kernel.h")
        assert any(f"`{named}`" in v.why for v in found), (source, found)
    # what kernels do write is not refused
    honest = ("typedef float v8f __attribute__((vector_size(32)));\n"
              "static inline __attribute__((always_inline)) int pick(int a) { return a; }\n"
              "int table[4][4]; int section_of_the_cache = 3; /* PyRun ## */\n"
              "int dynamic, Fork, system_size, r_debug;\n"
              "const char *s = \"??/ ## Py_None\";\n")
    assert cbuild.check_c_source(honest, "decode_kernel.h") == []
    for solution in ("decode_kernel.c", "decode_kernel_plain.c"):
        text = (Path(__file__).resolve().parents[1] / "instructor" / "solutions" / solution).read_text()
        assert cbuild.check_c_source(text, "decode_kernel.h") == [], solution


@pytest.mark.parametrize("lab", [name for name, lab in LABS.items() if lab.language == "python"])
def test_the_instructions_list_what_the_grader_refuses(lab):
    # "you may import the standard library" is true except for these: the instructions
    # name every one (from the policy's own lists), and a file using one is not graded
    from kvlab.grading import policy
    text = LABS[lab].instructions_text()
    assert "## What the grader refuses" in text and "standard library" in text
    section = text.split("## What the grader refuses")[1]
    lines = {line.split(" ")[2]: line for line in section.splitlines() if line.startswith("- the ")}
    listed = {kind: re.findall(r"`([^`]+)`", lines[kind]) for kind in ("builtins", "modules")}
    listed["attributes"] = re.findall(r"`([^`]+)`", lines["attributes"])
    # and what they say is what the check does: a file using any one of them is refused
    use = {"builtins": "x = {}\n", "modules": "import {}\n", "attributes": "x = object().{}\n"}
    for kind, names in listed.items():
        assert names, kind
        for name in names:
            refused = policy.check_source(use[kind].format(name), LABS[lab].policy, "f.py")
            assert refused, f"the instructions list the {kind[:-1]} {name}, which is allowed"
    for dotted in ("os.system", "sys.modules", "operator.attrgetter"):
        assert f"`{dotted}`" in section
        module, attribute = dotted.split(".")
        assert policy.check_source(f"import {module}\nx = {module}.{attribute}\n",
                                   LABS[lab].policy, "f.py")


@pytest.mark.parametrize("lab", list(LABS))
def test_a_started_labs_instructions_link_to_its_chapter_from_where_they_were_copied(
        lab, tmp_path, capsys):
    """README.md's `chapters/NAME.md` is relative to the course's repository: the copy in
    the student's folder links to a chapter file that exists, whatever the folder."""
    assert cli.main(["lab", "start", lab, str(tmp_path / "work")]) == 0
    capsys.readouterr()
    copied = (tmp_path / "work" / f"{lab}.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", copied)
    assert len(links) == copied.count("`chapters/") >= 1, copied[:400]
    targets = []
    for link in links:
        assert urlparse(link).scheme == "file", link
        targets.append(Path(url2pathname(urlparse(link).path)))
    assert f"{LABS[lab].chapter}.md" in {target.name for target in targets}
    for target in targets:        # the course's own chapter (installed with kvlab, or the clone's)
        assert target.is_absolute() and target.read_bytes() == (CHAPTERS / target.name).read_bytes()
    # kvlab lab show prints the same
    assert cli.main(["lab", "show", lab]) == 0
    assert capsys.readouterr().out.rstrip("\n") == copied.rstrip("\n")


def test_without_its_chapters_a_lab_keeps_the_courses_own_reference(tmp_path, monkeypatch):
    from kvlab.grading import labs
    monkeypatch.setattr(labs, "CHAPTER_DIRS", (tmp_path,))
    lab = LABS["int8_cache"]
    # the README as it is (then the refused names, appended)
    assert lab.instructions_text().startswith(lab.instructions.read_text(encoding="utf-8"))


def test_kvlab_grade_and_check_print_a_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    starter = str(LABS["cache_size"].starter)
    assert cli.main(["grade", "cache_size", starter, "--instructor", str(INSTRUCTOR), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "lab cache_size: 0 / 16" in out and "hidden tests, seed 5" in out and "FAIL" in out
    assert json.loads((tmp_path / "results.json").read_text())["score"] == 0
    assert cli.main(["check", "cache_size", starter]) == 1          # like a test runner
    out = capsys.readouterr().out
    assert "public checks" in out and "not written yet" in out
    solution = str(INSTRUCTOR / "solutions" / "cache_size.py")
    assert cli.main(["check", "cache_size", solution]) == 0
