"""Run a lab's grader on a submission and report the score.

The grader runs in a child Python process: the submission is the student's code, and a
crash, an exit() or an endless loop in it must not end the caller's notebook or terminal.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Union

from .labs import get_lab

GRADER_TIMEOUT = 600.0   # seconds for the whole grader run
TEST_TIMEOUT = 60.0      # seconds for one test


@dataclasses.dataclass
class TestResult:
    name: str
    score: float
    max_score: float
    output: str = ""
    visibility: str = "visible"
    status: str = "failed"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclasses.dataclass
class GradeReport:
    lab: str
    submission: str
    tests: List[TestResult]
    output: str = ""            # what went wrong with the run as a whole, if anything
    execution_time: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def failed(self) -> List[str]:
        """Names (function names) of the tests that did not pass."""
        return [t.name.split(":")[0] for t in self.tests if not t.passed]

    def gradescope(self) -> dict:
        """The results.json Gradescope's autograder reads."""
        return {"score": self.score, "max_score": self.max_score,
                "execution_time": round(self.execution_time, 2),
                "output": self.output or f"kvlab lab {self.lab}: {self.score:g} / {self.max_score:g}",
                "visibility": "visible", "stdout_visibility": "visible",
                "tests": [dataclasses.asdict(t) for t in self.tests]}

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.gradescope(), indent=2) + "\n")

    def summary(self) -> str:
        lines = [f"lab {self.lab}: {self.score:g} / {self.max_score:g} points"
                 f"  ({Path(self.submission).name})"]
        if self.output:
            lines.append(self.output)
        for t in self.tests:
            mark = "PASS" if t.passed else "FAIL"
            lines.append(f"  {mark} {t.score:>4g}/{t.max_score:<4g} {t.name}")
            if not t.passed and t.output:
                lines += ["         " + line for line in t.output.splitlines()[:6]]
        return "\n".join(lines)


def grade(lab: str, submission: Union[str, Path], results: Optional[Union[str, Path]] = None,
          timeout: float = GRADER_TIMEOUT, test_timeout: float = TEST_TIMEOUT) -> GradeReport:
    """Grade `submission` (a .py file) against lab `lab`; write results.json to `results`
    if given. Never raises for anything the submission does: a broken submission scores 0
    with the reason in the report."""
    spec = get_lab(lab)
    if importlib.util.find_spec("pytest") is None:
        raise ImportError("kvlab grade runs the lab's tests with pytest: pip install 'kvlab[labs]'")
    submission = Path(submission).resolve()
    if not submission.is_file():
        raise FileNotFoundError(f"no submission at {submission}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvlab-grade-") as work:
        work = Path(work)
        out = work / "tests.json"
        (work / "pytest.ini").write_text("[pytest]\n")    # ignore any project's pytest settings
        command = [sys.executable, "-m", "pytest", str(spec.grader), "-q", "--no-header",
                   "-p", "kvlab.grading.plugin", "-p", "no:cacheprovider",
                   "-c", str(work / "pytest.ini"), "--rootdir", str(work),
                   "--import-mode=importlib", "--submission", str(submission),
                   "--results-json", str(out), "--test-timeout", str(test_timeout)]
        env = dict(os.environ)
        # the child imports this same kvlab, installed or built in place
        package_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        env.setdefault("MPLBACKEND", "Agg")
        try:
            run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                                 timeout=timeout)
            log, problem = run.stdout + run.stderr, ""
        except subprocess.TimeoutExpired as expired:
            log = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) \
                else (expired.stdout or "")
            problem = f"grading stopped after {timeout:g} s: the submission ran too long"
        tests = []
        if out.exists():
            tests = [TestResult(**t) for t in json.loads(out.read_text())["tests"]]
        elif not problem:
            problem = "the grader did not finish:\n" + log[-1500:]
    report = GradeReport(lab=spec.name, submission=str(submission), tests=tests, output=problem,
                         execution_time=time.monotonic() - started)
    if not tests:
        report.tests = _all_failed(spec, problem)
    if results is not None:
        report.save(results)
    return report


def _all_failed(spec, why: str) -> List[TestResult]:
    """When the grader itself could not report (a crash or timeout), every test scores 0;
    the test list and points come from collecting the grader file here."""
    import ast
    tree = ast.parse(spec.grader.read_text())
    tests = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            points = 1.0
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "points"
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    points = float(deco.args[0].value)
            tests.append(TestResult(node.name, 0.0, points, why.splitlines()[0] if why else ""))
    return tests
