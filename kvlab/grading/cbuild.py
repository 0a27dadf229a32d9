"""A lab in C: how the judge has the student's file built, and what it reads in it first.

The kernel lab (kvlab/labs/decode_kernel) takes a C file. Building it runs no code of the
student's, but loading it does (a library's constructors run at load), so the judge does
neither: it stages the file with the lab's header and sends a worker (worker.py, as the
student's user, in a scratch folder of its own) the compiler command made here; the worker
runs it and the judge copies the library it wrote, as bytes, beside the staged file. Each
test's worker then loads that library (ctypes) behind the lab's harness.py, and the tests
call it as they call a Python lab's functions. A file that does not compile scores 0 with
the compiler's own words.

The flags are the ones that built kvlab's C core (kvlab._kvlab.BUILD, as kvlab_build.py
chose them: -O3, -ffp-contract=off, -march=native where kvlab was built with it, OpenMP),
so that the student's fused multiply-adds are exactly where the plain tier has them; the
header refuses to build if they are not (KVLAB_FMA).

One thing is added to them where the compiler needs it (int8_guard): GCC 12.2 at -O3 with
VNNI (the avx512 variant's -mavx512vnni, or -march=native on a CPU with it) vectorizes
some sums of int8 products with vpdpbusd, which reads one side as unsigned, and gets them
wrong: `total += (int8_t)w[i] * x[i]` with w a uint8_t pointer, or a Q4 code
`(w[i] & 15) - 8` times an int8. So before the first build the judge compiles and runs a
small program of such sums (INT8_PROBE) with the same compiler and flags; where it finds
one wrong, the student's file is built with VNNI's instructions turned off (VNNI_OFF),
and the build's log says so. Lab 14's own arithmetic is float (int8 codes times float
queries), and the reference solution's library is the same bytes either way.

check_c_source is a courtesy, as policy.py's check is for Python: it turns the easy ways
of reaching around the grader (other headers, loading libraries, starting processes,
inline assembly, code that runs at load) into a clear refusal with its line. C can reach
anything in its process, so it is no defence: what keeps the score honest is that the
judge computes every expected value and times every call from its own process, and that on
the autograder the student's user cannot read kvlab (README's kernel-lab section).

Its GPU edition (kvlab/labs/decode_kernel_cuda, language "cuda") takes a .cu file, built by
nvcc with the lab's harness.cu into one library (cuda_build_command): kvlab's own CUDA flags
(setup.py: -O3 -std=c++17 -Xcompiler -fPIC), machine code for the GPU present, and the
arithmetic pinned: --fmad=false (no contraction, as -ffp-contract=off), -ftz=false,
-prec-div=true, -prec-sqrt=true, and KVLAB_FMA saying whether kvlab's CPU kernels fuse, since
the expected bits are the CPU plain tier's. check_cuda_source is check_c_source with CUDA's
headers allowed and the runtime's ways of loading code refused. C++ can also run code at load
(a static object's constructor) without a name to refuse: as for C, the check is a courtesy.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from .policy import Violation

BUILD_SECONDS = 60.0      # the compiler's time limit (a test's: no file of a lab needs more)
LIBRARY_LIMIT = 64 << 20  # bytes of a built library the judge copies

# What the grader's build keeps of kvlab's own flags: the language, the optimization, the
# arithmetic (no contraction, no errno), the instruction set, OpenMP, and warnings. Not the
# sanitizers or debugging flags of a KVLAB_SANITIZE build.
KEPT_FLAG = re.compile(r"^(-std=\S+|-O[0-3s]|-ffp-contract=\S+|-fno-math-errno|-march=\S+|"
                       r"-mtune=\S+|-mcpu=\S+|-fopenmp|-W[\w=-]+)$")
DEFAULT_FLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno"]

# Headers a kernel file may include: C's own, the vector intrinsics, threads, and the lab's.
ALLOWED_HEADERS = frozenset({
    "assert.h", "complex.h", "errno.h", "fenv.h", "float.h", "inttypes.h", "iso646.h",
    "limits.h", "math.h", "stdalign.h", "stdarg.h", "stdbool.h", "stddef.h", "stdint.h",
    "stdio.h", "stdlib.h", "string.h", "tgmath.h", "time.h", "stdatomic.h",
    "immintrin.h", "x86intrin.h", "xmmintrin.h", "emmintrin.h", "pmmintrin.h",
    "tmmintrin.h", "smmintrin.h", "nmmintrin.h", "avxintrin.h", "avx2intrin.h",
    "arm_neon.h", "omp.h", "pthread.h", "threads.h",
})

# Names that load code, start or signal processes, reach the system directly, or run code
# when the library is loaded or unloaded.
DENIED_NAMES = frozenset({
    "dlopen", "dlmopen", "dlsym", "dlvsym", "dladdr", "dlinfo", "syscall", "fork", "vfork",
    "clone", "clone3", "execl", "execle", "execlp", "execv", "execve", "execvp", "execvpe",
    "fexecve", "posix_spawn", "posix_spawnp", "system", "popen", "ptrace", "kill", "tgkill",
    "raise", "signal", "sigaction", "setsid", "prctl", "mprotect", "mmap", "mremap",
    "process_vm_readv", "process_vm_writev", "asm", "__asm", "__asm__", "constructor",
    "destructor", "atexit", "at_quick_exit", "on_exit", "__attribute_constructor__",
    "execveat", "forkpty", "daemon", "wordexp", "pidfd_spawn", "pidfd_spawnp", "killpg",
    "sigqueue", "pidfd_send_signal", "unshare", "setns",
    # the dynamic linker reached by hand, without dlopen's name
    "dl_iterate_phdr", "_r_debug", "_DYNAMIC", "__libc_dlopen_mode", "__libc_dlsym",
})


# The GPU edition: CUDA's own headers besides C's, and the runtime calls that load code or
# reach another process's memory.
CUDA_ALLOWED_HEADERS = ALLOWED_HEADERS | frozenset({
    "cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "cooperative_groups.h",
    "cooperative_groups/reduce.h", "cuda_pipeline.h", "mma.h", "cstdint", "cstddef", "cmath",
    "cstdio", "cstdlib", "cstring", "cfloat", "climits",
})
CUDA_DENIED_NAMES = DENIED_NAMES | frozenset({
    "cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion", "cudaLibraryLoadData",
    "cudaLibraryLoadFromFile", "cudaIpcOpenMemHandle", "cudaIpcGetMemHandle",
    "cudaIpcOpenEventHandle", "cudaIpcGetEventHandle",
})
# nvcc's flags for the GPU edition: kvlab's own (setup.py), and the arithmetic pinned to the
# plain tier's roundings (the module text)
CUDA_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--fmad=false", "-ftz=false",
              "-prec-div=true", "-prec-sqrt=true"]
CUDA_BUILD_SECONDS = 120.0   # nvcc takes seconds where cc takes a fraction of one


def _plain_name(name: str) -> str:
    """A name as the C library's other spellings of it reduce to: `_Fork`, `__fork` and
    `__libc_fork` are fork, `__clone` is clone, `__libc_system` is system."""
    name = name.strip("_").lower()
    return name[len("libc_"):] if name.startswith("libc_") else name


# the refused functions' plain names, which a name written with leading underscores must
# not reduce to (a plain name is refused only as written: `dynamic` is no `_DYNAMIC`)
PLAIN_DENIED = frozenset(_plain_name(n) for n in DENIED_NAMES if not n.startswith("_"))

# Attributes (GNU __attribute__((...)) or C23 [[gnu::...]], with or without the underscores
# around them) that run code at load, put code where the loader runs it, or name another
# symbol in a string the name check cannot read (weakref("dlopen")).
DENIED_ATTRIBUTES = frozenset({"constructor", "destructor", "section", "ifunc", "weakref",
                               "alias", "symver"})

# The Python C API: the kernel runs inside the worker's Python, whose functions a file can
# declare and call (PyRun_SimpleString) without a header.
PYTHON_API = re.compile(r"^_?Py(?:_|[A-Z])")

# C's trigraphs, which -std=c11 turns into these characters before anything else (so
# `??/` at a line's end continues it, as a backslash does)
TRIGRAPHS = {"??=": "#", "??/": "\\", "??'": "^", "??(": "[", "??)": "]", "??!": "|",
             "??<": "{", "??>": "}", "??-": "~"}


def kit_flags(build: Optional[str] = None) -> List[str]:
    """The flags that built kvlab's C core (kvlab._kvlab.BUILD, "compiler version; flags;
    options"), less what does not decide a kernel's bits or speed; kvlab's defaults where
    BUILD cannot be read."""
    import kvlab._kvlab as core
    build = core.BUILD if build is None else build
    parts = build.split("; ")
    flags = [f for f in parts[1].split() if KEPT_FLAG.match(f)] if len(parts) > 1 else []
    if not any(f.startswith("-ffp-contract=") for f in flags):
        flags = DEFAULT_FLAGS + (["-march=native"] if core.FUSED_MULTIPLY_ADD else []) + \
                (["-fopenmp"] if core.HAS_OPENMP else [])
    flags += variant_flags(build, getattr(core, "VARIANT", ""))
    omp = re.search(r"-Xpreprocessor -fopenmp -I(\S+)/include", build)
    if omp:          # macOS: Apple's clang takes OpenMP through Homebrew's libomp
        flags += ["-Xpreprocessor", "-fopenmp", f"-I{omp.group(1)}/include",
                  f"-L{omp.group(1)}/lib", "-lomp"]
    return flags


def variant_flags(build: str, variant: str) -> List[str]:
    """The instruction-set flags of the kernel variant that runs: a dispatching build's BUILD
    lists each variant's ("kernel variants avx512 (-mavx2 ... -mavx512vnni), avx2 (...),
    baseline (the default target)"), and the student's kernel must be built for the one
    whose bits it is compared with (fused multiply-adds or not)."""
    found = re.search(r"(?:variants |, )" + re.escape(variant) + r" \(([^)]*)\)", build)
    return [f for f in found.group(1).split() if f.startswith("-m")] if found else []


def compiler() -> str:
    """The C compiler: $CC, else the one Python was built with, else cc, gcc or clang;
    its full path, since the worker's PATH may differ."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        name = (candidate or "").split()[0] if (candidate or "").split() else ""
        found = shutil.which(name) if name else None
        if found:
            return found
    raise FileNotFoundError("no C compiler found (cc, gcc or clang): the kernel lab needs one")


