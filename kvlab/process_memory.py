"""How much physical memory a process holds: from Linux's /proc, elsewhere (macOS, Windows)
from psutil.

kvlab.measure re-exports these for notebooks and labs (and the grading judge serves them to
the cache-size lab's submissions: kvlab/grading/handouts.py). This file imports only the
standard library at import time (ctypes and psutil only when called).

On Linux the figures are /proc's own (VmRSS, VmHWM), exactly as before; psutil's resident
size there is the same count of pages, and it is what every other system reports through.
"""
import sys

# Read once, at import: a process's platform does not change (a test that simulates another
# one sets sys.platform before this file is loaded).
PROC = sys.platform.startswith("linux")


def status_kib(field: str, pid: str = "self") -> int:
    """A memory figure of a process from /proc/PID/status (VmRSS, VmHWM, ...), in KiB; 0
    where there is no /proc (macOS, Windows)."""
    if not PROC:
        return 0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _psutil_memory():
    """psutil's memory figures of this process, or None where psutil is missing or refuses."""
    try:
        import psutil
        return psutil.Process().memory_info()
    except Exception:       # ImportError, psutil.Error: no figure rather than a crash
        return None


def release_freed_memory() -> None:
    """Ask the C allocator to hand freed memory back to the operating system (glibc's
    malloc_trim; macOS's malloc_zone_pressure_relief). Without this, scratch freed after a
    forward pass stays resident for reuse and shows up in resident-size measurements as if
    something still held it. Where neither exists (Windows, musl) it does nothing."""
    try:
        import ctypes
        here = ctypes.CDLL(None)        # the C library this process already has loaded
    except (OSError, TypeError):        # Windows: no dlopen(NULL)
        return
    for name in ("malloc_trim", "malloc_zone_pressure_relief"):
        try:
            release = getattr(here, name)
        except AttributeError:          # not this C library's
            continue
        if name == "malloc_trim":
            release(0)
        else:
            release(None, ctypes.c_size_t(0))
        return


def resident_bytes() -> int:
    """Physical memory this process uses now: VmRSS on Linux, psutil's rss elsewhere."""
    kib = status_kib("VmRSS")
    if kib:
        return 1024 * kib
    info = _psutil_memory()
    return int(info.rss) if info is not None else 0


def peak_resident_bytes() -> int:
    """Highest physical memory this process has used: VmHWM on Linux, the peak working set
    on Windows, ru_maxrss (bytes there) on macOS; 0 where none of them can be read."""
    kib = status_kib("VmHWM")
    if kib:
        return 1024 * kib
    if sys.platform == "darwin":
        try:
            import resource
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        except (ImportError, OSError, ValueError):
            return 0
    info = _psutil_memory()
    return int(getattr(info, "peak_wset", 0) or 0)
