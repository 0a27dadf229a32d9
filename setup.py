"""Build script for kvlab's C extension (metadata lives in pyproject.toml).

One extension, kvlab._kvlab, is built from the C core (csrc/*.c, no Python) and its Python
binding (csrc/python/*.c) with -O3, -ffp-contract=off and OpenMP when the compiler has it
(on macOS through Homebrew's libomp): kvlab_build.py chooses the flags, and records what
built each extension so that a build with another compiler, flag or option rebuilds it
instead of shipping the old one. On x86-64 the kernel files (KERNEL_SOURCES) are compiled
once per instruction set, for any x86-64 CPU, AVX2 with FMA, and AVX-512 with VNNI (on
aarch64: any ARMv8-A CPU, and ARMv8.2's dot products), and the core runs the best one the
CPU has (csrc/dispatch.c): the default build is both portable (a wheel runs on any CPU of
its kind) and as fast as one tuned for the machine.
Environment switches:
  KVLAB_NATIVE=1     compile everything for this machine's CPU alone (-march=native), one
                     variant of the kernels: what the default was before, for a CPU
                     feature the variants leave out; the build dies with SIGILL elsewhere
  KVLAB_PORTABLE=1   compile the baseline kernels alone: the same bits on every CPU of its
                     kind (no fused multiply-adds), and slower
  KVLAB_NO_OPENMP=1  build single-threaded
  KVLAB_SANITIZE=1   build with AddressSanitizer and UBSan (for the sanitizer CI lane;
                     the C core only, no CUDA extension)

A second extension, kvlab._cuda (csrc/cuda/: the GPU backend), is built where it can be
used: nvcc is found ($CUDA_HOME/bin/nvcc, else nvcc on the PATH) and the driver reports a
GPU (nvidia-smi), or KVLAB_CUDA=1 asks for it (CI does, so that every kernel compiles in
every run). A CPU-only machine with nvcc is spared the minutes nvcc takes. Each .cu file is
compiled by nvcc; the binding csrc/cuda/_cuda.c, with the CPU binding's array and format
helpers it shares (SHARED_BINDING_SOURCES), by the C compiler; and the whole linked against
the static CUDA runtime (no other CUDA library), so that importing it needs no GPU and no
driver. A .cu file that does not compile fails the build.

Machine code for the GPU that is present (its compute capability, asked of the driver; for
a GPU newer than this nvcc, the newest architecture nvcc knows, whose PTX runs on it), or
where none is, for the GPUs students have: sm_75 (T4), sm_80 (A100), sm_86 (RTX 30xx, A10),
sm_89 (RTX 40xx, L4) and sm_90 (H100, H200), plus sm_70 (V100) where this nvcc still
compiles for it (CUDA 12; CUDA 13 dropped it); and PTX of the newest, which the driver
compiles for any later GPU at first use.
  KVLAB_NO_CUDA=1       build the CPU extension only
  KVLAB_CUDA=1          build the CUDA extension even where no GPU is seen (needs nvcc)
  KVLAB_CUDA_ARCH       the architectures instead: "75", "sm_86", "80,90", or "all" (the
                        list above); one nvcc cannot compile is an error
  KVLAB_CUDA_GENCODE    raw nvcc -gencode flags instead of all of the above, space-separated
"""
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
from setuptools import Extension, setup

# kvlab_build.py beside this file: the C flags and the build records (setuptools' PEP 517
# backend does not put this folder on sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvlab_build  # noqa: E402

HERE = Path(__file__).parent
CORE_SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.c"))
# The kernel files: compiled once per kernel variant (kvlab_build.VARIANTS) where there are
# several, with their functions renamed by csrc/variant_names.h; csrc/dispatch.c, compiled
# once, chooses among them. The plain tier (plain.c) is among them: each variant's plain
# kernels are the specification of its fast ones, bit for bit.
KERNEL_SOURCES = [str(Path("csrc", f"{name}.c")) for name in
                  ("ops", "attention", "weight_formats", "plain", "bandwidth", "variant")]
