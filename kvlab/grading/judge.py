"""The judge: grades one submission against one test file, in a process of its own.

    python -m kvlab.grading.judge --lab LAB --submission FILE --tests TESTS.py --out REPORT.json

The judge holds everything that decides a grade: the test code, the list of tests, their
points, the expected values (computed here, with this process's kvlab) and the score. The
student's code never runs in this process. For each test the judge starts a fresh worker
(kvlab/grading/worker.py) that imports the submission and runs the calls the test makes;
when the test ends the worker and everything it started are killed. So:

- the score is the sum, over the judge's own list, of the points of the tests that
  passed; a test that crashed the worker, ran out of time or never ran scores 0 and is
  still listed with its full max_score;
- nothing the submission does at import, at exit, in a thread or in a child process can
  reach this process's memory, its results file (written here, atomically, after the last
  worker is gone) or its tests (loaded, with the data they use, before the first worker
  starts; the files of kvlab and of the tests are fingerprinted before and after, and a
  change costs the whole grade);
- before any of it, the submission's source is checked against its lab's policy
  (kvlab/grading/policy.py): a lab is about writing the thing, not importing kvlab's.

A lab in C (the kernel lab) is the same but for its first steps: the file is checked by
kvlab/grading/cbuild.py, built by a worker of its own (the compiler runs as the student's
user, never in this process), and each test's worker loads the library that worker wrote,
which the judge only copies as bytes.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import io
import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time
import tokenize
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from . import cbuild
from .handouts import LentFunctions
from .labs import TEST_TIMEOUT, Lab, get_lab, require_gpu
from .policy import check_source
from .process import (WorkerGone, WorkerProcess, WorkerTimeout,
                      check_worker_user, harden_judge, require_worker_support, sweep)
from .remote import RemoteError, Session, Submission
from .report import GradeReport, TestResult, write_atomically

OUTPUT_CAP = 64 << 10        # bytes of a test's printed output kept
PRINTED_SHOWN = 1500         # characters of it shown with a failed test
MESSAGE_SHOWN = 3000         # characters of a failed test's message (it may quote the student)
SUBMISSION_LIMIT = 1 << 20   # bytes of a submission: a lab's file is a few KiB


class NotImported(Exception):
    """A worker could not import the submission; the message says why, for the student."""


class NotGraded(Exception):
    """The submission cannot be graded at all: `why` for the report, `short` for each test."""

    def __init__(self, why: str, short: str):
        super().__init__(why)
        self.why, self.short = why, short


def load_tests(path: Path) -> List[Callable]:
    """The test functions of a test file, in the order they are written."""
    spec = importlib.util.spec_from_file_location(f"kvlab_tests_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [f for f in vars(module).values()
             if callable(f) and hasattr(f, "points") and getattr(f, "__module__", "") == module.__name__]
    tests.sort(key=lambda f: f.__code__.co_firstlineno)
    if not tests:
        raise ValueError(f"{path} holds no tests (functions marked with @points)")
    prepare = getattr(module, "prepare", None)
    if callable(prepare):
        prepare()               # whatever the tests read, read now, before any worker runs
    return tests


def title(test: Callable) -> str:
    doc = (test.__doc__ or "").strip().splitlines()
    return f"{test.__name__}: {doc[0].strip()}" if doc else test.__name__


def fingerprint(paths: List[Path]) -> Dict[str, str]:
    """sha256 of every file under `paths` (caches of compiled bytecode aside)."""
    digests = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts:
                continue
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters, all of them ones UTF-8 can write."""
    if len(text) > limit:
        text = text[:limit] + f"\n[... {len(text) - limit:,} more characters]"
    return text.encode("utf-8", "replace").decode("utf-8")


