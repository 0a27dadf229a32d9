"""The judge's side of a worker process: start it, talk to it under a deadline, stop it.

Everything a submission might do to outlast or outtalk its test is handled here, from
outside the worker:
- time: every request waits at most until the test's deadline; then the worker's whole
  process group is killed (a student's code cannot ignore SIGKILL, as it could SIGALRM);
- output: the worker's stdout and stderr go to a pipe that a thread drains, keeping the
  first `output_cap` bytes, so a flood costs nothing but CPU;
- processes: on Linux the judge is a child subreaper, so anything the worker starts,
  double-forked or detached included, becomes the judge's child when its parent dies, and
  `sweep()` kills every descendant until none is left; a lab whose worker must be alone
  (max_processes 1) has it start none, whatever user it runs as (process_limits.py);
- identity: given a user, the worker runs as that user (the autograder creates one), so it
  cannot read the tests, write the results or signal the judge.

That is the hardened judge, for Linux (and so Gradescope). On macOS the same judge and
worker run with a weaker sandbox, which is enough for a student's own `kvlab check`: no
subreaper (a process the code detaches escapes the sweep), no closing to debuggers and no
death signal (SANDBOX_NOTE says so to the student).
Windows has no way to hand the worker the two pipe ends it talks over (pass_fds) nor to
wait on a pipe (select): WorkerProcess refuses there, in words (require_worker_support).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import psutil

from . import wire

WORKER_SCRIPT = Path(__file__).resolve().with_name("worker.py")
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "KVLAB_NUM_THREADS", "OMP_NUM_THREADS",
            "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
LINUX = sys.platform.startswith("linux")

# Said once wherever a student runs the judge off Linux (kvlab check / kvlab grade).
SANDBOX_NOTE = ("note: off Linux, kvlab's grader runs your code with a weaker sandbox (no "
                "reaping of processes it detaches, nor a worker that dies with the judge): fine "
                "for checking your work; grades come from the Linux autograder.")


class PlatformUnsupported(OSError):
    """The grader cannot run a worker on this system (Windows)."""


def require_worker_support() -> None:
    """Raise PlatformUnsupported, in words, where a worker cannot be run: the judge talks to
    it over two pipes it inherits by number (pass_fds) and waits on them with select, both of
    which are POSIX only."""
    if os.name != "posix":
        raise PlatformUnsupported(
            f"kvlab's grader (kvlab check, kvlab grade) runs your code in a process of its own "
            f"that it talks to over inherited pipes, which this system ({sys.platform}) does "
            f"not offer. Run it under WSL (Windows Subsystem for Linux), on macOS or on Linux.")


def sandbox_note() -> Optional[str]:
    """What a student off Linux should know about the sandbox; None on Linux."""
    return None if LINUX else SANDBOX_NOTE


class WorkerGone(Exception):
    """The worker cannot answer: it ran past the deadline, ended, or sent garbage."""


class WorkerTimeout(WorkerGone):
    pass


class WorkerDied(WorkerGone):
    pass


class WorkerGarbled(WorkerGone):
    pass


_SCHEDULING: Dict[str, object] = {}     # the judge's CPUs and priority when it started


def harden_judge() -> None:
    """Make this process the reaper of every orphan its workers leave, and keep processes
    of the same user from reading its memory or attaching a debugger (Linux only). Notes
    its CPUs and priority, which restore_scheduling puts back."""
    if not LINUX:
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _SCHEDULING.update(cpus=os.sched_getaffinity(0), nice=os.getpriority(os.PRIO_PROCESS, 0),
                       session_nice=_session_nice())


def _session_nice() -> Optional[int]:
    """The priority of this process's session among the others (the scheduler's autogroup:
    /proc/self/autogroup reads "/autogroup-N nice K"), or None where there is none."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def restore_scheduling() -> Optional[str]:
    """Every thread of this process back on the CPUs and at the priority harden_judge
    noted, and its session at its priority among the others: a process of the same user
    (the student's code, where it runs as the judge's user) can pin the judge's threads to
    one CPU or lower their priority or its session's, which outlasts `paused`, and so slow
    the judge's bandwidth probe down. None when all is as noted,
    else what could not be put back (raising a thread's priority again takes a privilege).
    Linux only: elsewhere nothing was noted, and None."""
    if not _SCHEDULING:
        return None
    cpus, nice, session = _SCHEDULING["cpus"], _SCHEDULING["nice"], _SCHEDULING["session_nice"]
    changed = []
    if session is not None and _session_nice() != session:
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(session))
        except OSError as error:
            changed.append(f"the session's priority: {error.strerror}")
    for task in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(task)) != cpus:
                os.sched_setaffinity(int(task), cpus)
            if os.getpriority(os.PRIO_PROCESS, int(task)) != nice:
                os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except PermissionError as error:         # a priority this user cannot raise again
            changed.append(f"thread {task}: {error.strerror}")
        except OSError:                          # a thread that ended meanwhile, or CPUs the
            continue                             # machine took away (no process of the user can)
    return None if not changed else ("the judge's threads were moved to other CPUs or a lower "
                                     "priority, and could not all be put back (" +
                                     "; ".join(changed[:3]) + ")")


