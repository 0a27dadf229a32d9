"""What every chapter's figure script records beside its numbers: the machine they came from."""
import os
import platform
from pathlib import Path

import kvlab


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
