"""How setup.py builds the C extension: the compiler flags it chooses, the kernel variants it
compiles, and the record that makes a changed choice rebuild (the build-time half of
setup.py; nothing here is installed).

Flags (choose_flags): C11, -O3, and -ffp-contract=off on every compiler, so that no compiler
fuses a multiply and an add on its own (GCC's ISO C mode does not, clang does by default):
the kernels' bits are then the same from gcc and clang, and fused multiply-adds happen only
where the source asks for them (simd.h's madd, plain.c's fmaf, in a variant built with FMA).
-fvisibility=hidden: the module shows only PyInit to the dynamic linker, so that calls
between the core's files (a kernel's name in dispatch.c, attention's softmax step in ops.c)
are direct calls, not jumps through the PLT that another library's function of the same
name could take over (no speed change measured on a quiet machine).
OpenMP where the compiler has it; on macOS, where Apple's clang has none of its own, through
Homebrew's libomp when it is installed, else single-threaded with a one-line notice.

Kernel variants (choose_variants, VARIANTS, ARM_VARIANTS): on x86-64 the kernel files
(setup.py's KERNEL_SOURCES) are compiled three times, for the compiler's default target (the
baseline: any x86-64 CPU), for AVX2 with FMA and for AVX-512 with VNNI; on aarch64 (Linux,
Apple Silicon) twice, for the baseline (NEON, which every aarch64 CPU has) and for ARMv8.2-A's
int8 dot products (sdot); csrc/dispatch.c runs the best one the CPU has: one build, or one
wheel, that is fast on new CPUs and runs on old ones. The rest of the extension is compiled
once, for the baseline. A build of one variant instead: KVLAB_NATIVE=1 (everything
-march=native: this machine's CPU and no other, as the default was before), KVLAB_PORTABLE=1
(the baseline alone: the same bits on every CPU of its kind, no fused multiply-adds,
slower), a compiler that cannot compile a variant (it is left out), or another CPU (or a
macOS universal2 build: one compiler call for two CPUs).

The record (BuildRecords): setuptools rebuilds an extension only when a source is newer
than it, so a build with another compiler, other flags or other KVLAB_* options used to
reuse the build/ folder's old .so and ship it (issue 38). Each built extension now has a
record beside the object files of what built it (the compiler's command and version, the
flags and variants, the build's environment variables); when the record of the build about
to run differs, everything is rebuilt. The same words go into the extension as KV_BUILD,
which kvlab._kvlab.BUILD reports.

On Windows the compiler is mingw-w64's gcc, since MSVC cannot compile the core; that path
is untried on Windows itself (the core's C tests pass as mingw-w64 binaries under wine64).

Not here: CUDA's flags (setup.py).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from setuptools.command.build_ext import build_ext

# The environment variables a build reads: the compiler's own (setuptools reads them) and
# kvlab's build options (setup.py and this file; tests/test_build.py checks that every
# KVLAB_ name they spell is here). kvlab's run-time variables (the thread count, the kernel
# tier, the download cache ...) change no build, so they neither enter the record nor force
# a rebuild.
BUILD_VARIABLES = ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "ARCHFLAGS",
                   "CUDA_HOME", "CUDA_PATH", "KVLAB_NATIVE", "KVLAB_PORTABLE", "KVLAB_NO_OPENMP",
                   "KVLAB_SANITIZE", "KVLAB_CUDA", "KVLAB_NO_CUDA", "KVLAB_CUDA_ARCH",
                   "KVLAB_CUDA_GENCODE")

# Where Homebrew puts libomp when `brew --prefix libomp` cannot be asked: Apple Silicon's
# prefix, then Intel's.
HOMEBREW_LIBOMP = ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp")


def is_set(env, name):
    """An option is on when set to anything but empty or 0 (KVLAB_PORTABLE=0 is off)."""
    return env.get(name, "") not in ("", "0")


@dataclass(frozen=True)
class Variant:
    """One set of the kernel files' objects: its name (the suffix variant_names.h gives its
    functions, kvlab._kvlab.VARIANT's value) and the instruction sets it may use."""
    name: str
    flags: tuple = ()
    tuning: tuple = ()   # -mtune: left out where the compiler does not take it
    probe: str = ""      # the C program it needs built (variant_program: x86-64's by default)

    def features(self):
        """The CPU features its flags name ("-mavx2" -> "avx2"), which dispatch.c checks."""
        return [flag[2:] for flag in self.flags if flag.startswith("-m")]


