"""benchmarks/gpu_check.sh, the one command a GPU session runs: it must fit one command's
10-minute limit with room for a rerun's start, and send everything to $OUT as it goes."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_its_time_limits_fit_a_ten_minute_command():
    text = SCRIPT.read_text()
    limits = [int(n) for n in re.findall(r"\btimeout (\d+)", text)]
    # build, smoke test, tests, one sanitizer rerun, the kernel lab, benchmarks: every step
    # is limited
    assert len(limits) == 6, limits
    assert sum(limits) <= 480, f"the steps may take {sum(limits)} s in all"
    assert f"limits add up to {sum(limits)} s" in text      # and its header says so


FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
    --version) echo "Python (a stand-in)" ;;
    *"import setuptools"*) echo "setuptools 0 / numpy 0" ;;
    *setup.py*) echo "building (a stand-in)"; exit "${FAKE_BUILD_STATUS:-0}" ;;
    *"import kvlab._cuda"*) echo "ImportError: No module named 'kvlab._cuda'" >&2; exit 1 ;;
    *) echo "gpu_check.sh went further than it should have: $*" >&2; exit 3 ;;
esac
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and timeout")
@pytest.mark.parametrize("build_status, said", [
    (0, "kvlab._cuda did not build"),          # a CPU-only build is a failure here
    (1, "the build failed")])
def test_a_run_that_cannot_build_the_gpu_backend_fails_loudly_into_out(tmp_path, build_status,
                                                                        said):
    # Stand-ins for the machine: nvidia-smi and nvcc that answer, a Python whose build
    # succeeds (or fails) without making kvlab._cuda. The script must stop there, exit
    # non-zero, and have written what it saw into $OUT.
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    for name, text in [("nvidia-smi", "#!/bin/sh\necho 'GPU 0: a stand-in'\n"),
                       ("nvcc", "#!/bin/sh\necho 'Cuda compilation tools (a stand-in)'\n"),
                       ("python", FAKE_PYTHON)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out),
           "PYTHON": str(bin_dir / "python"), "FAKE_BUILD_STATUS": str(build_status),
           "HOME": str(tmp_path)}
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    log = (out / "gpu_check.log").read_text()
    assert "GPU 0: a stand-in" in log and "Cuda compilation tools" in log
    assert "setuptools 0" in log and said in log
    assert (out / "gpu_build.log").read_text().startswith("building (a stand-in)")
    assert "went further" not in run.stdout + run.stderr + log
