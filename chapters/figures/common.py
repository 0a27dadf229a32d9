"""What the chapters' figure scripts share: the machine they ran on, and the benchmarks'
own workloads (benchmarks/ is importable from here, so a figure measures exactly what the
benchmark it quotes measures)."""
import os
import platform
import statistics
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


def spread(values) -> dict:
    """The median of repeated measurements and how far they spread: the smallest, the
    largest and the quartiles, with the number of runs. A chapter quotes the median and the
    range, so a reader sees how much a rerun may differ."""
    values = sorted(float(v) for v in values)
    if len(values) < 2:
        raise ValueError("a spread needs at least two runs")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q1, "q3": q3, "runs": len(values)}