# The x86-64 variants, the one every CPU runs last. dispatch.c checks each feature before it
# runs a variant (tests/test_build.py keeps the two lists equal). AVX2 comes with FMA, F16C
# and BMI2 on every CPU that has it (Haswell, 2013; AMD's Excavator, 2015); AVX-512 without
# VNNI (Skylake's servers, 2017) gains the kernels nothing, since their 512-bit paths are
# VNNI's int8 dot products. The avx512 variant is tuned for Intel's AVX-512 cores (Ice Lake
# and later; AMD's Zen 4, the other CPUs it runs on, untried): with GCC's generic tuning it
# moved vector lanes through general registers, and the bundled model's prefill ran at
# 0.90x a -march=native build's on a Sapphire Rapids (1.0x tuned; CPU time, 1 thread,
# benchmarks/ab.py). Tuning the avx2 variant changed nothing measurable (within 3 %).
AVX2 = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2")
VARIANTS = (
    Variant("avx512", AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq",
                              "-mavx512vl", "-mavx512vnni"), ("-mtune=icelake-server",)),
    Variant("avx2", AVX2),
    Variant("baseline"),
)

# The aarch64 variants, the one every CPU runs last. Every aarch64 CPU has NEON, the
# baseline's; the dot-product instructions (ARMv8.2-A's optional FEAT_DotProd, in every
# ARMv8.4-A CPU: Cortex-A55/A75 and later, every Apple Silicon Mac, AWS Graviton 2 and later,
# not the Raspberry Pi 4's Cortex-A72) add four byte products a lane in one instruction,
# which the int8 products use (csrc/int8_sums.h). dispatch.c asks the operating system for
# them (tests/test_build.py checks it asks). Both variants round every multiply-add twice,
# as x86-64's baseline does, so both give its bits (tests/test_bits.py's unfused digest).
NEON_PROGRAM = ("#include <arm_neon.h>\nint main(void) {\n"
                "    int8x16_t x = vdupq_n_s8(1);\n"
                "    int32x4_t s = vpaddq_s32(vpaddlq_s16(vmull_high_s8(x, x)), vdupq_n_s32(0));\n"
                "    return vgetq_lane_s32(s, 0) != 2;\n}\n")
DOTPROD_PROGRAM = ("#include <arm_neon.h>\n#if defined(__linux__)\n#include <sys/auxv.h>\n"
                   "#elif defined(__APPLE__)\n#include <sys/sysctl.h>\n#endif\n"
                   "int main(void) {\n    int8x16_t x = vdupq_n_s8(1);\n"
                   "    return vgetq_lane_s32(vdotq_s32(vdupq_n_s32(0), x, x), 0) != 4;\n}\n")
ARM_VARIANTS = (
    Variant("dotprod", ("-march=armv8.2-a+dotprod",), probe=DOTPROD_PROGRAM),
    Variant("baseline", probe=NEON_PROGRAM),
)

# The header that renames a variant's functions, forced into each of its compilations.
VARIANT_NAMES = "csrc/variant_names.h"

TRIVIAL_PROGRAM = "int main(void) { return 0; }\n"
X86_64_PROGRAM = ("#if !defined(__x86_64__)\n#error not x86-64\n#endif\n" + TRIVIAL_PROGRAM)
AARCH64_PROGRAM = ("#if !defined(__aarch64__)\n#error not aarch64\n#endif\n" + TRIVIAL_PROGRAM)
# Which variants a compiler for each CPU builds: the program it compiles, and the variants
ARCHITECTURES = ((X86_64_PROGRAM, VARIANTS), (AARCH64_PROGRAM, ARM_VARIANTS))


