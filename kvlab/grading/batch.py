"""grade_all(): an instructor grades a folder of submissions with the hidden tests.

    kvlab grade-all LAB SUBMISSIONS --instructor DIR --out OUT

SUBMISSIONS holds one entry per student: a folder (Gradescope's export has one per
submission, submission_<id>/) in which the student's file is found as on Gradescope (the
shallowest LAB.py, else the folder's only .py file), or a single .py file (alice.py: the
student is "alice"). Each is graded by grade() as `kvlab grade` does it: a judge process of
its own, which starts a fresh worker for each test, so no two students ever share a process.
A submission that is missing its file, fails to import, crashes or hangs gets its row (and
zero where it earned nothing) and the batch goes on. The batch writes OUT/<student>/results.json
(Gradescope's format) and OUT/summary.csv, all of them again from the judges' reports once
the last submission is graded, so that a submission run later cannot leave another's files
changed (locally the student's code runs as you, as with `kvlab grade`).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Union

from .labs import (TEST_TIMEOUT, find_instructor, get_lab, hidden_tests, instructor_hint,
                   require_gpu)
from .report import GradeReport, write_atomically

SUMMARY = "summary.csv"


@dataclasses.dataclass
class Graded:
    """One student's row: the report the judge made (or one of zeros saying why none could
    be made) and what went wrong with the submission as a whole, if anything."""
    student: str
    file: str                 # the file graded, relative to SUBMISSIONS ("" where none)
    report: GradeReport
    error: str = ""


def submissions_in(folder: Path, exclude: Optional[Path] = None,
                   suffix: str = ".py") -> Dict[str, Optional[Path]]:
    """{student: their entry}, sorted by name: each folder and each .py file (`suffix`: .c
    for a lab in C) directly in `folder` (hidden files, __MACOSX/ and what a Mac's zip adds
    left out, and `exclude`, the output folder when it lies inside). A link is listed with
    None: never followed, it is graded as missing."""
    entries: Dict[str, Optional[Path]] = {}
    for path in sorted(folder.iterdir()):
        name = path.name
        if name.startswith((".", "._")) or name == "__MACOSX":
            continue
        if exclude is not None and path.resolve() == exclude:
            continue
        if path.is_symlink():
            student = path.stem if name.endswith(suffix) else name
        elif path.is_dir():
            student = name
        elif path.is_file() and name.endswith(suffix):
            student = path.stem
        else:
            continue                    # Gradescope's submission_metadata.yml, notes ...
        if student in entries:
            raise ValueError(f"two submissions for {student!r} in {folder} (a folder and a "
                             f"file of that name): keep one")
        entries[student] = None if path.is_symlink() else path
    return entries


def _writable_folder(out: Path) -> None:
    """Make `out` or say plainly why it cannot be written, before any grading."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvlab-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise PermissionError(f"cannot write the results to {out}: {error.strerror or error}"
                              ) from None