def read_regular(path: Path, limit: int = SUBMISSION_LIMIT) -> bytes:
    """The bytes of a regular file (not a link to one) of at most `limit` bytes; OSError
    otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path.name} is larger than {limit:,} bytes")
    return data


def read_c_submission(path: Path) -> str:
    """A C submission's source: a regular file of at most SUBMISSION_LIMIT bytes of UTF-8
    text, no NUL byte in it. OSError or UnicodeDecodeError otherwise."""
    data = read_regular(path)
    if b"\0" in data:
        raise OSError(f"{path.name} holds a NUL byte: it is not a text file")
    return data.decode("utf-8-sig")


def read_submission(path: Path) -> str:
    """The submission's source: a regular file (not a link to one), of at most
    SUBMISSION_LIMIT bytes, in UTF-8. OSError or UnicodeDecodeError otherwise."""
    data = read_regular(path)
    # Python reads a file in the encoding its coding line names; the check reads the text
    # as UTF-8. Another encoding (utf-7 hides code in what UTF-8 reads as a comment) would
    # have the check read one program and the worker run another: refused.
    # (lines as CPython's tokenizer splits them: a lone \r ends a line there too)
    lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(lines).readline)
    except SyntaxError as error:
        raise OSError(f"{path.name}: {error.msg}") from None
    if encoding not in ("utf-8", "utf-8-sig"):
        raise OSError(f"{path.name} declares the encoding {encoding}: save it as UTF-8 and "
                      f"remove its coding line")
    return data.decode("utf-8-sig")     # (a byte-order mark, as Windows editors write, is not code)


# faulthandler's dump of a thread's stack, as the worker prints it when asked where it is
_STACK = re.compile(r'^(?:Current thread 0x[0-9a-f]+ |Thread 0x[0-9a-f]+ |Stack )'
                    r'\(most recent call first\):\n.*?(?=^\S|\Z)', re.M | re.S)


def _where_stopped(printed: str, copy: Path) -> Tuple[str, str]:
    """(where in the student's file the worker was when it was stopped, or '';
    what it printed, less the stack dump that said so)."""
    line = re.compile(rf'File "{re.escape(str(copy))}", line (\d+) in (\S+)')
    found = next((f for dump in _STACK.finditer(printed) for f in [line.search(dump.group(0))] if f), None)
    where = f"line {found.group(1)} of your file, in {found.group(2)}" if found else ""
    return where, _STACK.sub("", printed)


def _printed(text: str) -> str:
    text = text.strip()
    if not text:
        return ""
    if len(text) > PRINTED_SHOWN:
        text = "..." + text[-PRINTED_SHOWN:]
    return "\n\nyour code printed:\n" + text


class Judge:
    def __init__(self, lab: Lab, submission: Path, tests_path: Path, graded_with: str,
                 seed: Optional[int] = None, test_timeout: float = TEST_TIMEOUT,
                 total_timeout: Optional[float] = None, worker_user: Optional[str] = None,
                 output_cap: int = OUTPUT_CAP, progress: bool = False):
        self.lab, self.submission, self.tests_path = lab, submission, tests_path
        self.graded_with = graded_with
        self.seed = secrets.randbits(32) if seed is None else int(seed)
        self.test_timeout, self.output_cap = float(test_timeout), output_cap
        self.total_timeout = total_timeout
        self.worker_user = worker_user or None
        self.progress = progress                   # each test's name on stderr as it starts
        check_worker_user(self.worker_user)        # a user who cannot run it fails now

    # ---- the folder the workers run in -------------------------------------------------
    def _stage(self, source: str) -> Path:
        """A private copy of the submission in a folder the worker can read and not write."""
        self.folder = Path(tempfile.mkdtemp(prefix="kvlab-judge-"))
        os.chmod(self.folder, 0o755)
        copy = self.folder / "code" / f"{self.lab.name}{self.lab.suffix}"
        for folder in (copy.parent, self.folder / "handouts"):     # testkit.handout_file's
            folder.mkdir()
            os.chmod(folder, 0o755)
        copy.write_text(source, encoding="utf-8")      # the text the check read, as UTF-8
        os.chmod(copy, 0o644)
        if self.lab.compiled:      # the grader's own header and harness, not the student's
            for name in (*self.lab.extra_files, *self.lab.build_files, "harness.py"):
                shutil.copyfile(self.lab.folder / name, copy.parent / name)
                os.chmod(copy.parent / name, 0o644)
        return copy

    def _scratch(self, index) -> Path:
        scratch = self.folder / f"scratch-{index}"
        scratch.mkdir(mode=0o700)
        if self.worker_user:
            import pwd
            entry = pwd.getpwnam(self.worker_user)
            os.chown(scratch, entry.pw_uid, entry.pw_gid)
        return scratch

    def _start(self, index: int, test: Callable, copy: Path, deadline: float) -> Session:
        """A worker for `test`, the submission imported (a C lab's library loaded);
        NotImported saying why if not."""
        gc.collect()        # the last test's garbage goes now, not inside this one's measurement
        try:
            worker = WorkerProcess(self._scratch(index), self.worker_user, self.output_cap,
                                   self.lab.max_processes)
        except OSError as error:            # no process to be had (a limit reached, say)
            raise NotImported(f"the grader could not start a process for your code ({error})") from None
        session = Session(worker, deadline, LentFunctions(self.lab.kvlab) if self.lab.kvlab else None)
        session.handouts = self.folder / "handouts"
        c_lab = self.lab.compiled
        try:
            session.ask({"op": "load_library", "library": str(copy.with_suffix(".so")),
                         "harness": str(copy.with_name("harness.py"))} if c_lab else
                        {"op": "load", "path": str(copy), "policy": self.lab.policy.to_dict()})
        except (RemoteError, WorkerGone) as error:
            if isinstance(error, WorkerTimeout):
                why = ("your library ran too long while it was loaded (what runs at load?)"
                       if c_lab else "your file ran too long while it was imported (is there "
                       "an endless loop outside the functions?)")
            else:
                why = ("your library could not be loaded: " if c_lab else
                       "your file could not be imported: ") + (
                    error.describe() if isinstance(error, RemoteError) else str(error))
            raise NotImported(why + _printed(worker.stop())) from None
        except BaseException:
            worker.stop()
            raise
        return session

    # ---- one test ----------------------------------------------------------------------
    def _limit(self, test: Callable) -> float:
        """The seconds a test may take: the judge's limit, times the test's own factor
        (@points(n, slow=k): a test that runs a real model)."""
        return self.test_timeout * getattr(test, "slow", 1)

    def _run_one(self, index: int, test: Callable, session: Session) -> TestResult:
        result = TestResult(title(test), 0.0, test.points, "", test.visibility, "failed")
        rng = np.random.default_rng([self.seed, index])
        try:
            said = test(Submission(session), rng)
            result.status, result.score = "passed", test.points
            if isinstance(said, str):   # what a passed test tells the student (a margin)
                result.output = _cut(said, MESSAGE_SHOWN)
        except AssertionError as error:
            result.output = str(error) or "a check failed"
        except RemoteError as error:
            result.output = error.describe()
        except WorkerTimeout:
            result.output = (f"ran too long: the test's {self._limit(test):g} s ran out (is "
                             f"there an endless loop, or a very slow one?)")
            session.worker.ask_where()
        except WorkerGone as error:
            result.output = str(error)
        except Exception as error:      # the test could not use what came back
            result.output = (f"the grader could not use what your code returned "
                             f"({type(error).__name__}: {error})")
        return result

    def _all_zero(self, tests: List[Callable], why: str) -> List[TestResult]:
        return [TestResult(title(t), 0.0, t.points, why, t.visibility, "failed") for t in tests]

    def run(self) -> GradeReport:
        started = time.monotonic()
        tests = load_tests(self.tests_path)
        import kvlab
        from . import handouts, served, testkit  # noqa: F401  (all the judge will import, imported now)
        guarded = [Path(kvlab.__file__).resolve().parent, self.tests_path.resolve()]
        before = fingerprint(guarded)
        report = GradeReport(self.lab.name, str(self.submission), [], "", 0.0,
                             self.graded_with, self.seed if self.graded_with == "hidden tests" else None)
        self.folder = None
        try:
            report.tests, report.output = self._grade(tests)
        finally:
            gone = sweep()
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
        if not gone:
            report.refused = "processes the code started could not be stopped"
            report.tests = self._all_zero(tests, "not graded: processes your code started "
                                                 "could not be stopped")
        changed = sorted(set(before.items()) ^ set(fingerprint(guarded).items()))
        report.output = _cut(report.output, MESSAGE_SHOWN)
        if changed:
            names = sorted({name for name, _ in changed})
            report.refused = "files of kvlab or of the tests changed during grading"
            report.tests = self._all_zero(tests, "not graded: files of kvlab or of the tests "
                                                 "changed during grading")
            report.output = ("grading refused: these files changed during grading (by the "
                             "code graded, or by someone editing them):\n  " + "\n  ".join(names[:10]))
        report.execution_time = time.monotonic() - started
        return report

    def _check_python(self) -> Path:
        """The Python submission read, checked against the lab's policy and staged."""
        try:
            source = read_submission(self.submission)
        except (OSError, UnicodeDecodeError) as error:
            why = f"your file could not be read as Python source: {error}"
            raise NotGraded(why, why) from None
        try:
            refused = check_source(source, self.lab.policy, self.submission.name)
        except SyntaxError as error:
            where = (f" at line {error.lineno}" + (f", column {error.offset}" if error.offset else "")
                     if error.lineno else "")
            text = f"\n    {error.text.rstrip()}" if error.text else ""
            raise NotGraded(f"your file has a syntax error{where}: {error.msg}{text}",
                            "not graded: your file has a syntax error (see above)") from None
        except (ValueError, RecursionError, MemoryError) as error:
            # what Python's parser raises for a NUL byte (some versions) or for expressions
            # nested deeper than it (or the check walking the tree) can follow
            raise NotGraded(f"your file could not be read as Python source: "
                            f"{type(error).__name__}: {error}", "not graded: see above") from None
        if refused:
            raise NotGraded("your file uses what this lab does not allow, so it is not graded:\n  "
                            + "\n  ".join(str(v) for v in refused),
                            "not graded: see the lines refused above")
        return self._stage(source)

    def _build_c(self) -> Tuple[Path, str]:
        """The C submission read, checked, staged and built by a worker: (the staged file,
        with the library beside it; the compiler's warnings)."""
        try:
            source = read_c_submission(self.submission)
        except (OSError, UnicodeDecodeError) as error:
            why = f"your file could not be read as C source: {error}"
            raise NotGraded(why, why) from None
        check = cbuild.check_cuda_source if self.lab.language == "cuda" else cbuild.check_c_source
        refused = check(source, self.lab.extra_files[0])
        if refused:
            raise NotGraded("your file uses what this lab does not allow, so it is not graded:\n  "
                            + "\n  ".join(str(v) for v in refused),
                            "not graded: see the lines refused above")
        copy = self._stage(source)
        scratch = self._scratch("build")
        built = scratch / copy.with_suffix(".so").name
        try:
            worker = WorkerProcess(scratch, self.worker_user, self.output_cap)
        except OSError as error:
            raise NotGraded(f"the grader could not start a process to build your file ({error})",
                            "not graded: see above") from None
        cuda = self.lab.language == "cuda"
        seconds = cbuild.CUDA_BUILD_SECONDS if cuda else cbuild.BUILD_SECONDS
        try:
            command = (cbuild.cuda_build_command if cuda else cbuild.build_command)(
                copy, built, copy.parent)
            session = Session(worker, time.monotonic() + seconds + 10)
            warnings, _ = session.ask({"op": "build", "command": command, "timeout": seconds})
        except (RemoteError, WorkerGone) as error:
            said = error.message if isinstance(error, RemoteError) else str(error)
            said = said.replace(str(copy.parent) + os.sep, "")    # "decode_kernel.c:3:5: ..."
            raise NotGraded(f"your file did not compile:\n{said}",
                            "not graded: your file did not compile (see above)") from None
        finally:
            worker.stop()
        try:       # the library as bytes (never loaded here), where every test's worker reads it
            data = read_regular(built, cbuild.LIBRARY_LIMIT)
        except OSError as error:
            raise NotGraded(f"the compiler left no library the grader could take ({error})",
                            "not graded: see above") from None
        copy.with_suffix(".so").write_bytes(data)
        os.chmod(copy.with_suffix(".so"), 0o644)
        said = warnings.strip().replace(str(copy.parent) + os.sep, "") if isinstance(warnings, str) else ""
        said = f"your file compiled with warnings:\n{said}" if said else ""
        # what the build changed for this machine's compiler (cbuild.int8_guard)
        note = "" if cuda else cbuild.build_note()
        return copy, "\n\n".join(filter(None, [note, said]))

    def _grade(self, tests: List[Callable]):
        try:
            if self.lab.compiled:
                copy, output = self._build_c()
            else:
                copy, output = self._check_python(), ""
        except NotGraded as error:
            return self._all_zero(tests, error.short), error.why
        end = None if self.total_timeout is None else time.monotonic() + self.total_timeout
        results: List[TestResult] = []
        for index, test in enumerate(tests):
            if end is not None and time.monotonic() > end:
                results += self._all_zero(tests[index:], "not run: the grading time ran out")
                break
            try:
                session = self._start(index, test, copy, time.monotonic() + self._limit(test))
            except NotImported as error:
                if index == 0:           # said once, at the top
                    what = "loaded" if self.lab.compiled else "imported"
                    return self._all_zero(tests, f"not graded: your file could not be "
                                                 f"{what} (see above)"), str(error)
                results.append(self._all_zero([test], _cut(str(error), MESSAGE_SHOWN))[0])
                continue
            if self.progress:
                print(f"  [{index + 1}/{len(tests)}] {test.__name__}", file=sys.stderr, flush=True)
            try:
                result = self._run_one(index, test, session)
            finally:
                printed = session.worker.stop()
            where, printed = _where_stopped(printed, copy)
            if where and result.output.startswith("ran too long"):
                result.output += f"\n  it was at {where}"
            if not result.passed:
                result.output = _cut(result.output, MESSAGE_SHOWN) + _printed(printed)
            results.append(result)
        return results, output


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.grading.judge",
                                     description="grade one lab submission (run by kvlab grade)")
    parser.add_argument("--lab", required=True)
    parser.add_argument("--submission", required=True)
    parser.add_argument("--tests", required=True, help="the test file to grade with")
    parser.add_argument("--graded-with", default="hidden tests",
                        choices=["hidden tests", "public checks"])
    parser.add_argument("--out", required=True, help="where to write the report (JSON)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT)
    parser.add_argument("--total-timeout", type=float, default=None)
    parser.add_argument("--worker-user", default=None,
                        help="run the student's code as this user (the judge must be root)")
    parser.add_argument("--progress", action="store_true", help="name each test as it starts")
    args = parser.parse_args(argv)
    if sys.flags.optimize:
        parser.error("the judge's checks are assert statements: run it without -O")
    require_worker_support()
    harden_judge()
    sys.dont_write_bytecode = True
    require_gpu(get_lab(args.lab))     # a GPU lab where there is none: refused, in words
    judge = Judge(get_lab(args.lab), Path(args.submission).absolute(), Path(args.tests).resolve(),
                  args.graded_with, args.seed, args.test_timeout, args.total_timeout,
                  args.worker_user, progress=args.progress)
    report = judge.run()
    write_atomically(args.out, json.dumps(report.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