def _live_threads_state(pid: int) -> str:
    """For a process whose first thread has ended ("Z" in /proc/PID/stat): "Z" if it is a
    zombie indeed, or, while other threads of it still run (the first one called
    pthread_exit), "stopped" when all of them are and "running" else. Linux only."""
    states = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
    except (OSError, IndexError):          # gone meanwhile
        return "Z"
    live = [s for s in states if s not in "ZX"]
    if not live:
        return "Z"
    return psutil.STATUS_STOPPED if all(s == "T" for s in live) else psutil.STATUS_RUNNING


def _process_table() -> Dict[int, Tuple[int, str]]:
    """pid -> (parent pid, state) of every process psutil sees; state is "Z" for a zombie
    (as /proc/PID/stat writes it), else psutil's word for it. A process whose first thread
    ended while others run on shows "Z" in /proc/PID/stat, but is no zombie: it has the
    state of its live threads (else pausing and sweeping skipped it, and its threads ran on
    through the bandwidth probe and past the test)."""
    table = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        parent, status = proc.info.get("ppid"), proc.info.get("status")
        if parent is None:             # gone meanwhile, or not ours to read
            continue
        state = str(status)
        if status == psutil.STATUS_ZOMBIE:
            state = _live_threads_state(proc.pid) if LINUX else "Z"
        table[proc.pid] = (parent, state)
    return table


def below(root: int, children: Callable[[int], List[int]]) -> List[int]:
    """The pids of every process below `root`, children(pid) giving a process's children:
    the one walk of the process tree, whichever way its links are read (descendants below;
    kvlab.grading.plugin_cpu, at every step of a metered run, with proc_children)."""
    found, frontier = [], [root]
    while frontier:
        for pid in children(frontier.pop()):
            found.append(pid)
            frontier.append(pid)
    return found