def variant_program(variant):
    """A program that compiles with the variant's flags where the compiler has its
    intrinsics and can ask the CPU for each feature the way dispatch.c does."""
    if variant.probe:
        return variant.probe
    asks = " + ".join(f'__builtin_cpu_supports("{f}")' for f in variant.features() if f != "f16c")
    return ("#include <immintrin.h>\n#include <cpuid.h>\n"
            f"int main(void) {{ __builtin_cpu_init(); return {asks or '0'}; }}\n")


@dataclass
class Flags:
    compile: list
    link: list
    notices: list = field(default_factory=list)
    variants: list = field(default_factory=list)   # several Variants, or none: one build


def compiler_accepts(command, flags, program=TRIVIAL_PROGRAM):
    """Does this compiler command (a list) build and link the program (C source) with these
    flags?"""
    if not command or shutil.which(command[0]) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "probe.c")
        source.write_text(program)
        result = subprocess.run([*command, str(source), *flags, "-o", str(Path(tmp, "probe"))],
                                capture_output=True)
        return result.returncode == 0


def find_libomp():
    """Homebrew's libomp prefix (one with include/omp.h), or None."""
    candidates = []
    brew = shutil.which("brew")
    if brew:
        try:
            result = subprocess.run([brew, "--prefix", "libomp"], capture_output=True,
                                    text=True, timeout=60)
            if result.returncode == 0 and result.stdout.strip():
                candidates.append(result.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += HOMEBREW_LIBOMP
    return next((c for c in candidates if Path(c, "include", "omp.h").is_file()), None)


def openmp_flags(accepts, env, platform, libomp):
    """(compile flags, link flags, notice or None) for OpenMP. `libomp` is called for
    Homebrew's prefix only when it is needed."""
    if is_set(env, "KVLAB_NO_OPENMP"):
        return [], [], None
    if accepts(["-fopenmp"]):
        return ["-fopenmp"], ["-fopenmp"], None
    if platform == "darwin":
        # Apple's clang has OpenMP's front end but no runtime and refuses plain -fopenmp:
        # the pragmas go through its preprocessor, and Homebrew's libomp is the runtime.
        prefix = libomp()
        if prefix is not None:
            compile_flags = ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"]
            link_flags = [f"-L{prefix}/lib", "-lomp"]
            if accepts(compile_flags + link_flags):
                return compile_flags, link_flags, None
        return [], [], ("kvlab: no OpenMP (Apple's clang needs Homebrew's libomp: "
                        "brew install libomp, then reinstall kvlab): building single-threaded")
    return [], [], "kvlab: the C compiler has no OpenMP: building single-threaded"


def choose_variants(compiles, env=None):
    """The kernel variants to compile (VARIANTS, best first; see the module's text), or []
    for a build of one variant. compiles(program, flags) says whether the compiler builds
    that C program with those flags; env defaults to this process's."""
    env = os.environ if env is None else env
    if is_set(env, "KVLAB_NATIVE") or is_set(env, "KVLAB_PORTABLE"):
        return []
    variants = next((v for program, v in ARCHITECTURES if compiles(program, [])), None)
    if variants is None:
        return []
    chosen = [v for v in variants if compiles(variant_program(v), list(v.flags))]
    chosen = [v if compiles(variant_program(v), [*v.flags, *v.tuning]) else replace(v, tuning=())
              for v in chosen]
    return chosen if len(chosen) > 1 and chosen[-1].name == variants[-1].name else []


def choose_flags(accepts, env=None, platform=None, libomp=find_libomp, compiles=None):
    """The C flags for kvlab._kvlab. accepts(flags) says whether the compiler takes them,
    compiles(program, flags) whether it builds that program (choose_variants; None: no
    variants); env and platform default to this process's (the tests pass others)."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    if is_set(env, "KVLAB_NATIVE") and is_set(env, "KVLAB_PORTABLE"):
        raise SystemExit("kvlab: KVLAB_NATIVE=1 (this CPU only) and KVLAB_PORTABLE=1 (any CPU, "
                         "baseline kernels only) ask for opposite builds: set one of them")
    # -ffp-contract=off is not probed: every compiler that has GCC's vector extensions
    # (which the core needs) takes it, and one that did not must fail loudly rather than
    # build other bits.
    compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-psabi",
                    "-fno-math-errno", "-ffp-contract=off"]
    link_args = []
    notices = []
    if accepts(["-fvisibility=hidden"]):
        compile_args.append("-fvisibility=hidden")
    if is_set(env, "KVLAB_NATIVE"):
        if not accepts(["-march=native"]):
            raise SystemExit("kvlab: KVLAB_NATIVE=1, but this compiler does not take -march=native")
        compile_args.append("-march=native")
    omp_compile, omp_link, notice = openmp_flags(accepts, env, platform, libomp)
    compile_args += omp_compile
    link_args += omp_link
    if notice:
        notices.append(notice)
    if is_set(env, "KVLAB_SANITIZE"):
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
        compile_args += sanitize + ["-O1"]
        link_args += sanitize
    variants = choose_variants(compiles, env) if compiles is not None else []
    return Flags(compile_args, link_args, notices, variants)


def compiler_version(command):
    """The first line of `compiler --version`, or "unknown"."""
    try:
        result = subprocess.run([command[0], "--version"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"
    lines = result.stdout.strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else "unknown"


def build_record(compiler, linker, flags, env=None, extra=None):
    """Everything that decides what a build makes, as a JSON-able dict: the compiler and
    linker commands (as setuptools composed them from Python's sysconfig and CC, CFLAGS,
    ...), the compiler's version, kvlab's flags, the environment variables the build reads,
    and whatever else the caller names (extra: the CUDA compiler, say)."""
    env = os.environ if env is None else env
    return {
        "compiler": list(compiler),
        "linker": list(linker),
        "version": compiler_version(compiler),
        "compile_args": list(flags.compile),
        "link_args": list(flags.link),
        "variants": [[v.name, [*v.flags, *v.tuning]] for v in flags.variants],
        "environment": {name: env[name] for name in sorted(env) if name in BUILD_VARIABLES},
        "extra": extra or {},
    }


def describe(record):
    """The record in one line for kvlab._kvlab.BUILD: compiler version, flags, options.
    Quotes and backslashes are left out, since it becomes a C string literal."""
    options = " ".join(f"{k}={v}" for k, v in record["environment"].items())
    text = f"{record['version']}; {' '.join(record['compile_args'])}"
    variants = [f"{name} ({' '.join(flags) or 'the default target'})"
                for name, flags in record.get("variants", [])]
    text += f"; kernel variants {', '.join(variants)}" if variants else "; one kernel variant"
    if options:
        text += f"; {options}"
    return "".join(ch for ch in text if ch.isprintable() and ch not in '"\\')


class BuildRecords:
    """The records of what built each extension, kept in build_temp (one file per output
    path, since build/lib's copy and an editable install's are different files)."""

    def __init__(self, build_temp):
        self.folder = Path(build_temp, "kvlab-build-records")

    def path(self, target):
        key = hashlib.sha256(os.path.abspath(target).encode()).hexdigest()[:16]
        return self.folder / f"{key}.json"

    def matches(self, target, record):
        """Was `target` built, and built as `record` says?"""
        try:
            stored = json.loads(self.path(target).read_text())
        except (OSError, ValueError):
            return False
        return Path(target).exists() and stored.get("record") == record

    def write(self, target, record):
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path(target).write_text(json.dumps(
            {"target": os.path.abspath(target), "record": record}, indent=1))


class BuildExt(build_ext):
    """build_ext with kvlab's flags on every extension, rebuilding everything when the
    record of this build differs from any extension's last. Subclasses may override
    prepare(ext) (called for each extension before compiling), record_extra() and
    kernel_sources(ext) (the sources of ext that are compiled once per kernel variant)."""

    def finalize_options(self):
        # MSVC cannot compile the core (GCC's vector extensions, issue 38): on Windows,
        # mingw-w64's gcc (setuptools' "mingw32" compiler) unless another is asked for.
        if sys.platform == "win32" and self.compiler is None:
            self.compiler = "mingw32"
        super().finalize_options()

    def prepare(self, ext):
        pass

    def record_extra(self):
        return {}

    def kernel_sources(self, ext):
        return []

    def build_extensions(self):
        if not hasattr(self.compiler, "compiler_so"):
            raise SystemExit(f"kvlab: the {self.compiler.compiler_type} compiler cannot build "
                             "kvlab's C core (it needs GCC's vector extensions): use gcc or "
                             "clang (mingw-w64 on Windows), or WSL2")
        compiler = list(self.compiler.compiler_so)
        flags = choose_flags(lambda extra: compiler_accepts(compiler, extra),
                             compiles=lambda program, extra: compiler_accepts(compiler, extra,
                                                                              program))
        for notice in flags.notices:
            print(notice, file=sys.stderr)
        record = build_record(compiler, getattr(self.compiler, "linker_so", []), flags,
                              extra=self.record_extra())
        records = BuildRecords(self.build_temp)
        targets = [self.get_ext_fullpath(ext.name) for ext in self.extensions]
        if not all(records.matches(t, record) for t in targets):
            # unchanged sources no longer mean an unchanged extension: compile everything
            self.force = True
        self.variants = flags.variants
        for ext in self.extensions:
            ext.extra_compile_args = list(flags.compile)
            ext.extra_link_args = list(flags.link)
            ext.define_macros = [m for m in ext.define_macros if m[0] != "KV_BUILD"]
            ext.define_macros.append(("KV_BUILD", '"' + describe(record) + '"'))
            self.plan_variants(ext)
            self.prepare(ext)
        super().build_extensions()
        for target in targets:
            records.write(target, record)

    def plan_variants(self, ext):
        """Takes ext's kernel sources out of its sources when they are compiled per variant
        (build_extension compiles them) and tells dispatch.c which variants there are; in a
        build of one variant, names it for variant.c (native: KVLAB_NATIVE=1)."""
        kernels = self.kernel_sources(ext)
        if not kernels:
            return
        ext.define_macros = [m for m in ext.define_macros
                             if not m[0].startswith(("KV_WITH_", "KV_SINGLE_VARIANT"))]
        if not self.variants:
            if is_set(os.environ, "KVLAB_NATIVE"):
                ext.define_macros.append(("KV_SINGLE_VARIANT", "native"))
            return
        ext.sources = [s for s in ext.sources if s not in kernels]
        ext.depends = [*ext.depends, *kernels, VARIANT_NAMES]
        ext.define_macros += [(f"KV_WITH_{v.name.upper()}", None) for v in self.variants[:-1]]

    def build_extension(self, ext):
        kernels = self.kernel_sources(ext)
        if kernels and self.variants and self.out_of_date(ext):
            ext.extra_objects = [*(ext.extra_objects or []), *self.compile_variants(ext, kernels)]
        super().build_extension(ext)

    def out_of_date(self, ext):
        """Whether setuptools will build ext (it skips one newer than all its files)."""
        target = Path(self.get_ext_fullpath(ext.name))
        if self.force or not target.exists():
            return True
        built = target.stat().st_mtime
        return any(Path(f).stat().st_mtime > built for f in [*ext.sources, *ext.depends])

    def compile_variants(self, ext, kernels):
        """Compiles the kernel sources once per variant (each in its own folder of
        build_temp, with its flags, -DKV_VARIANT=name and the renaming header forced in),
        several compilations at a time, and returns the object files."""
        def compile_one(job):
            variant, source = job
            return self.compiler.compile(
                [source], output_dir=os.path.join(self.build_temp, "variants", variant.name),
                macros=[*ext.define_macros, ("KV_VARIANT", variant.name)],
                include_dirs=ext.include_dirs, depends=ext.depends,
                extra_postargs=[*ext.extra_compile_args, *variant.flags, *variant.tuning,
                                "-include", VARIANT_NAMES])
        jobs = [(v, source) for v in self.variants for source in kernels]
        with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            return [obj for objects in pool.map(compile_one, jobs) for obj in objects]
