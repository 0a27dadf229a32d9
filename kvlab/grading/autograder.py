"""Gradescope autograder packages for the labs, and what runs inside one.

    kvlab lab autograder LAB -o LAB.zip      (from a clone of kvlab, which has instructor/)

builds the zip that Gradescope's "Configure Autograder" page takes as it is:

    setup.sh          run once, as root, when Gradescope builds the image: installs Python, a
                      C compiler and kvlab (from kvlab-src/) in /opt/kvlab-venv, creates
                      the user the students' code runs as, and fetches the named models the
                      lab's tests load (SmolLM2 for cache_eviction: Lab.models)
    run_autograder    run for every submission: closes the source and results folders to
                      that user, then python -m kvlab.grading.autograder run ...
    kvlab-src/        the kvlab this clone holds (pyproject.toml, setup.py, kvlab_build.py,
                      README.md, csrc/, kvlab/, chapters/): the same code that wrote the zip
                      grades with it
    tests/LAB.py      the hidden grading tests (from instructor/graders/)
    lab.json          which lab, and the time limits

Inside the container, `run` is the judge (kvlab/grading/judge.py): it finds the student's
file in /autograder/submission, grades it with the hidden tests, running the student's code
as that user, and writes /autograder/results/results.json (Gradescope's format). The
folder is configurable (--root), so the whole package can be tried in a temporary folder
laid out like /autograder; tests/test_grading.py does exactly that.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List, Optional, Tuple, Union

from .labs import TEST_TIMEOUT, find_instructor, get_lab, gpu_missing, hidden_tests
from .report import GradeReport

WORKER_USER = "kvlab-student"
# Gradescope stops a run at 10 minutes unless told otherwise, and then shows no results: the
# judge stops starting tests at 8, so that the last one (60 s at most) ends in time and the
# tests not run are listed with 0.
TOTAL_TIMEOUT = 480.0
VENV = "/opt/kvlab-venv"
# chapters: setup.py installs them with kvlab (kvlab.chapters), so pip needs them there;
# kvlab_build.py: setup.py imports it (the compiler flags and the record of what built)
SOURCE_PARTS = ("pyproject.toml", "setup.py", "kvlab_build.py", "README.md", "csrc", "kvlab",
                "chapters")
BUILT = (".so", ".o", ".pyc", ".pyd")      # what a build leaves in a clone

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu), from
# /autograder/source, where the zip was unpacked.
set -euo pipefail
SOURCE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
VENV="${{KVLAB_VENV:-{VENV}}}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential
/usr/bin/python3 -m venv "$VENV"          # the system Python apt installed
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "$SOURCE/kvlab-src"
# the students' code runs as this user: it cannot read the tests, the results or kvlab
# itself (the worker reads the two files of kvlab it needs, wire.py and policy.py, before it
# becomes this user; whatever a lab lends stays in the judge)
id -u {WORKER_USER} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin {WORKER_USER}
chmod -R a+rX "$VENV"
chmod -R go-rwx "$VENV"/lib/python3*/site-packages/kvlab
"""

# a lab whose tests load a named model (Lab.models) has it fetched here, into the cache folder
# of root (~/.cache/kvlab), who runs the judge; the students' code never reads it
FETCH_MODEL = '"$VENV/bin/python" -m kvlab fetch {name}\n'

RUN_AUTOGRADER = f"""#!/usr/bin/env bash
# Gradescope runs this, as root, for every submission. KVLAB_AUTOGRADER_ROOT, KVLAB_PYTHON
# and KVLAB_WORKER_USER (empty: the same user) let it run outside Gradescope too.
ROOT="${{KVLAB_AUTOGRADER_ROOT:-/autograder}}"
PYTHON="${{KVLAB_PYTHON:-${{KVLAB_VENV:-{VENV}}}/bin/python}}"
USER_FOR_CODE="${{KVLAB_WORKER_USER-{WORKER_USER}}}"
mkdir -p "$ROOT/results"
if [ -n "$USER_FOR_CODE" ]; then
    chmod o= "$ROOT/source" "$ROOT/results" "$ROOT/submission"
fi
exec "$PYTHON" -m kvlab.grading.autograder run --root "$ROOT" --worker-user "$USER_FOR_CODE"
"""


