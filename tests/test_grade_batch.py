"""An instructor's grading: `kvlab grade-all` over a folder of submissions (one judge each,
a results.json each and summary.csv), its refusals, and where `kvlab grade` looks for
instructor/ (and what it says when it finds none)."""
import ast
import csv
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("kvlab._kvlab")
from kvlab import cli  # noqa: E402
from kvlab.grading import labs  # noqa: E402
from kvlab.grading.batch import Graded, submissions_in, summary_csv  # noqa: E402
from kvlab.grading.report import GradeReport  # noqa: E402
from kvlab.grading.report import TestResult as Row  # noqa: E402  (not a test class)

REPO = Path(__file__).resolve().parents[1]
INSTRUCTOR = REPO / "instructor"
LAB = "paged_attention"            # the fastest lab to grade (about a second)
SOLUTION = INSTRUCTOR / "solutions" / f"{LAB}.py"
MISTAKE = INSTRUCTOR / "mistakes" / LAB / "ignores_the_table.py"


def expected_failures(path: Path) -> set:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "EXPECTED_FAILURES":
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} declares no EXPECTED_FAILURES")


def rows_of(out: Path) -> dict:
    return {row["student"]: row for row in csv.DictReader(io.StringIO(
        (out / "summary.csv").read_text()))}


@pytest.fixture
def submissions(tmp_path):
    """A class as Gradescope exports it (a folder each) and as files (one .py each)."""
    folder = tmp_path / "submissions"
    (folder / "submission_101").mkdir(parents=True)           # the reference solution
    (folder / "submission_101" / f"{LAB}.py").write_text(SOLUTION.read_text())
    # a planted mistake, as test_grading.py makes them: a later def replaces the right one
    (folder / "bob.py").write_text(SOLUTION.read_text() + "\n" + MISTAKE.read_text())
    (folder / "carol").mkdir()                                # raises at import
    (folder / "carol" / "anything.py").write_text("raise RuntimeError('carol breaks')\n")
    (folder / "dave").mkdir()                                 # no Python file at all
    (folder / "dave" / "notes.txt").write_text("I forgot to upload it\n")
    (folder / "erin.py").write_text(SOLUTION.read_text() + "\n\ndef slot(position, block_table, "
                                    "block_size):\n    while True:\n        pass\n")  # hangs
    (folder / "fay.py").write_text(labs.LABS[LAB].starter.read_text())    # never started
    (folder / "submission_metadata.yml").write_text(":submission_101:\n")  # not a submission
    # graded last, it rewrites what the batch wrote for the others and its own score: the
    # batch writes every file again from the judges' reports at the end
    out = tmp_path / "graded"
    (folder / "zoe.py").write_text(SOLUTION.read_text() + f"""
for name in ("bob", "zoe"):
    try:
        with open({str(out)!r} + "/" + name + "/results.json", "w") as forged:
            forged.write('{{"score": 99, "tests": []}}')
    except OSError:
        pass
with open({str(out)!r} + "/summary.csv", "w") as forged:
    forged.write("student,score\\nzoe,99\\n")
""")
    return folder


