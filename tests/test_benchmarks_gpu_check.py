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
    # build, smoke test, tests, one sanitizer rerun, benchmarks: every step is limited
    assert len(limits) == 5, limits
    assert sum(limits) <= 480, f"the steps may take {sum(limits)} s in all"
    assert f"limits add up to {sum(limits)} s" in text      # and its header says so


def test_results_go_to_out_and_a_missing_extension_is_a_failure():
    text = SCRIPT.read_text()
    assert 'RESULTS=${OUT:-' in text
    assert "KVLAB_CUDA=1" in text and "import kvlab._cuda" in text
    assert "compute-sanitizer" in text and "CUDA_LAUNCH_BLOCKING=1" in text
    assert "nvidia-smi" in text and "--version" in text and "setuptools" in text
