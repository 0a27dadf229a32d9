"""kvlab check and kvlab grade off Linux (issue 34, "every student's OS").

Other systems are simulated here: sys.platform set to what macOS or Windows report, the
POSIX-only modules made unimportable, /proc left unread. The hardened Linux judge is what the
other grading tests exercise; these show what changes elsewhere, and that Linux's memory
figures are still /proc's own.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from kvlab import process_memory
from kvlab.grading import process

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTOR = ROOT / "instructor"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _env():
    """The environment of a child Python: it imports the kvlab these tests import (installed,
    or built in place), never the source folder, which has no compiled extension in CI."""
    import kvlab
    env = dict(os.environ)
    here = str(Path(kvlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return env


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)


# ---- resident memory ---------------------------------------------------------------------
@linux_only
def test_resident_bytes_on_linux_is_procs_vmrss_and_psutils_rss():
    """The same number as before (VmRSS), and psutil's rss agrees within a page."""
    for _ in range(20):                # memory may move between two reads: some pair agrees
        with open("/proc/self/status") as f:
            vmrss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        ours, theirs = process_memory.resident_bytes(), psutil.Process().memory_info().rss
        if abs(ours - 1024 * vmrss) <= PAGE and abs(ours - theirs) <= PAGE:
            break
    else:
        pytest.fail(f"resident_bytes {ours:,}, VmRSS {1024 * vmrss:,}, psutil rss {theirs:,}")
    assert ours > 0


def test_resident_bytes_without_proc_comes_from_psutil(monkeypatch):
    """macOS and Windows have no /proc: the figure was 0 there, so cache_size's measured
    check could never pass. Now it is psutil's, and it grows with what is allocated."""
    monkeypatch.setattr(process_memory, "PROC", False)
    assert process_memory.status_kib("VmRSS") == 0
    before = process_memory.resident_bytes()
    assert before > 0
    assert abs(before - psutil.Process().memory_info().rss) <= 64 * PAGE
    block = bytearray(64 << 20)                        # zero-filled: its pages are written
    grown = process_memory.resident_bytes() - before
    assert grown >= 48 << 20, f"64 MiB allocated, resident grew by {grown:,} B"
    del block


def test_no_figure_is_zero_not_a_crash(monkeypatch):
    """Without /proc and without psutil (a broken install) the figure is 0, as it was."""
    monkeypatch.setattr(process_memory, "PROC", False)
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert process_memory.resident_bytes() == 0


# ---- process trees -----------------------------------------------------------------------
def test_descendants_finds_a_grandchild_and_sweep_kills_it(tmp_path):
    """The judge's sweep walks the tree with psutil: a child's child is found and killed."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("started", flush=True); time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "started"
        below = dict(process.descendants(os.getpid()))
        assert child.pid in below
        grandchildren = [pid for pid in below if psutil.Process(pid).ppid() == child.pid]
        assert len(grandchildren) == 1
        assert process.sweep() is True
        assert process.descendants(os.getpid()) == []          # killed, and reaped
        assert not psutil.pid_exists(child.pid)
        try:                       # an orphan now (this is no subreaper): dead, if not yet reaped
            assert psutil.Process(grandchildren[0]).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    finally:
        child.kill()
        child.wait()


def test_a_process_whose_first_thread_ended_is_paused_and_swept():
    """A process whose first thread called pthread_exit shows "Z" in /proc/PID/stat while
    its other threads run on: the judge takes it by those threads' state, so that pausing
    stops it (it ran on through the kernel lab's bandwidth probe) and the sweep kills it (it
    outlived its test)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("pthread_exit of a first thread as /proc shows it: Linux")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import ctypes, threading
        def work():
            while True:
                sum(range(1000))
        threading.Thread(target=work).start()
        print("started", flush=True)
        ctypes.CDLL(None).pthread_exit(None)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:   # the first thread gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert dict(process.descendants(os.getpid()))[child.pid] != "Z"
        tasks = Path(f"/proc/{child.pid}/task")
        with process.paused() as stopped:
            assert stopped
            live = [(tasks / t / "stat").read_text().rpartition(")")[2].split()[0]
                    for t in os.listdir(tasks)]
            assert [s for s in live if s not in "ZX"] == ["T"], live
        assert process.sweep() is True and process.descendants(os.getpid()) == []
    finally:
        child.kill()
        child.wait()