# A lab that needs a GPU (Lab.requires_gpu) can only be graded on an image with an NVIDIA GPU
# and nvcc (Gradescope's standard machines have neither): setup.sh stops with this, in
# words, where either is missing, and otherwise builds kvlab with its CUDA extension.
GPU_CHECK = """# lab {lab} needs an NVIDIA GPU and nvcc: kvlab's CUDA extension and the students' kernels
# are built by nvcc, and the kernels run on the GPU
NVCC=$(command -v nvcc || echo "${{CUDA_HOME:-/usr/local/cuda}}/bin/nvcc")
if ! nvidia-smi >/dev/null 2>&1 || [ ! -x "$NVCC" ]; then
    echo "kvlab: lab {lab} needs an NVIDIA GPU and nvcc, and this image has no" \\
         "$(nvidia-smi >/dev/null 2>&1 && echo nvcc || echo GPU): it cannot grade this lab" >&2
    exit 1
fi
export KVLAB_CUDA=1 CUDA_HOME="${{CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}}"
"""
PIP_INSTALL = '"$VENV/bin/pip" install "$SOURCE/kvlab-src"\n'


def _setup_script(spec) -> str:
    """setup.sh for lab `spec`: SETUP_SH, the GPU check before kvlab is built where the lab
    needs one, and the named models fetched."""
    setup = SETUP_SH
    if spec.requires_gpu:
        assert PIP_INSTALL in setup
        setup = setup.replace(PIP_INSTALL, GPU_CHECK.format(lab=spec.name) + PIP_INSTALL)
    return setup + "".join(FETCH_MODEL.format(name=name) for name in spec.models)


def _source_files(clone: Path) -> List[Tuple[Path, str]]:
    """(file, name in the zip) of the kvlab source to install on Gradescope."""
    files = []
    for part in SOURCE_PARTS:
        path = clone / part
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: build the autograder from a clone of kvlab")
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in found:
            if file.suffix in BUILT or any(part == "__pycache__" or part.endswith(".egg-info")
                                           for part in file.parts):
                continue
            files.append((file, "kvlab-src/" + file.relative_to(clone).as_posix()))
    return files


def _add(archive: zipfile.ZipFile, name: str, data: Union[str, bytes], executable: bool = False) -> None:
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
    archive.writestr(info, data)


def build(lab: str, out: Union[str, Path], instructor: Optional[Union[str, Path]] = None,
          test_timeout: float = TEST_TIMEOUT) -> Path:
    """Write lab `lab`'s Gradescope autograder to `out` (a .zip); returns its path."""
    spec = get_lab(lab)
    folder = find_instructor(instructor, from_clone_here=True)
    tests = hidden_tests(spec, folder)
    if tests is None:
        raise FileNotFoundError("the hidden tests are in instructor/graders/ of a kvlab clone: run "
                                "this from the root of a clone, or pass --instructor DIR")
    clone = folder.parent
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"lab": spec.name, "test_timeout": test_timeout, "total_timeout": TOTAL_TIMEOUT}
    with zipfile.ZipFile(out, "w") as archive:
        _add(archive, "setup.sh", _setup_script(spec), executable=True)
        _add(archive, "run_autograder", RUN_AUTOGRADER, executable=True)
        _add(archive, "lab.json", json.dumps(settings, indent=2) + "\n")
        _add(archive, f"tests/{spec.name}.py", tests.read_bytes())
        for file, name in _source_files(clone):
            _add(archive, name, file.read_bytes())
    return out


# ---- inside the container ---------------------------------------------------------------

