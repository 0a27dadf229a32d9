"""The pytest plugin behind `kvlab grade`: loads the submission, scores each test.

pytest runs a lab's grader file with `-p kvlab.grading.plugin --submission FILE
--results-json OUT`. Each test asks for the `submission` fixture (the student's file,
imported as a module) and carries `@pytest.mark.points(n)`; this plugin records for every
test whether it passed, its points and a short message saying why not, and writes them as
JSON at the end. A test that runs past --test-timeout seconds fails on its own (an infinite
loop costs that test's points, not the whole grade).
"""
from __future__ import annotations

import importlib.util
import json
import signal
import sys
import traceback
from pathlib import Path

import pytest

MAX_OUTPUT = 2000      # characters of failure text kept per test


def pytest_addoption(parser):
    group = parser.getgroup("kvlab grading")
    group.addoption("--submission", help="the student's Python file")
    group.addoption("--results-json", help="where to write the per-test results")
    group.addoption("--test-timeout", type=float, default=60.0,
                    help="seconds one test may run before it fails")


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what passing this test is worth")
    config.addinivalue_line("markers", "visibility(v): visible, hidden, after_due_date, "
                                       "after_published (Gradescope's names)")
    config._kvlab_results = {}
    config._kvlab_order = []


class SubmissionError(Exception):
    """The submission could not be imported; every test that needs it fails with this."""


@pytest.fixture(scope="session")
def submission(pytestconfig):
    path = pytestconfig.getoption("submission")
    if not path:
        raise SubmissionError("no --submission file given")
    path = Path(path).resolve()
    if not path.is_file():
        raise SubmissionError(f"submission {path} does not exist")
    spec = importlib.util.spec_from_file_location("submission", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["submission"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:   # a syntax error or a crash at import: say so plainly
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        raise SubmissionError("could not import your file:\n" + "".join(lines[-4:])) from None
    return module


def _points(item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker else 1.0


def _visibility(item) -> str:
    marker = item.get_closest_marker("visibility")
    return marker.args[0] if marker else "visible"


def _title(item) -> str:
    doc = (getattr(item.obj, "__doc__", None) or "").strip().splitlines()
    return f"{item.name}: {doc[0]}" if doc else item.name


def _why(report, submission_path) -> str:
    """What went wrong, in the words of the exception, plus where in the student's file."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return str(report.longrepr)[-MAX_OUTPUT:]
    message = crash.message
    if message.startswith("NotImplementedError"):
        message = "not written yet (" + message + ")"
    where = ""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", [])
    for entry in entries:
        location = getattr(entry, "reprfileloc", None)
        if location and submission_path and Path(location.path).name == Path(submission_path).name:
            where = f"\n  at line {location.lineno} of your file"
    return (message + where)[:MAX_OUTPUT]


def _on_alarm(signum, frame):
    raise TimeoutError("this test ran too long: is there an infinite loop, or a very slow one?")


def _timed(item):
    """Fail the current phase of a test (fixture setup, which imports the submission, or
    the test itself) if it runs past --test-timeout seconds."""
    timeout = item.config.getoption("test_timeout")
    can_time = hasattr(signal, "setitimer") and timeout > 0
    if can_time:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        if can_time:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    results = item.config._kvlab_results
    if item.nodeid not in results:
        item.config._kvlab_order.append(item.nodeid)
        results[item.nodeid] = {"name": _title(item), "score": 0.0, "max_score": _points(item),
                                "output": "", "visibility": _visibility(item),
                                "status": "failed"}
    result = results[item.nodeid]
    if report.failed:
        result["status"], result["score"] = "failed", 0.0
        if not result["output"]:
            result["output"] = _why(report, item.config.getoption("submission"))
    elif report.when == "call" and report.passed and not result["output"]:
        result["status"], result["score"] = "passed", result["max_score"]
    elif report.skipped:
        result["status"], result["output"] = "failed", "skipped: " + str(report.longrepr)[-300:]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("results_json")
    if not path:
        return
    results = session.config._kvlab_results
    tests = []
    for nodeid in session.config._kvlab_order:
        tests.append(results[nodeid])
    Path(path).write_text(json.dumps({"tests": tests}, indent=2))