def build_command(source: Path, library: Path, include: Path) -> List[str]:
    """The command that builds `source` into the shared library `library`, with the lab's
    header from `include`, as kvlab's core was built (and int8_guard's flags where this
    compiler needs them)."""
    import kvlab._kvlab as core
    cc, flags = compiler(), kit_flags()
    guard, _ = int8_guard(cc, tuple(flags))
    return [cc, *flags, *guard, f"-DKVLAB_FMA={core.FUSED_MULTIPLY_ADD}", "-shared",
            "-fPIC", "-I", str(include), "-o", str(library), str(source), "-lm"]


def build_note() -> str:
    """What the student's build log says about int8_guard ("" where it changed nothing)."""
    return int8_guard(compiler(), tuple(kit_flags()))[1]


# ---- the compiler's int8 sums (the module's text) --------------------------------------

# The flags that turn VNNI's int8 dot-product instructions off: AVX-512's and the AVX
# (VEX) form that -march=native also brings on CPUs that have it. Both are needed: with
# -march=native, -mno-avx512vnni alone still leaves GCC 12.2 its vpdpbusd.
VNNI_OFF = ("-mno-avx512vnni", "-mno-avxvnni")
PROBE_SECONDS = 60.0      # to build the probe, and again to run it (it takes well under 1 s)
PROBE_WRONG = 3           # the probe's exit status when a sum is wrong

