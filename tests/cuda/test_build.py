"""The CUDA backend's build and its face on a machine without a GPU (these run everywhere).

Where nvcc exists and a GPU is seen, or KVLAB_CUDA=1 asks for it (CI does), the package
must have been built with its CUDA extension: setup.py compiles every csrc/cuda/*.cu file
for every listed architecture, so a kernel that does not compile for one fails the build,
and this test notices a build that skipped them. Without a GPU, kvlab must still
import, say why it cannot use one, and refuse GPU work with a clear error.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab

REPO = Path(__file__).resolve().parents[2]
CUDA_DIR = REPO / "csrc" / "cuda"


def nvcc_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc") or (home and Path(home, "bin", "nvcc").is_file()))


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.returncode == 0 and bool(out.stdout.strip())


def cuda_asked() -> bool:
    return os.environ.get("KVLAB_CUDA", "") not in ("", "0")


@pytest.mark.skipif(not nvcc_present() or bool(os.environ.get("KVLAB_NO_CUDA"))
                    or not (cuda_asked() or gpu_present()),
                    reason="the CUDA extension is built where nvcc is found and a GPU is seen, "
                           "or KVLAB_CUDA=1 asks for it (CI does)")
def test_every_cu_file_was_compiled_into_the_extension():
    from kvlab import _cuda   # ImportError here: the build skipped the CUDA backend
    if CUDA_DIR.is_dir():     # tests run from a checkout: every kernel file is in the build
        assert set(_cuda.SOURCES) == {p.name for p in CUDA_DIR.glob("*.cu")}
    assert len(_cuda.SOURCES) >= 10
    archs = _cuda.ARCHS.split()
    assert archs and archs[-1].startswith("compute_"), _cuda.ARCHS   # PTX for later GPUs
    if not (gpu_present() or os.environ.get("KVLAB_CUDA_ARCH")
            or os.environ.get("KVLAB_CUDA_GENCODE")):
        # built for the GPUs students have: every one of them compiled (sm_70, the V100,
        # only with an nvcc that still knows it)
        assert {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"} <= set(archs), _cuda.ARCHS


def test_importing_kvlab_does_not_load_the_extension():
    code = "import sys, kvlab, kvlab.cuda; print('kvlab._cuda' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(REPO.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_availability_is_a_yes_or_a_reason():
    reason = kvlab.cuda.why_not()
    assert kvlab.cuda.is_available() == (reason is None)
    if reason is not None:
        assert any(word in reason for word in ("extension", "driver", "GPU", "runtime")), reason


@pytest.mark.skipif(kvlab.cuda.is_available(), reason="a GPU is here: tests/cuda/test_gpu.py")
def test_gpu_work_without_a_gpu_is_a_clear_error():
    model = kvlab.load()
    assert model.device == "cpu" and model.to("cpu") is model
    with pytest.raises(kvlab.CudaError, match="cannot be used"):
        model.to("cuda")
    with pytest.raises(kvlab.CudaError):
        kvlab.load(device="cuda")
    with pytest.raises(kvlab.CudaError):
        kvlab.cuda.device_info()
    with pytest.raises(ValueError, match="device"):
        model.to("tpu")