def find_submission(folder: Path, lab: str) -> Tuple[Optional[Path], str]:
    """The student's file: the shallowest <lab>.py in the submission, else its only .py
    file (.c for a lab in C). Links are never followed (a submission could link to a file
    only root may read), and what a Mac's zip adds (__MACOSX/, ._ files) is not a
    submission."""
    suffix = get_lab(lab).suffix
    files = []
    for parent, folders, names in os.walk(folder):       # does not follow linked folders
        folders[:] = [f for f in folders if f != "__MACOSX"]
        for name in names:
            path = Path(parent) / name
            if name.endswith(suffix) and not name.startswith("._") and not path.is_symlink() \
                    and path.is_file():
                files.append(path)
    files.sort(key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    named = [p for p in files if p.name == f"{lab}{suffix}"]
    if named:
        return named[0], ""
    if len(files) == 1:
        return files[0], ""
    kind = {".py": "Python", ".cu": "CUDA"}.get(suffix, "C")
    found = ", ".join(str(p.relative_to(folder)) for p in files[:5]) or f"no {kind} file"
    return None, f"submit one file named {lab}{suffix} (found {found})"


def uncommitted_changes(clone: Path) -> List[str]:
    """Files of what the zip packs that differ from the clone's last commit (git's word),
    or [] where git cannot tell: a zip should be built from a clean checkout."""
    try:
        run = subprocess.run(["git", "-C", str(clone), "status", "--porcelain", "--",
                              *SOURCE_PARTS, "instructor/graders"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line[3:] for line in run.stdout.splitlines()] if run.returncode == 0 else []


def run(root: Path, worker_user: Optional[str] = None) -> GradeReport:
    """Grade /autograder/submission with /autograder/source/tests, and write results.json."""
    from .judge import Judge
    from .process import harden_judge
    source = root / "source"
    settings = json.loads((source / "lab.json").read_text())
    spec = get_lab(settings["lab"])
    tests_path = source / "tests" / f"{spec.name}.py"
    results = root / "results" / "results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    harden_judge()
    submission, problem = find_submission(root / "submission", spec.name)
    gpu = gpu_missing() if spec.requires_gpu else None
    if gpu is not None:          # an image without the GPU the lab needs: no grade, in words
        report = _zero_report(spec, tests_path, f"this lab needs an NVIDIA GPU and nvcc, and "
                                                f"this autograder has none ({gpu}): tell your "
                                                f"instructor")
    elif submission is None:
        report = _zero_report(spec, tests_path, problem)
    else:
        try:
            report = Judge(spec, submission.absolute(), tests_path.resolve(), "hidden tests",
                           test_timeout=float(settings.get("test_timeout", TEST_TIMEOUT)),
                           total_timeout=float(settings.get("total_timeout", TOTAL_TIMEOUT)),
                           worker_user=worker_user or None).run()
        except Exception as error:
            # A bug of the judge's (or of the hidden tests') must still leave Gradescope a
            # results.json, else the submission shows only "the autograder failed"; it gives
            # no points. The student sees the kind of error, the log (stderr) all of it: its
            # text may come from the hidden tests.
            print(f"kvlab autograder: the judge failed: {error!r}", file=sys.stderr)
            report = _zero_report(spec, tests_path,
                                  f"the autograder itself failed ({type(error).__name__}); this "
                                  f"is kvlab's fault, not your file's: tell your instructor")
        report.submission = str(submission.relative_to(root / "submission"))
    report.save(results)
    return report


def _zero_report(spec, tests_path: Path, why: str) -> GradeReport:
    """Every hidden test at zero, saying why; one row worth the lab's points if even the
    tests cannot be loaded."""
    from .judge import load_tests, title
    from .report import TestResult
    try:
        rows = [TestResult(title(t), 0.0, t.points, "not graded: " + why, t.visibility)
                for t in load_tests(tests_path)]
    except Exception as error:
        print(f"kvlab autograder: the hidden tests do not load: {error!r}", file=sys.stderr)
        rows = [TestResult("the hidden tests", 0.0, float(spec.points), "not graded: " + why)]
    return GradeReport(spec.name, f"{spec.name}{spec.suffix}", rows, why, 0.0, "hidden tests")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.grading.autograder")
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="grade the submission in ROOT (Gradescope's /autograder)")
    run_parser.add_argument("--root", default="/autograder")
    run_parser.add_argument("--worker-user", default="",
                            help="run the student's code as this user (empty: the same user)")
    build_parser = sub.add_parser("build", help="write a lab's autograder zip")
    build_parser.add_argument("lab")
    build_parser.add_argument("-o", "--output", required=True)
    build_parser.add_argument("--instructor", default=None)
    args = parser.parse_args(argv)
    if sys.flags.optimize:
        parser.error("the judge's checks are assert statements: run it without -O")
    if args.command == "build":
        print(build(args.lab, args.output, args.instructor))
        return 0
    sys.dont_write_bytecode = True
    report = run(Path(args.root), args.worker_user)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