def grade_all(lab: str, submissions: Union[str, Path], out: Union[str, Path], *,
              instructor: Optional[Union[str, Path]] = None,
              tests: Optional[Union[str, Path]] = None, seed: Optional[int] = None,
              test_timeout: float = TEST_TIMEOUT, progress: bool = False) -> List[Graded]:
    """Grade every submission in `submissions` for lab `lab` with its hidden tests (from
    `tests`, else the instructor/ folder find_instructor(instructor) finds: never the public
    checks), write out/<student>/results.json and out/summary.csv, and return the rows."""
    from .autograder import _zero_report, find_submission
    from .runner import grade
    spec = get_lab(lab)
    require_gpu(spec)              # before any submission: GpuRequired, in words
    submissions, out = Path(submissions), Path(out).absolute()
    if tests is not None:
        tests_path = Path(tests).resolve()
        if not tests_path.is_file():
            raise FileNotFoundError(f"no test file at {tests_path}")
    else:
        folder = find_instructor(instructor)
        tests_path = hidden_tests(spec, folder)
        if folder is not None and tests_path is None:
            raise FileNotFoundError(f"{folder} has no graders/{spec.name}.py: no hidden tests "
                                    f"for lab {spec.name} there")
        if tests_path is None:
            raise FileNotFoundError(
                f"no hidden tests for lab {spec.name}: grade-all grades with the hidden tests "
                f"only, never the public checks. " + instructor_hint().replace(
                    "kvlab grade takes", "It takes"))
    if not submissions.is_dir():
        raise FileNotFoundError(f"no folder of submissions at {submissions}")
    entries = submissions_in(submissions, exclude=out.resolve(), suffix=spec.suffix)
    if not entries:
        raise ValueError(f"{submissions} holds no submissions: expected a folder per student "
                         f"holding {spec.name}{spec.suffix} (as Gradescope exports them), or one "
                         f"{spec.suffix} file per student")
    if out.resolve() == submissions.resolve():
        raise ValueError("--out must be another folder than the submissions'")
    if SUMMARY in entries:
        raise ValueError(f"a submission named {SUMMARY} in {submissions} would take the "
                         f"summary's place in the results: rename it")
    _writable_folder(out)

    from tqdm.auto import tqdm
    rows: List[Graded] = []
    bar = tqdm(entries.items(), desc=f"grading {spec.name}", unit="submission",
               disable=not progress)
    for student, entry in bar:
        bar.set_postfix_str(student, refresh=True)
        rows.append(_grade_one(spec, student, entry, submissions, tests_path, seed,
                               test_timeout, grade, find_submission, _zero_report))
        _save(out, rows[-1])          # as it goes, so that an interrupted batch keeps its work
    bar.close()
    for row in rows:                  # again, from the reports in this process: see above
        _save(out, row)
    write_atomically(out / SUMMARY, summary_csv(rows))
    return rows


def _grade_one(spec, student, entry, submissions, tests_path, seed, test_timeout, grade,
               find_submission, zero_report) -> Graded:
    if entry is None:
        why = "the submission is a link, which is never followed"
        return Graded(student, "", zero_report(spec, tests_path, why), why)
    if entry.is_dir():
        file, problem = find_submission(entry, spec.name)
        if file is None:
            return Graded(student, "", zero_report(spec, tests_path, problem), problem)
    else:
        file = entry
    relative = str(file.relative_to(submissions))
    try:
        report = grade(spec.name, file, tests=tests_path, seed=seed, test_timeout=test_timeout)
    except Exception as error:        # the judge's own failure: this row says so, the batch goes on
        why = f"not graded: {type(error).__name__}: {_one_line(str(error))}"
        return Graded(student, relative, zero_report(spec, tests_path, why), why)
    report.submission = relative
    return Graded(student, relative, report, _one_line(report.refused or report.output))


def _one_line(text: str, limit: int = 500) -> str:
    """A message for one CSV cell: its lines joined (a refusal says why on its second line),
    cut at `limit` characters."""
    return " ".join(text.split())[:limit]


def _save(out: Path, row: Graded) -> None:
    folder = out / row.student
    folder.mkdir(exist_ok=True)
    row.report.save(folder / "results.json")


def _cell(text: str) -> str:
    """A cell a spreadsheet shows as text: names and messages come from the submissions,
    and one starting with = + - @ would be read as a formula."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def summary_csv(rows: List[Graded]) -> str:
    """student, file, score, max_score, seed, failed (the failed tests' names, ;-separated),
    error (what concerns the whole submission), then one column of points per test."""
    tests: List[str] = []
    for row in rows:
        for t in row.report.tests:
            if t.function not in tests:
                tests.append(t.function)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["student", "file", "score", "max_score", "seed", "failed", "error", *tests])
    for row in rows:
        r = row.report
        points = {t.function: f"{t.score:g}" for t in r.tests}
        writer.writerow([_cell(row.student), _cell(row.file), f"{r.score:g}", f"{r.max_score:g}",
                         "" if r.seed is None else r.seed, ";".join(r.failed()),
                         _cell(row.error),
                         *(points.get(name, "") for name in tests)])
    return text.getvalue()