BINDING_DIR = HERE / "csrc" / "python"
BINDING_SOURCES = sorted(str(p.relative_to(HERE)) for p in BINDING_DIR.glob("*.c"))
CUDA_DIR = HERE / "csrc" / "cuda"
# What the GPU binding shares with the CPU one: every array argument checked (arrays.c) and
# the cache formats by name (formats.c), compiled into both extensions.
SHARED_BINDING_SOURCES = ["csrc/python/arrays.c", "csrc/python/formats.c"]
CUDA_SOURCES = sorted(CUDA_DIR.glob("*.cu"))
CUDA_HEADERS = [*CUDA_DIR.glob("*.cuh"), *CUDA_DIR.glob("*.h"), HERE / "csrc" / "kvlab.h",
                HERE / "csrc" / "model_args.h", BINDING_DIR / "binding.h"]
# The Python packages, and what each installs beside its code. Every folder that holds files
# to install is a package of its own (a folder without __init__.py is one to Python, and
# setuptools installs only the files of packages it is told of): each lab's folder, found
# here so that a new lab is installed whole, the bundled models (kvlab/assets), and the
# chapters with their figures and the scripts that made them, installed as kvlab.chapters
# from the repository's chapters/ so that a student's copy of a lab's instructions (kvlab
# lab start) links to a chapter it can open. A package's .py files are installed as it is;
# PACKAGE_DATA names the rest. tests/test_packaging.py checks that a build installs every
# file of these folders, with no warning from setuptools.
LAB_DIRS = sorted(p for p in (HERE / "kvlab" / "labs").iterdir()
                  if p.is_dir() and p.name.isidentifier() and not p.name.startswith("_"))
LAB_PACKAGES = [f"kvlab.labs.{p.name}" for p in LAB_DIRS]
# a lab's files besides Python: its README, and a C or CUDA lab's starter and headers
LAB_FILES = ["*.md", "*.c", "*.h", "*.cu", "*.cuh", "*.json", "*.txt"]
PACKAGES = ["kvlab", "kvlab.loaders", "kvlab.grading", "kvlab.questions", "kvlab.assets",
            "kvlab.labs", *LAB_PACKAGES, "kvlab.chapters", "kvlab.chapters.figures"]
PACKAGE_DIR = {"kvlab.chapters": "chapters"}
PACKAGE_DATA = {"kvlab.assets": ["*.bin", "*.json"],
                "kvlab.chapters": ["*.md"],
                "kvlab.chapters.figures": ["*.png", "*.json"],
                **{package: LAB_FILES for package in LAB_PACKAGES}}
# The compute capabilities of the GPUs students have, oldest first: V100, T4, A100,
# RTX 30xx/A10, RTX 40xx/L4, H100/H200.
STUDENT_ARCHS = ("70", "75", "80", "86", "89", "90")


def find_nvcc():
    """nvcc's path, or None: $CUDA_HOME/bin/nvcc, else the PATH's; never with KVLAB_NO_CUDA
    or KVLAB_SANITIZE."""
    if os.environ.get("KVLAB_NO_CUDA") or os.environ.get("KVLAB_SANITIZE"):
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


def cuda_library_dirs(nvcc):
    """Where this nvcc's CUDA runtime libraries are: asked of nvcc itself (its dry run names
    them), since nvcc may be a wrapper script far from its toolkit."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.cu")
        probe.write_text("")
        result = subprocess.run([nvcc, "--dryrun", "-c", str(probe), "-o", str(Path(tmp, "p.o"))],
                                capture_output=True, text=True)
    dirs, fallback = [], []
    for line in (result.stdout + result.stderr).splitlines():
        if "LIBRARIES=" in line:
            for word in shlex.split(line.split("LIBRARIES=", 1)[1]):
                if word.startswith("-L") and not word.rstrip("/").endswith("stubs"):
                    dirs.append(word[2:])
        elif "TOP=" in line:
            top = line.split("TOP=", 1)[1].strip()
            fallback += [str(Path(top, "lib64")), str(Path(top, "lib"))]
    return [d for d in dirs or fallback if Path(d).is_dir()]


@functools.lru_cache(maxsize=None)
def present_gpu_archs():
    """The compute capabilities of this machine's GPUs ("75", "90", ...), as the driver's
    nvidia-smi reports them; none without a driver or a GPU. (Asked once.)"""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        result = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ()
    if result.returncode != 0:
        return ()
    archs = {line.strip().replace(".", "") for line in result.stdout.splitlines()}
    return tuple(sorted((a for a in archs if a.isdigit()), key=int))


def nvcc_archs(nvcc):
    """The real architectures this nvcc compiles for ("75", "80", ...)."""
    result = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True)
    return {word.split("_", 1)[1] for word in result.stdout.split()
            if word.startswith("compute_") and word.split("_", 1)[1].isdigit()}


def requested_archs(value):
    """KVLAB_CUDA_ARCH as a list of compute capabilities: "all", or "75", "sm_86", "80,90"."""
    if value.strip() == "all":
        return list(STUDENT_ARCHS)
    archs = []
    for word in value.replace(" ", ",").split(","):
        word = word.strip().lower()
        for prefix in ("sm_", "compute_"):
            word = word[len(prefix):] if word.startswith(prefix) else word
        if word:
            if not word.isdigit():
                raise SystemExit(f"kvlab: KVLAB_CUDA_ARCH={value!r}: {word!r} is not an "
                                 f"architecture such as 75, sm_86 or 90")
            archs.append(word)
    return archs


def cuda_gencode(nvcc):
    """nvcc's -gencode flags (see the module text) and the architectures they name."""
    if os.environ.get("KVLAB_CUDA_GENCODE"):
        flags = os.environ["KVLAB_CUDA_GENCODE"].split()
        return flags, [flag.split("code=")[-1] for flag in flags]
    supported = nvcc_archs(nvcc)
    if os.environ.get("KVLAB_CUDA_ARCH"):
        archs = requested_archs(os.environ["KVLAB_CUDA_ARCH"])
        missing = [a for a in archs if a not in supported]
        if missing and os.environ["KVLAB_CUDA_ARCH"].strip() != "all":
            raise SystemExit(f"kvlab: this nvcc cannot compile for {', '.join('sm_' + a for a in missing)} "
                             f"(it knows {', '.join('sm_' + a for a in sorted(supported, key=int))})")
    else:
        seen = present_gpu_archs()
        present = [a for a in seen if a in supported]
        newest = max(supported, key=int, default=None)
        if present:
            archs = present
        elif newest is not None and any(int(a) > int(newest) for a in seen):
            # a GPU newer than this nvcc runs the PTX of the newest architecture it knows
            archs = [newest]
        else:
            archs = list(STUDENT_ARCHS)
        dropped = [a for a in archs if a not in supported]
        if dropped:
            print(f"kvlab: this nvcc does not compile for {', '.join('sm_' + a for a in dropped)} "
                  f"(sm_70, the V100, needs CUDA 12's nvcc)", file=sys.stderr)
    archs = sorted({a for a in archs if a in supported}, key=int)
    if not archs:
        raise SystemExit("kvlab: no GPU architecture left that this nvcc compiles for; "
                         "set KVLAB_CUDA_ARCH or KVLAB_NO_CUDA=1")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")   # PTX
    return flags, [f"sm_{a}" for a in archs] + [f"compute_{archs[-1]}"]


def cuda_to_build(nvcc):
    """Whether to build kvlab._cuda, and why not when not."""
    if os.environ.get("KVLAB_NO_CUDA") or os.environ.get("KVLAB_SANITIZE"):
        return False, None
    asked = os.environ.get("KVLAB_CUDA", "") not in ("", "0")
    if nvcc is None:
        if asked:
            raise SystemExit("kvlab: KVLAB_CUDA=1 asks for the CUDA backend, but nvcc is not "
                             "found (set CUDA_HOME, or put nvcc on the PATH)")
        return False, "nvcc not found (CUDA_HOME or PATH)"
    if asked or present_gpu_archs():
        return True, None
    return False, ("no GPU seen by nvidia-smi (KVLAB_CUDA=1 builds the CUDA backend "
                   "anyway)")


NVCC = find_nvcc()
BUILD_CUDA, NO_CUDA_REASON = cuda_to_build(NVCC)


class BuildExt(kvlab_build.BuildExt):
    """kvlab_build's flags and build records (a changed compiler, flag or option rebuilds
    everything), and the CUDA backend's objects compiled before kvlab._cuda is linked."""

    def prepare(self, ext):
        if ext.name == "kvlab._cuda":
            self.compile_cuda(ext)

    def record_extra(self):
        return {"nvcc": NVCC, "gpus": list(present_gpu_archs()) if BUILD_CUDA else []}

    def kernel_sources(self, ext):
        return KERNEL_SOURCES if ext.name == "kvlab._kvlab" else []

    def compile_cuda(self, ext):
        """Compiles every .cu file with nvcc (in parallel; unchanged ones are kept) and hands
        the objects to the linker with the static CUDA runtime. A failure stops the build."""
        gencode, archs = cuda_gencode(NVCC)
        print(f"kvlab: compiling the CUDA backend for {' '.join(archs)}", flush=True)
        out_dir = Path(self.build_temp, "cuda")
        out_dir.mkdir(parents=True, exist_ok=True)
        newest_header = max(p.stat().st_mtime for p in CUDA_HEADERS)
        flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", f"-I{HERE / 'csrc'}", f"-I{CUDA_DIR}",
                 *gencode]

        def compile_one(source):
            obj = out_dir / (source.stem + ".o")
            if (obj.exists() and obj.stat().st_mtime > source.stat().st_mtime
                    and obj.stat().st_mtime > newest_header and not self.force):
                return obj, None
            command = [NVCC, *flags, "-c", str(source), "-o", str(obj)]
            print(" ".join(command), flush=True)
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                return obj, f"nvcc failed on {source.name}:\n{result.stdout}{result.stderr}"
            if result.stderr.strip():
                print(result.stderr, file=sys.stderr)
            return obj, None

        workers = max(1, min(len(CUDA_SOURCES), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(compile_one, CUDA_SOURCES))
        failures = [error for _, error in results if error]
        if failures:
            raise RuntimeError("\n".join(failures) + "\nThe CUDA backend did not compile "
                               "(set KVLAB_NO_CUDA=1 to build without it).")
        ext.extra_objects = [str(obj) for obj, _ in results]
        ext.library_dirs = cuda_library_dirs(NVCC)
        ext.libraries = ["cudart_static", "rt", "pthread", "dl", "stdc++"]
        ext.define_macros += [("KV_CUDA_SOURCES", '"' + " ".join(p.name for p in CUDA_SOURCES) + '"'),
                             ("KV_CUDA_ARCHS", '"' + " ".join(archs) + '"'),
                             # NumPy's API table of this extension, apart from kvlab._kvlab's
                             ("PY_ARRAY_UNIQUE_SYMBOL", "kvlab_cuda_PyArray_API")]
        # the binding is C11 without OpenMP; the sanitizer never gets here (see find_nvcc)
        ext.extra_compile_args = [a for a in ext.extra_compile_args if a != "-fopenmp"]
        ext.extra_link_args = [a for a in ext.extra_link_args if a != "-fopenmp"]


EXTENSIONS = [
    Extension(
        "kvlab._kvlab",
        sources=CORE_SOURCES + BINDING_SOURCES,
        include_dirs=["csrc", numpy.get_include()],
        depends=[str(p.relative_to(HERE))
                 for p in [*(HERE / "csrc").glob("*.h"), *BINDING_DIR.glob("*.h")]],
    )
]
if BUILD_CUDA:
    EXTENSIONS.append(Extension(
        "kvlab._cuda",
        sources=["csrc/cuda/_cuda.c", *SHARED_BINDING_SOURCES],
        include_dirs=["csrc", "csrc/cuda", "csrc/python", numpy.get_include()],
        depends=[str(p.relative_to(HERE)) for p in CUDA_SOURCES + CUDA_HEADERS],
    ))
elif NO_CUDA_REASON:
    print(f"kvlab: {NO_CUDA_REASON}: building without the CUDA backend", file=sys.stderr)

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data=PACKAGE_DATA,
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildExt},
)
