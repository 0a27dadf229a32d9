"""What the chapters' figure scripts share: the machine they ran on, and the benchmarks'
own workloads (benchmarks/ is importable from here, so a figure measures exactly what the
benchmark it quotes measures)."""
import os
import platform
import sys
from pathlib import Path

import kvlab

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def machine() -> dict:
    """The CPU's name, its core count and the software versions, for the JSON's setup."""
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "kvlab": kvlab.__version__}
