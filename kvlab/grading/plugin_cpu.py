"""The CPU time a worker spends on plug-ins the judge's engine asks, read by the judge from
the kernel: the meter of kvlab.slo.VirtualClock in the capstone lab (lab 15).

The virtual clock prices what the engine computes (tokens, sequences, K/V rows, bytes), so
compute done in the student's plug-ins would be free: a drafter that rebuilds the model in
NumPy drafts perfectly at no cost on the clock. A PluginMeter charges it. It reads, from
outside the worker and never from a number the worker reports:

- the worker process's own CPU time, every thread of it (live or ended), after each plug-in
  call (Linux: the process's CPU-time clock, to the nanosecond; elsewhere psutil's, coarser).
  Each call is charged what the process used since the last reading, less an allowance
  (CALL_ALLOWANCE_S, scaled to the machine's speed now, and what the calls before it left
  unused, up to CREDIT_CALLS allowances): what the call's round trip itself costs the
  worker (decoding the question, encoding the answer) and a plain Python answer, which the
  step's fixed price already holds, as it holds the plan of kvlab's own scheduler. So work
  a thread of the worker does between calls is charged at the next call;
- the processes the worker started (and the ones they waited for), detached ones included
  (the judge reaps orphans, so they stay below it), charged whole at each step: none of it
  answers a call (Linux only; elsewhere they are not seen);
- from the worker's start to its first call (the import of the submission, its
  constructors, a thread busy while the judge ran other work): all but STARTUP_ALLOWANCE_S,
  which ends there (what the import left of it is not carried into the calls).

What it cannot see: a child process that ends and is reaped without being waited for (its
parent ignoring SIGCHLD, or with SA_NOCLDWAIT) between two readings: its CPU time is lost
to every count the kernel keeps that the judge can read. So lab 15's worker may start no
process or thread (kvlab.grading.labs' max_processes of 1): on Linux a seccomp filter it
installs on itself bars them whatever user it runs as (process_limits.py), and as the
autograder's user RLIMIT_NPROC does too; off Linux, as a user other than root, the limit
bars processes (threads are the process's CPU time anyway); as root off Linux nothing is
barred, and such a child's CPU time is counted only while the judge sees it.

What it leaves free, exactly: each call's allowance, CALL_ALLOWANCE_S times the slowness
then (1 to MOST_SLOWER), no more than CREDIT_CALLS + 1 of them spent by one call; and the
startup's allowance, which ends at the first call. The allowances stand for the call's
round trip and a plain Python answer, which the step's fixed price holds: the baselines'
plans run in the judge, with no round trip, at no charge. What an honest call uses of
its allowance (the round trip alone about 80 us quiet) is the rest's measure: on seeds 7,
11 and 3, under a load of about 5 on 2 cores, the reference solution made 1,690-1,870
calls, the slowness 1.0-1.7, 560-590 ms of allowances, of which its worker used 215-280
ms, so 0.3 s of CPU was left that a cheat could spend uncharged, split across the calls
(on a quiet machine about 0.2 s; under heavy load up to MOST_SLOWER times as much). The
cheat that spends it on the bundled model in NumPy (drafts_with_the_model_on_the_allowances)
gained no tier, and the drafting tests' model is nudged at grading time (the grader's
nudged_model), so no copy of it, nor its answers, is the one graded. The startup's 0.3 s
buys nothing a file cannot carry: before its first call the worker knows neither the
workload nor the model. CPU time, unlike the engine's prices, depends on the machine and
its load, so a run whose plug-ins are charged is repeatable only as far as their CPU time
is: an honest plug-in stays within its allowances, and its run is the same every time.
"""
from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from typing import Callable, Optional

from . import process

# CPU seconds a plug-in call may take uncharged (see above) on the machine the kit was
# calibrated on (the 2-core build machine of kvlab.slo's prices), quiet: the reference
# solution's calls take 80-130 us there (median; the round trip alone 80), and a pass of the
# bundled model in NumPy, the drafter this is here for, 0.6 ms or more. Under load the same
# calls take twice as long or more (CPU time too: caches and cores are shared), so the meter
# scales it by how slowly the judge runs speed_job meanwhile (Slowness).
CALL_ALLOWANCE_S = 0.25e-3
# The worker's CPU seconds from its start to its first plug-in call that are not charged,
# scaled the same way: Python, NumPy and an honest submission's import take about 0.1 s
# there. Beyond, what it computed before (at import, or in a thread while the judge ran
# other work) is charged at the first call: a table computed in advance is not free either.
STARTUP_ALLOWANCE_S = 0.3
SPEED_JOB_S = 28e-6              # speed_job()'s best CPU time on that machine, quiet
MOST_SLOWER = 4.0                # the allowance grows at most this much
# A call's allowance unused is kept for the next calls, up to this many calls' worth: under
# load one call in twenty or so of an honest plug-in takes twice its median, and charging
# those alone moved the reference solution's goodput by 5 % (a run whose plug-ins are never
# charged is the same every time). It frees no more CPU time in all (a cheat could as well
# split its work across calls), only lets a call take more of it.
CREDIT_CALLS = 8
LINUX = sys.platform.startswith("linux")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used, all its threads (those that ended too); 0.0 once
    it is gone. Linux reads the kernel's CPU-time clock of the process (clock_getcpuclockid's
    clock id, which the kernel makes from the pid)."""
    if LINUX:
        try:
            return time.clock_gettime((~pid << 3) | 2)      # CPUCLOCK_SCHED of the process
        except OSError:
            return 0.0
    import psutil
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def speed_job() -> int:
    """A little plain Python, as a plug-in call's round trip is (strings, lists, a sum)."""
    words = [str(i) for i in range(300)]
    return sum(len(w) for w in words if w[-1] in "13579")