# Sums of int8 products as a kernel may write them, each checked against the same sum taken
# a product at a time through a volatile (which nothing vectorizes). The shapes: an int8
# read from a byte, a Q4 code less 8, a Q4 code, a byte; as four loops of their own and as
# one loop choosing at run time. GCC 12.2 -O3 -mavx512vnni gets the first two wrong.
INT8_PROBE = r"""
#include <stdint.h>
#include <stdio.h>

static inline int32_t code(int shape, const uint8_t *w, int i) {
    return shape == 0 ? (int8_t)w[i] : shape == 1 ? (w[i] & 15) - 8
         : shape == 2 ? w[i] & 15 : w[i];
}

__attribute__((noinline)) static int32_t any_shape(int shape, const uint8_t *w,
                                                   const int8_t *x, int n) {
    int32_t total = 0;
    for (int i = 0; i < n; i++) total += code(shape, w, i) * x[i];
    return total;
}

__attribute__((noinline)) static int32_t one_shape(int shape, const uint8_t *w,
                                                   const int8_t *x, int n) {
    int32_t total = 0;
    if (shape == 0) for (int i = 0; i < n; i++) total += (int8_t)w[i] * x[i];
    if (shape == 1) for (int i = 0; i < n; i++) total += ((w[i] & 15) - 8) * x[i];
    if (shape == 2) for (int i = 0; i < n; i++) total += (w[i] & 15) * x[i];
    if (shape == 3) for (int i = 0; i < n; i++) total += w[i] * x[i];
    return total;
}

int main(void) {
    static const int lengths[] = {32, 64, 37, 256};
    uint8_t w[256];
    int8_t x[256];
    uint32_t state = 12345;
    for (int round = 0; round < 32; round++) {
        for (int i = 0; i < 256; i++) {
            state = state * 1664525u + 1013904223u;
            w[i] = (uint8_t)(state >> 24);
            x[i] = (int8_t)(state >> 16);
        }
        int n = lengths[round % 4];
        for (int shape = 0; shape < 4; shape++) {
            int32_t want = 0;
            for (int i = 0; i < n; i++) {
                volatile int32_t product = code(shape, w, i) * x[i];
                want += product;
            }
            int32_t one = one_shape(shape, w, x, n), any = any_shape(shape, w, x, n);
            if (one != want || any != want) {
                printf("shape %d, %d values: %d and %d, not %d\n", shape, n, one, any, want);
                return PROBE_WRONG;
            }
        }
    }
    return 0;
}
"""


