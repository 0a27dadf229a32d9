"""A worker that may start nothing: no process, no thread, whatever user it runs as.

Loaded by worker.py by path (like wire.py and policy.py: the worker imports nothing of
kvlab's as kvlab), and called before the student's code is read, for a lab whose worker must
be alone (kvlab.grading.labs' max_processes of 1: lab 15, whose judge charges the worker's
CPU time to the virtual clock). The judge counts a process the worker starts only while it
can see it: one that ends and is reaped unwaited between two readings (its parent ignoring
SIGCHLD) is lost to every count it can read (kvlab.grading.plugin_cpu). On the autograder
the worker runs as a user of its own whose RLIMIT_NPROC is 1, which bars both; a grading as
the judge's own user (`kvlab grade` on a student's machine) could not use that limit (it
counts every process of the user: the student's desktop, the judge) and barred nothing.

So on Linux (x86-64 and arm64) the worker installs a seccomp filter, which any process may
install on itself without a privilege once it has given up gaining any (no_new_privs):
fork, vfork, clone and clone3 fail with EAGAIN, as under RLIMIT_NPROC, and a system call of
another ABI (x86-64's 32-bit int 0x80 calls) fails whatever it is. It holds for every thread
of the process (TSYNC) and for good: nothing the student's code can call removes a filter.
Elsewhere, a worker not run by root gets RLIMIT_NPROC 1, which on macOS bars a process
(the user has others) but not a thread (whose CPU time is the process's anyway); run by root
there, nothing is barred, and forbid_new_tasks says so.
"""
import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
EAGAIN, EPERM = 11, 1
# BPF opcodes: load a word of seccomp_data, AND, jump if equal, return
LD_W_ABS, ALU_AND_K, JEQ_K, RET_K = 0x20, 0x54, 0x15, 0x06
X32_BIT = 0x40000000        # x86-64's x32 calls: the same numbers with this bit set

# machine: (its audit arch, the seccomp system call's number, the calls that start a task)
ABIS = {
    "x86_64": (0xC000003E, 317, (56, 57, 58, 435)),     # clone, fork, vfork, clone3
    "aarch64": (0xC00000B7, 277, (220, 435)),           # clone, clone3 (no fork, no vfork)
}


def _filter(arch: int, calls) -> bytes:
    """The BPF program: another ABI's calls refused (EPERM), `calls` refused (EAGAIN), the
    rest allowed. seccomp_data holds the call's number at offset 0 and the arch at 4."""
    refuse_at = 5 + len(calls) + 1            # the last instruction's index: 5 before the
                                              # calls' tests, and the allow
    program = [(LD_W_ABS, 0, 0, 4),
               (JEQ_K, 1, 0, arch),
               (RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),
               (LD_W_ABS, 0, 0, 0),
               (ALU_AND_K, 0, 0, ~X32_BIT & 0xFFFFFFFF)]
    for call in calls:
        program.append((JEQ_K, refuse_at - (len(program) + 1), 0, call))
    program += [(RET_K, 0, 0, SECCOMP_RET_ALLOW), (RET_K, 0, 0, SECCOMP_RET_ERRNO | EAGAIN)]
    assert len(program) - 1 == refuse_at
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)


def _seccomp(abi) -> None:
    """Install the filter on every thread of this process; OSError if the kernel refuses."""
    arch, seccomp_call, calls = abi
    code = _filter(arch, calls)
    buffer = ctypes.create_string_buffer(code, len(code))
    program = struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(seccomp_call), ctypes.c_ulong(SECCOMP_SET_MODE_FILTER),
                    ctypes.c_ulong(SECCOMP_FILTER_FLAG_TSYNC), ctypes.c_char_p(program)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def forbid_new_tasks() -> str:
    """Bar this process, for good, from starting a process or a thread (see the module
    text). Returns how: "seccomp", "rlimit" (a process barred, off Linux), or "" when
    nothing could be barred (an unknown machine, a kernel without seccomp, root off Linux)."""
    abi = ABIS.get(platform.machine())
    if sys.platform.startswith("linux") and abi is not None:
        try:
            _seccomp(abi)
            return "seccomp"
        except OSError:
            pass                     # a kernel built without seccomp: try the limit
    try:
        import resource
    except ImportError:
        return ""
    if os.geteuid() == 0:            # the limit does not hold for root
        return ""
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    return "rlimit"