class Slowness:
    """How much slower than the calibration machine, quiet, this machine runs plain Python
    now: speed_job's CPU time, timed once a step by the judge, over SPEED_JOB_S, the median
    of the last `window` (at least 1, at most MOST_SLOWER). The judge's timing runs beside
    the worker under the same load; the student's code could slow it down only by work of
    its own, which the meter charges."""

    def __init__(self, window: int = 31, first: int = 9):
        self.times: collections.deque = collections.deque(maxlen=window)
        for _ in range(first):
            self.time_one()

    def time_one(self) -> None:
        started = time.thread_time()
        speed_job()
        self.times.append(time.thread_time() - started)

    def factor(self) -> float:
        return min(MOST_SLOWER, max(1.0, statistics.median(self.times) / SPEED_JOB_S))


def _stat_seconds(pid: int, own: bool) -> float:
    """From /proc/PID/stat, in seconds: with own, the process's user and system time and
    its waited-for children's; without, its waited-for children's alone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ((utime + stime if own else 0) + cutime + cstime) / TICKS


def started_processes_seconds(pid: int, root: Optional[int] = None) -> float:
    """CPU seconds of what worker `pid` started: the children it waited for, and every
    process below `root` (this process, the judge, by default) but the worker, with what
    they waited for. The judge is the reaper of the orphans its workers leave
    (process.harden_judge), so a process the worker detached is still below it. Linux only
    (0.0 elsewhere); counted in clock ticks (10 ms), as /proc gives them."""
    if not LINUX:
        return 0.0
    below = process.below(os.getpid() if root is None else root, process.proc_children)
    return _stat_seconds(pid, own=False) + sum(_stat_seconds(p, own=True)
                                               for p in below if p != pid)


class PluginMeter:
    """Charges the CPU time of plug-ins that run in worker process `pid` (see the module
    text). Wrap each plug-in with metered() before handing it to the engine; give the
    meter itself to kvlab.slo.VirtualClock(meter=), which reads it at each step: the CPU
    seconds charged so far. A call's allowance is allowance_s times the machine's
    slowness now (None: a constant allowance_s, for tests). startup_s: None to charge only
    what the worker uses from now on; else the CPU seconds of its own from its start (times
    the slowness) that are not charged, all else being charged at the first call."""

    def __init__(self, pid: int, allowance_s: float = CALL_ALLOWANCE_S,
                 cpu: Callable[[int], float] = process_cpu_seconds,
                 started: Callable[[int], float] = started_processes_seconds,
                 slowness: Optional[Slowness] = None, startup_s: Optional[float] = None):
        self.pid, self.base_allowance_s = pid, allowance_s
        self._cpu, self._started, self.slowness = cpu, started, slowness
        factor = slowness.factor() if slowness else 1.0
        self.allowance_s = allowance_s * factor
        self._last = cpu(pid) if startup_s is None else startup_s * factor
        self._started_last = started(pid) if startup_s is None else 0.0
        self.calls, self.charged, self.credit_s = 0, 0.0, 0.0

    def called(self) -> None:
        """A plug-in call has just returned: charge what the worker used since the last
        reading beyond the allowance."""
        now = self._cpu(self.pid)
        free = self.allowance_s + self.credit_s
        used = max(0.0, now - self._last)
        self.charged += max(0.0, used - free)
        self.credit_s = min(CREDIT_CALLS * self.allowance_s, max(0.0, free - used))
        # The startup's allowance ends at the first call: what an import left of it is not
        # kept (it would be a lump of up to STARTUP_ALLOWANCE_S times the slowness to
        # spend on the calls, a whole model's passes at the moments that matter), only the
        # calls' own credit. After it, a reading that goes back frees nothing.
        self._last = now if self.calls == 0 else max(now, self._last)
        self.calls += 1

    def __call__(self) -> float:
        """At a step's end: its started processes' CPU time charged, the allowance set
        for the next step's calls; the CPU seconds charged so far."""
        started = self._started(self.pid)
        self.charged += max(0.0, started - self._started_last)
        self._started_last = max(started, self._started_last)
        if self.slowness is not None:
            self.slowness.time_one()
            self.allowance_s = self.base_allowance_s * self.slowness.factor()
        return self.charged

    def metered(self, plugin, method: str):
        """`plugin` with its method `method` read by this meter after every call."""
        return _Metered(plugin, method, self)


class _Metered:
    """A plug-in whose one method is metered; every other attribute is the plug-in's."""

    def __init__(self, plugin, method: str, meter: PluginMeter):
        self._plugin, self._method, self._meter = plugin, method, meter
        setattr(self, method, self._call)

    def _call(self, *args, **kwargs):
        try:
            return getattr(self._plugin, self._method)(*args, **kwargs)
        finally:
            self._meter.called()

    def __getattr__(self, name):
        return getattr(self._plugin, name)


def worker_pid(sub) -> Optional[int]:
    """The pid of the worker process a test's `sub` (kvlab.grading.remote.Submission)
    calls into."""
    session = object.__getattribute__(sub, "_session")
    return session.worker.process.pid