def int8_probe(cc: str, flags: Tuple[str, ...]) -> Optional[bool]:
    """Whether `cc` with `flags` gets INT8_PROBE's sums right: True, False, or None where
    the probe could not be built or run (the student's build then says why on its own)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-int8-probe-") as folder:
        source, program = Path(folder, "int8_probe.c"), Path(folder, "int8_probe")
        source.write_text(INT8_PROBE)
        try:
            built = subprocess.run([cc, *flags, f"-DPROBE_WRONG={PROBE_WRONG}", "-o",
                                    str(program), str(source)], capture_output=True,
                                   timeout=PROBE_SECONDS)
            if built.returncode != 0:
                return None
            ran = subprocess.run([str(program)], capture_output=True, timeout=PROBE_SECONDS)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return {0: True, PROBE_WRONG: False}.get(ran.returncode)


@functools.lru_cache(maxsize=None)
def int8_guard(cc: str, flags: Tuple[str, ...]) -> Tuple[Tuple[str, ...], str]:
    """(the flags a student's build adds, what its log says) for this compiler and flags:
    nothing where int8_probe finds the sums right (or cannot tell); VNNI_OFF where they
    are wrong and right without VNNI; where they are wrong even so, a warning. Probed once
    per compiler and flags in a process."""
    if int8_probe(cc, flags) is not False:
        return (), ""
    name = _compiler_name(cc)
    if int8_probe(cc, flags + VNNI_OFF):
        return VNNI_OFF, (f"note: this machine's C compiler ({name}) gets some sums of int8 "
                          f"products wrong when it may use VNNI's int8 instructions (GCC 12 "
                          f"uses vpdpbusd, which reads one side as unsigned, for two signed "
                          f"sides), so your file was built with "
                          f"{' '.join(VNNI_OFF)} added; nothing else about the build changed.")
    return (), (f"warning: this machine's C compiler ({name}) gets some sums of int8 products "
                f"wrong with the grader's flags, even without VNNI's instructions: a loop of "
                f"yours adding int8 products may be miscompiled. Tell your instructor.")


def _compiler_name(cc: str) -> str:
    """The compiler's first line of --version ("gcc (Debian 12.2.0-14) 12.2.0"), else its path."""
    try:
        said = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return said.stdout.splitlines()[0].strip() if said.stdout.strip() else cc
    except (OSError, subprocess.TimeoutExpired):
        return cc


def blank_comments_and_strings(source: str) -> str:
    """The source with comments, string and character literals blanked (their line breaks
    kept, so that lines still count the same), for the name check."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)

    def blank(match):
        text = match.group(0)
        keep = text[0] if text[0] in "\"'" else ""
        return keep + re.sub(r"[^\n]", " ", text[len(keep):-1] if keep else text) + \
            (text[-1] if keep else "")
    return pattern.sub(blank, source)


def _logical_lines(source: str) -> Tuple[List[int], List[str]]:
    """The source's lines as the preprocessor first joins them (a backslash at a line's end
    continues it: `#inc\\`, newline, `lude` is an include), with the number of the line
    each starts on."""
    numbers, lines, parts = [], [], []
    for number, line in enumerate(source.split("\n"), 1):
        if not parts:
            numbers.append(number)
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        lines.append("".join(parts + [line]))
        parts = []
    if parts:
        lines.append("".join(parts))
    return numbers, lines


def _attribute_spans(code: str) -> List[Tuple[int, str]]:
    """(offset, text) of every attribute list in `code` (comments and strings blanked):
    what follows __attribute__ or __attribute up to its balanced closing parenthesis, and
    what [[ ... ]] holds."""
    spans = []
    for found in re.finditer(r"\b__attribute(?:__)?\s*\(|\[\[", code):
        if found.group(0) == "[[":
            end = code.find("]]", found.end())
            spans.append((found.start(), code[found.end():end if end >= 0 else len(code)]))
            continue
        depth, at = 1, found.end()
        while at < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[at], 0)
            at += 1
        spans.append((found.start(), code[found.end():at]))
    return spans


def _name_violations(number: int, line: str, denied=DENIED_NAMES) -> List[Violation]:
    found = []
    names = set(re.findall(r"[A-Za-z_]\w*", line))
    for name in sorted(n for n in names if n in denied or
                       n.startswith("_") and _plain_name(n) in PLAIN_DENIED):
        found.append(Violation(number, f"`{name}` is not allowed in this lab (it loads code, "
                                       f"reaches the system or runs code at load)"))
    for name in sorted(n for n in names if PYTHON_API.match(n)):
        found.append(Violation(number, f"`{name}` is not allowed in this lab: it is Python's C "
                                       f"API, and a kernel has no business with the process "
                                       f"it is loaded in"))
    return found


def check_cuda_source(source: str, header: str) -> List[Violation]:
    """check_c_source for the GPU edition's .cu file: CUDA's headers allowed, the CUDA
    runtime's ways of loading code or reaching other processes refused."""
    return check_c_source(source, header, CUDA_ALLOWED_HEADERS, CUDA_DENIED_NAMES)