def proc_children(pid: int) -> List[int]:
    """The pids of `pid`'s children, read from /proc/PID/task/TID/children (Linux): a few
    small files, where psutil's table reads every process of the machine (about 0.02 ms
    against 4 ms with a hundred processes); [] once it is gone."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except (OSError, ValueError):           # gone meanwhile
        pass
    return found


def descendants(root: int) -> List[Tuple[int, str]]:
    """(pid, state) of every process below `root` (psutil's table: every OS, and the state
    of each)."""
    table = _process_table()
    children: Dict[int, List[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    return [(pid, table[pid][1]) for pid in below(root, lambda pid: children.get(pid, []))]


def sweep(patience: float = 5.0) -> bool:
    """Kill every descendant of this process and reap the ones that became its children.
    True when none is left. Off Linux the judge is no subreaper: what a process detached
    from its parent is no descendant any more, and only the process-group kill reaches it."""
    kill_signal = getattr(signal, "SIGKILL", signal.SIGTERM)
    deadline = time.monotonic() + patience
    while True:
        below = descendants(os.getpid())
        if not below:
            return True
        for pid, state in below:
            if state != "Z":
                try:
                    os.kill(pid, kill_signal)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid, _ in below:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:        # not ours to reap (yet): its parent will be
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)


@contextlib.contextmanager
def paused(patience: float = 5.0) -> Iterator[bool]:
    """Every descendant of this process (the workers and all they started) stopped with
    SIGSTOP for the block, and started again after it: while the judge measures the machine
    (the kernel lab's bandwidth probe), no code of the student's runs, so none can slow the
    measurement down. Yields whether all of them stopped within `patience` seconds (a
    process stuck in the kernel may not). On Linux the judge is their reaper, so a process
    the code detached is a descendant too; elsewhere it is not, and keeps running."""
    stop, go = getattr(signal, "SIGSTOP", None), getattr(signal, "SIGCONT", None)
    stopped: Dict[int, bool] = {}
    deadline = time.monotonic() + patience
    try:
        while stop is not None:
            below = [(pid, state) for pid, state in descendants(os.getpid()) if state != "Z"]
            if all(state == psutil.STATUS_STOPPED for _, state in below):
                break
            for pid, state in below:
                if state != psutil.STATUS_STOPPED:
                    try:
                        os.kill(pid, stop)
                        stopped[pid] = True
                    except (ProcessLookupError, PermissionError):
                        pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        yield stop is not None and time.monotonic() <= deadline
    finally:
        for pid in stopped:
            try:
                os.kill(pid, go)
            except (ProcessLookupError, PermissionError):
                pass


class OutputCapture(threading.Thread):
    """Drains a pipe, keeping the first `cap` bytes and counting the rest."""

    def __init__(self, fd: int, cap: int):
        super().__init__(daemon=True)
        self.fd, self.cap = fd, cap
        self.kept = bytearray()
        self.dropped = 0

    def run(self) -> None:
        try:
            while True:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    break
                room = self.cap - len(self.kept)
                self.kept += chunk[:max(room, 0)]
                self.dropped += max(len(chunk) - max(room, 0), 0)
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def text(self) -> str:
        text = self.kept.decode(errors="replace")
        if self.dropped:
            text += f"\n[... {self.dropped:,} more bytes of output not kept]"
        return text


def worker_identity(user: Optional[str]) -> Optional[Tuple[int, int]]:
    """(uid, gid) of `user`, whom the worker becomes (the judge must be root), or None."""
    if not user:
        return None
    try:
        import pwd
    except ImportError:
        raise ValueError(f"running submissions as {user!r} needs a POSIX system") from None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"no user named {user!r} to run submissions as (the autograder's "
                         f"setup.sh creates it)") from None
    if os.geteuid() != 0:
        raise ValueError(f"running submissions as {user!r} needs the judge to run as root")
    return entry.pw_uid, entry.pw_gid


def check_worker_user(user: Optional[str]) -> None:
    """Fail now, in words, if `user` cannot run this Python with NumPy (an interpreter
    under a folder only root can enter, say)."""
    identity = worker_identity(user)
    if not identity:
        return
    try:
        probe = subprocess.run([sys.executable, "-I", "-B", "-c", "import numpy"],
                               cwd="/", env={"PATH": os.environ.get("PATH", "")},
                               capture_output=True, text=True, timeout=60,
                               user=identity[0], group=identity[1], extra_groups=[])
    except OSError as error:
        raise RuntimeError(f"user {user!r} cannot run {sys.executable}: {error}") from None
    if probe.returncode != 0:
        raise RuntimeError(f"user {user!r} cannot run {sys.executable} with NumPy and "
                           f"{WORKER_SCRIPT}: {(probe.stderr or probe.stdout).strip()[-500:]}")


class WorkerProcess:
    """One worker: a Python process running worker.py in `folder`, answering requests."""

    def __init__(self, folder: Path, user: Optional[str] = None, output_cap: int = 64 << 10,
                 max_processes: int = 256):
        require_worker_support()
        self.folder = folder
        identity = worker_identity(user)
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        output_r, output_w = os.pipe()
        command = [sys.executable, "-I", "-B", str(WORKER_SCRIPT), str(to_worker_r),
                   str(from_worker_w)]
        command += ["--max-processes", str(max_processes)]   # 1: none at all, whatever user
        if identity:                    # the worker becomes the user itself
            command += ["--user", f"{identity[0]}:{identity[1]}"]
        env = {name: os.environ[name] for name in ENV_KEPT if name in os.environ}
        env.update(HOME=str(folder), TMPDIR=str(folder), MPLBACKEND="Agg",
                   PYTHONIOENCODING="utf-8")
        # The student's NumPy runs its products on one thread unless the grader's machine says
        # otherwise: BLAS threads that fight over a shared machine's cores made a student's
        # own-cache timings swing by 41-90x, and a timed step must measure the code, not them.
        for name in BLAS_THREADS:
            env.setdefault(name, "1")
        try:
            self.process = subprocess.Popen(
                command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=output_w,
                stderr=output_w, pass_fds=(to_worker_r, from_worker_w), close_fds=True,
                start_new_session=True)
        finally:
            for fd in (to_worker_r, from_worker_w, output_w):
                os.close(fd)
        self.requests, self.answers = to_worker_w, from_worker_r
        os.set_blocking(self.requests, False)
        self.output = OutputCapture(output_r, output_cap)
        self.output.start()
        self.stopped = False

    # ---- one request, one answer, before a deadline ------------------------------------
    def _wait(self, fd: int, writing: bool, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerTimeout("time is up")
        ready = select.select([], [fd], [], left) if writing else select.select([fd], [], [], left)
        if not any(ready):
            raise WorkerTimeout("time is up")

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        chunks, left = [], n
        while left:
            self._wait(self.answers, False, deadline)
            chunk = os.read(self.answers, min(left, 1 << 20))
            if not chunk:
                raise WorkerDied(self.exit_description())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def request(self, message: dict, deadline: float):
        """Send `message`, return the decoded answer (a dict)."""
        self.send(message, deadline)
        return self.receive(deadline)

    def send(self, message: dict, deadline: float) -> None:
        """Send one frame: a request, or the reply to a call the worker made to the judge."""
        view = memoryview(wire.frame(wire.encode(message)))
        while view:
            self._wait(self.requests, True, deadline)
            try:
                view = view[os.write(self.requests, view):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise WorkerDied(self.exit_description()) from None

    def receive(self, deadline: float) -> dict:
        """The worker's next frame, decoded: an answer, or a call it makes to the judge."""
        try:
            length = wire.frame_length(self._read_exactly(wire.HEADER_SIZE, deadline))
            answer = wire.decode(self._read_exactly(length, deadline))
        except (wire.WireError, ValueError, TypeError, MemoryError, RecursionError) as error:
            raise WorkerGarbled(f"the worker process sent something unreadable ({error})"[:500]) from None
        if type(answer) is not dict:
            raise WorkerGarbled("the worker process sent something that is not an answer")
        return answer

    def exit_description(self) -> str:
        try:
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "the worker process stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the Python process running your code was killed by {name}"
        return f"the Python process running your code ended (exit status {code})"

    def ask_where(self) -> None:
        """Have the worker print where its main thread is (faulthandler, on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1"):
            return
        try:
            os.kill(self.process.pid, signal.SIGUSR1)
            time.sleep(0.3)
        except (ProcessLookupError, PermissionError):
            pass

    # ---- the end -----------------------------------------------------------------------
    def stop(self) -> str:
        """Kill the worker, everything it started, and return what it printed."""
        if not self.stopped:
            self.stopped = True
            for fd in (self.requests, self.answers):
                try:
                    os.close(fd)
                except OSError:
                    pass
            for kill in (os.killpg, os.kill):    # its group, and itself if it left the group
                try:
                    kill(self.process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.process.wait()
            sweep()
            self.output.join(timeout=2.0)
        return self.output.text()
