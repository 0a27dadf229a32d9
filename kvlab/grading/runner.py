"""grade() and check(): run the judge on a submission and return its report.

The judge always runs as a process of its own (python -m kvlab.grading.judge), never in
the caller's: it makes itself the reaper of the processes a submission leaves behind and
closes itself to debuggers, which a notebook or a test runner should not be. This module
only picks the test file, starts the judge and reads the report it writes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Union

from .labs import TEST_TIMEOUT, find_instructor, get_lab, hidden_tests, require_gpu
from .process import require_worker_support
from .report import GradeReport

TOTAL_TIMEOUT = 1800.0       # seconds for a whole grading


def grade(lab: str, submission: Union[str, Path], results: Optional[Union[str, Path]] = None,
          *, tests: Optional[Union[str, Path]] = None, instructor: Optional[Union[str, Path]] = None,
          public: bool = False, seed: Optional[int] = None, test_timeout: float = TEST_TIMEOUT,
          worker_user: Optional[str] = None, progress: bool = False) -> GradeReport:
    """Grade `submission` (a .py file) for lab `lab` and write Gradescope's results.json to
    `results` if given. Graded with the hidden tests when instructor/ is found (or `tests`
    names a test file), else with the lab's public checks; the report says which. Never
    raises for anything the submission does: a broken submission scores 0 with the reason."""
    spec = get_lab(lab)
    require_worker_support()                      # Windows: PlatformUnsupported, in words
    require_gpu(spec)                             # a GPU lab without a GPU: GpuRequired
    submission = Path(submission).absolute()      # a link is not followed: the judge refuses it
    if not submission.exists():
        raise FileNotFoundError(f"no submission at {submission}")
    if tests is not None:
        tests_path, graded_with = Path(tests).resolve(), "hidden tests"
    else:
        hidden = None if public else hidden_tests(spec, find_instructor(instructor))
        tests_path, graded_with = (hidden, "hidden tests") if hidden else (spec.checks, "public checks")
    if not tests_path.is_file():
        raise FileNotFoundError(f"no test file at {tests_path}")
    with tempfile.TemporaryDirectory(prefix="kvlab-grade-") as work:
        out = Path(work) / "report.json"
        command = [sys.executable, "-m", "kvlab.grading.judge", "--lab", spec.name,
                   "--submission", str(submission), "--tests", str(tests_path),
                   "--graded-with", graded_with, "--out", str(out),
                   "--test-timeout", str(test_timeout), "--total-timeout", str(TOTAL_TIMEOUT)]
        if seed is not None:
            command += ["--seed", str(int(seed))]
        if worker_user:
            command += ["--worker-user", worker_user]
        if progress:                  # the judge names each test on this process's stderr
            command += ["--progress"]
        env = dict(os.environ)
        # the judge imports this same kvlab, installed or built in place
        package_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        env.pop("PYTHONOPTIMIZE", None)
        run = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE,
                             stderr=None if progress else subprocess.PIPE, text=True,
                             timeout=TOTAL_TIMEOUT + 120)
        if run.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the judge failed (exit status {run.returncode}): this is a "
                               f"bug in kvlab's grading, not in the submission\n"
                               f"{(run.stdout + (run.stderr or ''))[-3000:]}")
        report = GradeReport.from_dict(json.loads(out.read_text()))
    if results is not None:
        report.save(results)
    return report


def check(lab: str, submission: Union[str, Path], **options) -> GradeReport:
    """Run lab `lab`'s public self-checks on `submission` (never the hidden tests)."""
    return grade(lab, submission, public=True, **options)