def check_c_source(source: str, header: str, allowed=ALLOWED_HEADERS,
                   denied=DENIED_NAMES) -> List[Violation]:
    """Every include, name, attribute and token paste of a C submission this lab refuses,
    with its line."""
    found = []
    for trigraph, character in TRIGRAPHS.items():
        source = source.replace(trigraph, character)
    numbers, raw_lines = _logical_lines(source)
    code = blank_comments_and_strings("\n".join(raw_lines)).split("\n")
    for number, line, written in zip(numbers, code, raw_lines):
        # "#", or its digraph %:
        directive = re.match(r"\s*(?:#|%:)\s*(include|include_next|import|embed)\b(.*)", line)
        if directive:
            target = re.search(r'[<"]([^>"]*)[>"]', written)
            name = target.group(1) if target else ""
            if directive.group(1) != "include" or not target:
                found.append(Violation(number, f"`{written.strip()}`: only #include of a "
                                               f"named header is allowed"))
            elif name != header and name not in allowed:
                found.append(Violation(number, f"`#include {target.group(0)}` is not allowed in "
                                               f"this lab: only C's own headers, the vector "
                                               f"intrinsics, omp.h, pthread.h and {header}"))
            continue
        if "##" in line or "%:%:" in line:
            found.append(Violation(number, "`##` (token pasting) is not allowed in this lab: it "
                                           "builds names the grader's check cannot read"))
        found += _name_violations(number, line, denied)
        # a pragma's string is code too: _Pragma("redefine_extname f dlopen")
        for pragma in re.findall(r'\b_Pragma\s*\(\s*"((?:\\.|[^"\\])*)"', written):
            found += _name_violations(number, pragma, denied)
    text = "\n".join(code)
    for offset, span in _attribute_spans(text):
        number = numbers[text.count("\n", 0, offset)]
        for name in sorted({n.strip("_") for n in re.findall(r"[A-Za-z_]\w*", span)} & DENIED_ATTRIBUTES):
            found.append(Violation(number, f"the attribute `{name}` is not allowed in this lab (it "
                                           f"runs code at load or names a symbol in a string)"))
    return sorted(set(found), key=lambda v: (v.line, v.why))


