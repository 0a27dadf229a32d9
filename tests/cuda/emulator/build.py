"""Builds kvlab's CUDA backend for the CPU emulator (cuda_runtime.h beside this file) into
a copy of the kvlab package, so that the GPU tests can run the real kernel source on a
machine without a GPU. Usage: python build.py OUT_DIR  (then see run.sh)."""
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LAUNCH = re.compile(r"([A-Za-z_][\w\[\] \-\+]*?)<<<(.*?)>>>\(")
DYNAMIC_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")


def translate(source: str) -> str:
    """kernel<<<g, b, s>>>(...) -> emu_launch(kernel, g, b, s)(...); shared memory as the
    emulator keeps it."""
    source = DYNAMIC_SHARED.sub(r"\1 *\2 = (\1 *)emu_dynamic_shared();", source)
    source = source.replace("__shared__ ", "static ")
    return LAUNCH.sub(r"emu_launch(\1, \2)(", source)


def main(out: Path) -> None:
    src, obj = out / "src", out / "obj"
    for d in (src, obj):
        d.mkdir(parents=True, exist_ok=True)
    package = out / "kvlab"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(REPO / "kvlab", package, ignore=shutil.ignore_patterns("_cuda*.so", "__pycache__"))
    flags = ["-std=c++20", "-O1", "-g", "-fPIC", "-Wno-unused-function", f"-I{HERE}",
             f"-I{REPO / 'csrc'}", f"-I{REPO / 'csrc' / 'cuda'}"]

    def build(cu: Path) -> Path:
        (src / (cu.stem + ".cpp")).write_text(translate(cu.read_text()))
        target = obj / (cu.stem + ".o")
        subprocess.run(["g++", *flags, "-include", "cuda_runtime.h", "-c", str(src / (cu.stem + ".cpp")),
                        "-o", str(target)], check=True)
        return target

    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(build, sorted((REPO / "csrc" / "cuda").glob("*.cu"))))
    names = " ".join(p.name for p in sorted((REPO / "csrc" / "cuda").glob("*.cu")))
    # the binding, and the CPU binding's helpers it shares (setup.py's SHARED_BINDING_SOURCES)
    bindings = [REPO / "csrc" / "cuda" / "_cuda.c", REPO / "csrc" / "python" / "arrays.c",
                REPO / "csrc" / "python" / "formats.c"]
    binding_objects = [obj / (source.stem + "_binding.o") for source in bindings]
    for source, target in zip(bindings, binding_objects):
        subprocess.run(["gcc", "-std=c11", "-O1", "-g", "-fPIC", f"-I{REPO / 'csrc'}",
                        f"-I{REPO / 'csrc' / 'cuda'}", f"-I{REPO / 'csrc' / 'python'}",
                        f"-I{numpy.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                        f'-DKV_CUDA_SOURCES="{names}"', '-DKV_CUDA_ARCHS="emulated sm_90"',
                        "-DPY_ARRAY_UNIQUE_SYMBOL=kvlab_cuda_PyArray_API", "-c", str(source),
                        "-o", str(target)], check=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(["g++", "-shared", "-o", str(package / f"_cuda{suffix}"),
                    *map(str, binding_objects), *map(str, objects)], check=True)
    print(f"emulated kvlab in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