def test_grade_all_grades_each_submission_and_writes_results_and_a_summary(submissions,
                                                                            tmp_path, capsys):
    out = tmp_path / "graded"
    assert cli.main(["grade-all", LAB, str(submissions), "--out", str(out), "--instructor",
                     str(INSTRUCTOR), "--seed", "1", "--test-timeout", "3", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote 7 results.json files under {out}" in printed
    assert "failed: all 7 tests" in next(line for line in printed.splitlines() if line.startswith("fay"))
    rows = rows_of(out)
    assert list(rows) == ["bob", "carol", "dave", "erin", "fay", "submission_101", "zoe"]
    full = labs.LABS[LAB].points
    tests = list(rows["bob"])[7:]
    assert len(tests) == 7 and all(t.startswith("test_") for t in tests)
    for student, row in rows.items():
        assert row["max_score"] == str(full)
        # the per-test columns add up to the score, and the failed ones are those at 0
        assert sum(float(row[t]) for t in tests) == float(row["score"]), row
        data = json.loads((out / student / "results.json").read_text())
        assert data["score"] == float(row["score"])
        assert sum(t["max_score"] for t in data["tests"]) == full
        assert [t["score"] for t in data["tests"]] == [float(row[t]) for t in tests]

    good = rows["submission_101"]
    assert (good["score"], good["failed"], good["error"]) == (str(full), "", "")
    assert rows["zoe"]["score"] == str(full)        # its forgeries are gone (99 is not 14)
    assert good["file"] == f"submission_101/{LAB}.py" and good["seed"] == "1"
    bob = rows["bob"]
    assert set(bob["failed"].split(";")) == expected_failures(MISTAKE)
    assert 0 < float(bob["score"]) < full and bob["file"] == "bob.py"
    carol = rows["carol"]
    assert carol["score"] == "0" and "carol breaks" in carol["error"]
    assert carol["file"] == "carol/anything.py"      # a folder's only .py file, as on Gradescope
    dave = rows["dave"]
    assert dave["score"] == "0" and dave["file"] == "" and f"{LAB}.py" in dave["error"]
    assert "not graded" in json.loads((out / "dave" / "results.json").read_text())["tests"][0]["output"]
    erin = rows["erin"]                              # only the tests that call slot() lose
    assert "test_slot" in erin["failed"].split(";") and 0 < float(erin["score"]) < full
    erin_tests = json.loads((out / "erin" / "results.json").read_text())["tests"]
    assert all("ran too long: the test's 3 s ran out" in t["output"] for t in erin_tests
               if t["status"] == "failed")


def test_grade_all_refuses_in_words_before_grading(submissions, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)                # where --out's default, graded/, would go

    def refused(*argv):
        assert cli.main(["grade-all", *argv, "--quiet"]) == 2
        return capsys.readouterr().err

    assert "no lab named 'nope'" in refused("nope", str(submissions), "--instructor",
                                            str(INSTRUCTOR))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".DS_Store").write_text("")
    assert "holds no submissions" in refused(LAB, str(empty), "--instructor", str(INSTRUCTOR))
    assert "no folder of submissions" in refused(LAB, str(tmp_path / "absent"), "--instructor",
                                                 str(INSTRUCTOR))
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    said = refused(LAB, str(submissions), "--instructor", str(INSTRUCTOR), "--out",
                   str(blocked / "graded"))
    assert "cannot write the results to" in said and str(blocked / "graded") in said
    assert "no graders/ folder" in refused(LAB, str(submissions), "--instructor", str(tmp_path))
    (tmp_path / "other" / "graders").mkdir(parents=True)      # an instructor/ without this lab
    assert f"has no graders/{LAB}.py" in refused(LAB, str(submissions), "--instructor",
                                                 str(tmp_path / "other"))
    clash = tmp_path / "clash"
    (clash / "summary.csv").mkdir(parents=True)
    assert "would take the summary's place" in refused(LAB, str(clash), "--instructor",
                                                       str(INSTRUCTOR))
    assert not (tmp_path / "graded").exists()
    # never the public checks: no instructor/ found is an error that says how to name one
    as_after_a_plain_pip_install(monkeypatch)
    said = refused(LAB, str(submissions))
    assert "hidden tests only" in said and "--instructor" in said and "KVLAB_INSTRUCTOR" in said
    assert not (tmp_path / "graded").exists()
    with pytest.raises(SystemExit):
        cli.main(["grade-all", LAB, str(submissions), "--test-timeout", "0"])


def test_submissions_are_listed_one_per_student(tmp_path):
    folder = tmp_path / "subs"
    (folder / "alice").mkdir(parents=True)
    (folder / "__MACOSX").mkdir()
    (folder / "._bob.py").write_text("")
    (folder / "bob.py").write_text("")
    (folder / "graded").mkdir()                           # the output folder, inside
    (folder / "linked.py").symlink_to(SOLUTION)
    listed = submissions_in(folder, exclude=(folder / "graded").resolve())
    assert listed == {"alice": folder / "alice", "bob": folder / "bob.py", "linked": None}
    (folder / "alice.py").write_text("")
    with pytest.raises(ValueError, match="two submissions for 'alice'"):
        submissions_in(folder)


def test_a_c_labs_submissions_are_its_c_files(tmp_path):
    """For the kernel lab, a student's file directly in the folder is NAME.c, and a
    folder's is found as the autograder finds it (decode_kernel.c, else its only .c)."""
    from kvlab.grading.autograder import find_submission
    folder = tmp_path / "subs"
    (folder / "carol").mkdir(parents=True)
    (folder / "carol" / "kernel.c").write_text("")
    (folder / "carol" / "notes.py").write_text("")
    (folder / "dave.c").write_text("")
    (folder / "erin.py").write_text("")
    assert submissions_in(folder, suffix=".c") == {"carol": folder / "carol", "dave": folder / "dave.c"}
    assert find_submission(folder / "carol", "decode_kernel")[0].name == "kernel.c"
    (folder / "carol" / "decode_kernel.c").write_text("")
    assert find_submission(folder / "carol", "decode_kernel")[0].name == "decode_kernel.c"
    (folder / "carol" / "decode_kernel.c").unlink()
    (folder / "carol" / "other.c").write_text("")
    assert "submit one file named decode_kernel.c" in find_submission(folder / "carol", "decode_kernel")[1]


def test_the_summary_never_hands_a_spreadsheet_a_formula():
    report = GradeReport(LAB, "x.py", [Row("test_slot: a slot", 0.0, 1.0)], seed=3)
    text = summary_csv([Graded("=HYPERLINK(\"http://x\")", "=x.py", report, "@SUM(A1)")])
    row = next(csv.DictReader(io.StringIO(text)))
    assert row["student"].startswith("'=") and row["file"] == "'=x.py"
    assert row["error"] == "'@SUM(A1)" and row["test_slot"] == "0" and row["failed"] == "test_slot"


# ---- where kvlab grade finds instructor/ ----------------------------------------------------

def as_after_a_plain_pip_install(monkeypatch):
    """kvlab in site-packages: no source tree around the package."""
    monkeypatch.setattr(labs, "_source_tree", lambda: None)
    monkeypatch.delenv("KVLAB_INSTRUCTOR", raising=False)


def test_from_the_source_tree_the_clones_instructor_is_found(monkeypatch):
    """kvlab running from a clone (pip install -e, PYTHONPATH at the clone) grades with that
    clone's instructor/ (the tests may run an installed kvlab: put its labs in the clone)."""
    monkeypatch.delenv("KVLAB_INSTRUCTOR", raising=False)
    monkeypatch.setattr(labs, "LABS_DIR", REPO / "kvlab" / "labs")
    assert labs._source_tree() == REPO
    assert labs.find_instructor() == INSTRUCTOR.resolve()


def test_after_a_plain_pip_install_instructor_must_be_named(monkeypatch, tmp_path):
    as_after_a_plain_pip_install(monkeypatch)
    monkeypatch.chdir(REPO)                               # even at the clone's root
    assert labs.find_instructor() is None
    assert labs.find_instructor(INSTRUCTOR) == INSTRUCTOR.resolve()
    monkeypatch.setenv("KVLAB_INSTRUCTOR", str(INSTRUCTOR))
    assert labs.find_instructor() == INSTRUCTOR.resolve()
    # a site-packages/instructor/ (a PyPI package of that name, say) is not the clone's
    monkeypatch.undo()
    monkeypatch.setattr(labs, "LABS_DIR", tmp_path / "site-packages" / "kvlab" / "labs")
    monkeypatch.delenv("KVLAB_INSTRUCTOR", raising=False)
    (tmp_path / "site-packages" / "instructor" / "graders").mkdir(parents=True)
    assert labs.find_instructor() is None


def test_the_hint_names_the_clone_it_is_run_in_and_never_a_bare_folder(monkeypatch, tmp_path):
    as_after_a_plain_pip_install(monkeypatch)
    monkeypatch.chdir(REPO / "kvlab" / "labs")            # anywhere inside the clone
    hint = labs.instructor_hint()
    assert f"--instructor {INSTRUCTOR}" in hint and "pip install -e ." in hint
    student = tmp_path / "student"
    (student / "instructor" / "graders").mkdir(parents=True)
    monkeypatch.chdir(student)
    assert labs.instructor_hint() == labs.HOW_TO_NAME_INSTRUCTOR
    assert "--instructor DIR" in labs.instructor_hint()


def test_kvlab_grade_says_how_to_name_instructor_when_it_falls_back(monkeypatch, tmp_path,
                                                                   capsys):
    as_after_a_plain_pip_install(monkeypatch)
    monkeypatch.chdir(REPO)
    results = tmp_path / "results.json"
    assert cli.main(["grade", LAB, str(SOLUTION), "--results", str(results)]) == 0
    printed = capsys.readouterr().out
    assert "graded with the public checks" in printed
    assert f"pass --instructor {INSTRUCTOR}" in printed and "$KVLAB_INSTRUCTOR" in printed
    assert cli.main(["grade", LAB, str(SOLUTION), "--results", str(results), "--instructor",
                     str(INSTRUCTOR)]) == 0
    printed = capsys.readouterr().out
    assert "graded with the hidden tests" in printed and "--instructor" not in printed


def test_the_help_says_what_grade_does():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    grade_help = " ".join(commands["grade"].format_help().split())
    assert "$KVLAB_INSTRUCTOR" in grade_help and "pip install -e ." in grade_help
    assert "after a plain pip install . name it here" in grade_help
    batch_help = " ".join(commands["grade-all"].format_help().split())
    assert "summary.csv" in batch_help and "never the public checks" in batch_help
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "kvlab grade-all" in readme and "summary.csv" in readme