def refused_text(allowed=ALLOWED_HEADERS, denied=DENIED_NAMES) -> str:
    """What a C lab's instructions end with: what the grader refuses in the file."""
    headers = ", ".join(f"`{h}`" for h in sorted(allowed))
    names = ", ".join(f"`{n}`" for n in sorted(denied, key=lambda n: n.lstrip("_")))
    attributes = ", ".join(f"`{a}`" for a in sorted(DENIED_ATTRIBUTES))
    return ("## What the grader refuses\n\n"
            "A few things in C reach around the grader (they load libraries, start processes, "
            "reach the system directly or run code when the library is loaded), so a file that "
            "uses any of them is not graded at all. `kvlab check LAB your_file.c` names every "
            "one it finds.\n\n"
            f"- `#include` of any header but the lab's own and {headers};\n"
            f"- `##` (token pasting), names of Python's C API (`Py...`), and the attributes "
            f"{attributes};\n"
            f"- the names {names}.\n")


def cuda_refused_text() -> str:
    """refused_text for the GPU edition's .cu file."""
    return refused_text(CUDA_ALLOWED_HEADERS, CUDA_DENIED_NAMES)


def find_nvcc() -> Optional[str]:
    """nvcc's full path ($CUDA_HOME/bin/nvcc, $CUDA_PATH's, else the PATH's), or None: the
    same search as setup.py's."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


def gpu_arch_flags(capability: Tuple[int, int], nvcc_archs: List[str]) -> List[str]:
    """nvcc's -gencode for a GPU of this compute capability: its own machine code where this
    nvcc compiles for it ("90" in nvcc_archs), else the PTX of the newest architecture nvcc
    knows that the GPU can run (the driver compiles it at load)."""
    own = f"{capability[0]}{capability[1]}"
    if own in nvcc_archs:
        return [f"-gencode=arch=compute_{own},code=sm_{own}"]
    older = [a for a in nvcc_archs if (int(a[:-1]), int(a[-1])) <= tuple(capability)]
    if not older:
        raise RuntimeError(f"this nvcc compiles for none of the architectures a GPU of compute "
                           f"capability {capability[0]}.{capability[1]} runs")
    newest = max(older, key=int)
    return [f"-gencode=arch=compute_{newest},code=compute_{newest}"]


def nvcc_archs(nvcc: str) -> List[str]:
    """The real architectures this nvcc compiles for ("75", "80", ...)."""
    import subprocess
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return sorted({a for a in re.findall(r"compute_(\d+)\b", listed)}, key=int)


def present_gpu_flags() -> List[str]:
    """The -gencode flags for the GPU kvlab uses (kvlab.cuda), for the grader's build."""
    from .. import cuda
    capability = tuple(cuda.device_info()["capability"])
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("no nvcc found (CUDA_HOME, CUDA_PATH or the PATH)")
    return gpu_arch_flags(capability, nvcc_archs(nvcc))


def cuda_build_command(source: Path, library: Path, include: Path,
                       arch_flags: Optional[List[str]] = None, fma: Optional[int] = None,
                       link: bool = True) -> List[str]:
    """nvcc's command that builds `source` with include/harness.cu into the shared library
    `library` (link=False: into an object file, with -c, for checking that it compiles),
    against the header in `include`: CUDA_FLAGS, the -gencode flags (the GPU present's by
    default), and KVLAB_FMA (kvlab's CPU kernels' by default)."""
    import kvlab._kvlab as core
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("no nvcc found (CUDA_HOME, CUDA_PATH or the PATH): this lab "
                                "needs an NVIDIA GPU and nvcc")
    arch_flags = present_gpu_flags() if arch_flags is None else arch_flags
    fma = core.FUSED_MULTIPLY_ADD if fma is None else int(fma)
    sources = [str(include / "harness.cu"), str(source)] if link else [str(source)]
    return [nvcc, *CUDA_FLAGS, *arch_flags, f"-DKVLAB_FMA={fma}", "-I", str(include),
            *(["-shared"] if link else ["-c"]), "-o", str(library), *sources]
