"""Build script for kvlab's C extension (metadata lives in pyproject.toml).

One extension, kvlab._kvlab, is built from csrc/*.c with -O3 and OpenMP when the
compiler has it. Environment switches:
  KVLAB_PORTABLE=1   do not tune for this machine's CPU (-march=native is the default,
                     because kvlab is normally built from source where it runs)
  KVLAB_NO_OPENMP=1  build single-threaded
  KVLAB_SANITIZE=1   build with AddressSanitizer and UBSan (for the sanitizer CI lane)
A CUDA extension (kvlab._cuda) joins here when nvcc is found; until then there is none.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
CORE_SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.c"))


def compiler_accepts(flags):
    """Does the C compiler build a trivial program with these flags?"""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "probe.c")
        source.write_text("int main(void) { return 0; }\n")
        result = subprocess.run([compiler, *flags, str(source), "-o", str(Path(tmp, "probe"))],
                                capture_output=True)
        return result.returncode == 0


class BuildExt(build_ext):
    """Chooses optimization, OpenMP and sanitizer flags by probing the compiler."""

    def build_extensions(self):
        compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fno-math-errno"]
        link_args = []
        if not os.environ.get("KVLAB_PORTABLE") and compiler_accepts(["-march=native"]):
            compile_args.append("-march=native")
        if not os.environ.get("KVLAB_NO_OPENMP") and compiler_accepts(["-fopenmp"]):
            compile_args.append("-fopenmp")
            link_args.append("-fopenmp")
        if os.environ.get("KVLAB_SANITIZE"):
            sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
            compile_args += sanitize + ["-O1"]
            link_args += sanitize
        for ext in self.extensions:
            ext.extra_compile_args = compile_args
            ext.extra_link_args = link_args
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "kvlab._kvlab",
            sources=CORE_SOURCES,
            include_dirs=["csrc", numpy.get_include()],
            depends=[str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.h")],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