# ---- the platforms, simulated ------------------------------------------------------------
WINDOWS = """
import sys
import numpy, psutil                   # their backends are the real system's
for name in ("pwd", "grp", "resource", "fcntl", "termios"):
    sys.modules[name] = None           # what Windows lacks: importing them fails
sys.platform = "win32"
import importlib.util
import kvlab.grading, kvlab.grading.judge, kvlab.grading.process, kvlab.grading.runner
import kvlab.grading.autograder, kvlab.grading.batch, kvlab.cli
spec = importlib.util.spec_from_file_location("w", kvlab.grading.process.WORKER_SCRIPT)
worker = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker)
assert worker.resource is None
worker._limit_resources(0, own_user=False)    # nothing to limit, no AttributeError
worker._limit_resources(1, own_user=True)     # nor for lab 15's one process
from kvlab.grading import process
from pathlib import Path
assert process.sandbox_note() == process.SANDBOX_NOTE
try:
    process.worker_identity("nobody")
except ValueError as error:
    print("identity:", error)
import os
here = Path(".")
os.name = "nt"                         # last: the standard library reads it at import
for attempt in (lambda: process.WorkerProcess(here),
                lambda: kvlab.grading.check("cache_size", "x.py")):
    try:
        attempt()
    except process.PlatformUnsupported as error:
        assert isinstance(error, OSError)
        print("refused:", error)
print("cli:", kvlab.cli.main(["check", "cache_size", "x.py"]))
"""


def test_grading_imports_and_refuses_in_words_on_windows(tmp_path):
    """Without pwd, resource or fcntl the grading modules import; a check then says what
    Windows lacks and what to use instead (not an AttributeError)."""
    run = _python(WINDOWS, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "identity: running submissions as 'nobody' needs a POSIX system" in run.stdout
    refused = [line for line in run.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2 and all("WSL" in line for line in refused), run.stdout
    assert "cli: 2" in run.stdout
    assert "kvlab: error: kvlab's grader" in run.stderr and "WSL" in run.stderr


MACOS = """#!{python}
# Runs Python as if on macOS: sys.platform is "darwin" (so no /proc, no prctl), and every
# process the judge starts (itself, its workers) is started through this file too.
import runpy, sys
import numpy, psutil, resource         # their backends are the real system's
sys.platform = "darwin"
sys.executable = __file__
args = sys.argv[1:]
while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
    if args.pop(0) == "-B":
        sys.dont_write_bytecode = True
if args[0] == "-m":
    sys.argv = [args[1]] + args[2:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""


@pytest.fixture
def macos(tmp_path):
    wrapper = tmp_path / "python-as-macos"
    wrapper.write_text(MACOS.format(python=sys.executable))
    wrapper.chmod(0o755)
    return wrapper


def test_the_wrapper_simulates_macos(macos, tmp_path):
    probe = ("import sys; from kvlab import process_memory as m; "
             "print(sys.platform, m.PROC, m.resident_bytes() > 0, m.status_kib('VmRSS'))")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    run = subprocess.run([str(macos), "-B", str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["darwin", "False", "True", "0"]


@pytest.mark.skipif(not (INSTRUCTOR / "solutions" / "cache_size.py").is_file(),
                    reason="needs the course's solutions (instructor/)")
def test_kvlab_check_on_macos_runs_the_public_checks_end_to_end(macos, tmp_path):
    """`kvlab check cache_size` on (simulated) macOS: the judge and its workers run without
    /proc or prctl, the sandbox note is said once, and every public check passes, the
    measured one included (its resident memory comes from psutil)."""
    run = subprocess.run([str(macos), "-m", "kvlab.cli", "check", "cache_size",
                          str(INSTRUCTOR / "solutions" / "cache_size.py")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert run.stdout.count(process.SANDBOX_NOTE) == 1
    assert "lab cache_size: 5 / 5 points" in run.stdout, run.stdout[-2000:]
    assert "PASS    1/1    test_a_small_measurement" in run.stdout, run.stdout[-2000:]


def test_linux_states_no_weaker_sandbox():
    assert process.sandbox_note() is (None if sys.platform.startswith("linux") else process.SANDBOX_NOTE)


def test_the_judge_puts_its_threads_back_on_its_cpus_and_priority(monkeypatch):
    """A process of the judge's user can pin the judge's threads to one CPU and lower their
    priority and its session's, which stopping the student's processes does not undo:
    restore_scheduling puts them back as harden_judge noted them before the bandwidth
    probe, or says what it could not (a priority only a privilege raises again)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("thread affinity and priority: Linux")
    cpus = os.sched_getaffinity(0)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    session = process._session_nice()
    monkeypatch.setattr(process, "_SCHEDULING", {"cpus": cpus, "nice": nice, "session_nice": session})
    assert process.restore_scheduling() is None                  # nothing moved
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
        for tid in threads:
            os.sched_setaffinity(tid, {min(cpus)})
            os.setpriority(os.PRIO_PROCESS, tid, min(nice + 5, 19))
        said = process.restore_scheduling()
        assert all(os.sched_getaffinity(tid) == cpus for tid in threads)
        if os.geteuid() == 0:                 # root raises a priority again; others cannot
            assert said is None
            assert all(os.getpriority(os.PRIO_PROCESS, tid) == nice for tid in threads)
        else:
            assert said and "priority" in said
    finally:
        stop.set()
        thread.join()
        for tid in [int(t) for t in os.listdir("/proc/self/task")]:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass
