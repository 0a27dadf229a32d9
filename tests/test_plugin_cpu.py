"""kvlab.grading.plugin_cpu: the judge's reading of a worker's CPU time, which lab 15 charges
to the virtual clock (the cheat it closes, a drafter that runs the model in NumPy, is
instructor/cheats/serving_capstone/drafts_with_the_model_in_numpy.py)."""
import os
import subprocess
import sys
import time

import pytest

from kvlab.grading import plugin_cpu
from kvlab.grading.plugin_cpu import (CALL_ALLOWANCE_S, CREDIT_CALLS, MOST_SLOWER, PluginMeter,
                                      Slowness, process_cpu_seconds)

linux = pytest.mark.skipif(not plugin_cpu.LINUX, reason="reads /proc and Linux's CPU clocks")

CHILD = """
import sys, threading, time
def spin():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
thread = threading.Thread(target=spin)
thread.start()
thread.join()                    # a thread that has ended
print("spun", flush=True)
sys.stdin.read()
"""


def test_a_process_cpu_time_counts_its_threads_ended_ones_too():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        assert 0.25 <= process_cpu_seconds(child.pid) < 5.0
    finally:
        child.stdin.close()
        child.wait()
    assert process_cpu_seconds(child.pid) == 0.0         # gone: nothing more to read


TREE = """
import os, sys
if os.fork() == 0:                       # a grandchild, below a child that waits
    sys.stdin.read()
    os._exit(0)
print("forked", flush=True)
sys.stdin.read()
os.wait()
"""


@linux
def test_the_meters_fast_reading_of_the_process_tree_is_psutils():
    """The meter walks the tree at every step through /proc's children files
    (process.proc_children, a few small files); the sweep through psutil's table of every
    process. Both find the same processes below the judge (a kernel without
    /proc/PID/task/TID/children would leave the meter blind to what a worker starts)."""
    from kvlab.grading import process
    child = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "forked"
        fast = process.below(os.getpid(), process.proc_children)
        assert len(fast) >= 2 and child.pid in fast
        assert sorted(fast) == sorted(pid for pid, _ in process.descendants(os.getpid()))
    finally:
        child.stdin.close()
        child.wait()


JUDGE = """
import os, subprocess, sys, time
from kvlab.grading.plugin_cpu import started_processes_seconds
from kvlab.grading.process import harden_judge, sweep
harden_judge()                           # the judge reaps its workers' orphans
worker = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
if os.fork() == 0:                       # a child that detaches a spinner, and ends
    if os.fork() == 0:
        os.setsid()
        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass
        os._exit(0)
    os._exit(0)
os.wait()
sys.stdin.read()
'''], stdin=subprocess.PIPE)
seen, give_up = 0.0, time.monotonic() + 30     # (slower where other programs run)
while seen < 0.45 and time.monotonic() < give_up:
    time.sleep(0.05)
    seen = started_processes_seconds(worker.pid)
print(seen)
worker.stdin.close()
worker.wait()
sweep()
"""


@linux
def test_a_detached_process_of_the_worker_is_still_counted(tmp_path):
    """The worker forks a child that detaches a process (setsid) and ends: the process is
    no descendant of the worker any more, but the judge reaps orphans, so it is the
    judge's, and its CPU time is counted with the worker's started processes."""
    out = subprocess.run([sys.executable, "-c", JUDGE], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)   # (not the source folder: CI installs kvlab)
    assert out.returncode == 0, out.stderr
    assert 0.45 <= float(out.stdout) < 5.0, out.stdout


def test_a_call_is_charged_past_its_allowance_and_started_processes_whole():
    """A call may take its allowance and what the calls before it left (up to
    CREDIT_CALLS allowances); the rest is charged. Started processes are charged whole."""
    own, started = [1.0], [0.0]
    meter = PluginMeter(123, allowance_s=0.001, cpu=lambda pid: own[0],
                        started=lambda pid: started[0])
    for used in (0.0005, 0.001, 0.004, 0.0):       # the third call: 1 ms + 0.5 ms left over
        own[0] += used
        meter.called()
    assert meter() == pytest.approx(0.0025) and meter.calls == 4
    for _ in range(3 * CREDIT_CALLS):              # idle calls: the credit grows to its cap
        meter.called()
    own[0] += 0.1
    meter.called()
    assert meter() == pytest.approx(0.0025 + 0.1 - 0.001 * (CREDIT_CALLS + 1))
    started[0] = 0.02                                # a child process: every second of it
    own[0] -= 0.5                                    # a reading that goes back: nothing
    meter.called()
    charged = meter()
    assert charged == pytest.approx(0.0025 + 0.1 - 0.001 * (CREDIT_CALLS + 1) + 0.02)
    own[0] += 0.5 + 0.003          # only what passed the highest reading, less 2 allowances
    meter.called()
    assert meter() == pytest.approx(charged + 0.001)


def test_what_the_worker_computed_before_its_first_call_is_charged_past_its_startup():
    """startup_s: the worker's CPU seconds from its start (an import that built a table, a
    thread busy while the judge ran the baselines) beyond the allowance are charged at the
    first call, and every second its started processes used."""
    for used, charged in ((0.1, 0.0), (0.3, 0.0), (2.0, 2.0 - 0.3 - 0.001)):
        meter = PluginMeter(1, allowance_s=0.001, cpu=lambda pid: used,
                            started=lambda pid: 0.25, startup_s=0.3)
        meter.called()
        assert meter() == pytest.approx(charged + 0.25)


def test_what_an_import_left_of_the_startup_allowance_is_not_spent_on_the_calls():
    """A worker that imported in 0.1 s of its 0.3 s may not keep the other 0.2 s for its
    calls (a drafter running the model at the moments that matter): after the first call
    each is charged past its own allowance and credit alone."""
    own = [0.1]
    meter = PluginMeter(1, allowance_s=0.001, cpu=lambda pid: own[0],
                        started=lambda pid: 0.0, startup_s=0.3)
    meter.called()
    assert meter() == 0.0
    own[0] += 0.05                  # 50 ms in the second call: its allowance and the first's left
    meter.called()
    assert meter() == pytest.approx(0.05 - 0.002)


def test_a_metered_plugin_is_the_plugin_read_after_each_call():
    class Drafter:
        name = "mine"

        def propose(self, tokens, k, sampling=None):
            if k < 0:
                raise ValueError("k")
            return tokens[-k:]

    readings = []
    meter = PluginMeter(1, cpu=lambda pid: readings.append(pid) or 0.0, started=lambda pid: 0.0)
    drafter = meter.metered(Drafter(), "propose")
    assert drafter.propose([1, 2, 3], 2) == [2, 3] and drafter.name == "mine"
    with pytest.raises(ValueError):
        drafter.propose([1], -1)
    assert meter.calls == 2 and len(readings) == 3    # at its start, and after each call


def test_the_allowance_follows_the_machines_slowness_and_never_shrinks(monkeypatch):
    """Slowness times the judge's speed job once a step: on a machine three times slower
    (or as loaded) the calls' allowance is three times as large; never below the
    calibration machine's, nor above MOST_SLOWER times it."""
    meter = PluginMeter(1, cpu=lambda pid: 0.0, started=lambda pid: 0.0, slowness=Slowness())
    assert CALL_ALLOWANCE_S <= meter.allowance_s <= MOST_SLOWER * CALL_ALLOWANCE_S
    fast = plugin_cpu.speed_job

    def slower():
        end = time.thread_time() + 3 * plugin_cpu.SPEED_JOB_S
        while time.thread_time() < end:
            fast()
    monkeypatch.setattr(plugin_cpu, "speed_job", slower)
    for _ in range(31):                      # a step each: the window fills with slow times
        meter()
    assert meter.allowance_s >= 3 * CALL_ALLOWANCE_S
    monkeypatch.setattr(plugin_cpu, "speed_job", lambda: None)    # faster than ever
    for _ in range(31):
        meter()
    assert meter.allowance_s == CALL_ALLOWANCE_S


STARTS = '''
import shutil as _ue
import threading
_os = _ue.os                                     # os by another name, past the source check
seen = []
for start in (_os.fork, threading.Thread(target=print).start,
              lambda: _os.posix_spawnp("true", ["true"], {})):
    try:
        if start() == 0 and start is _os.fork:
            _os._exit(0)
        seen.append("started")
    except (OSError, RuntimeError) as error:
        seen.append(type(error).__name__)
raise RuntimeError(" ".join(seen))
'''


@linux
@pytest.mark.parametrize("max_processes, said", [
    (1, "BlockingIOError RuntimeError BlockingIOError"),
    (256, "started started started")])
def test_a_worker_that_must_be_alone_starts_nothing_whatever_its_user(tmp_path, max_processes,
                                                                     said):
    """Graded as the judge's own user (no worker user, as `kvlab grade` on a student's
    machine, or this test as root), lab 15's worker (max_processes 1) can start no process,
    thread or program, as on the autograder, where its user's RLIMIT_NPROC bars them; a lab
    that allows processes is left as it was."""
    import time as clock
    from kvlab.grading.labs import get_lab
    from kvlab.grading.process import WorkerProcess
    from kvlab.grading.remote import RemoteError, Session
    path = tmp_path / "submission.py"
    path.write_text(STARTS)
    worker = WorkerProcess(tmp_path, max_processes=max_processes)
    try:
        session = Session(worker, clock.monotonic() + 30)
        with pytest.raises(RemoteError) as raised:
            session.ask({"op": "load", "path": str(path),
                         "policy": get_lab("serving_capstone").policy.to_dict()})
        assert said in raised.value.message, raised.value.message
    finally:
        worker.stop()
