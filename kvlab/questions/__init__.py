"""The "Check yourself" questions of each chapter whose answer is a number.

One module per chapter (ch01.py ... ch09.py), each with a table NUMBERS that maps a
question's number in the chapter's "Check yourself" list to a `Number`: how the kit works
the answer out (a function of kvlab's own machinery or of the chapter's measurements, not a
number typed in), how close an answer must be, and a hint for a wrong one.
`kvlab.your_turn.answer("02_cache_size", 3, 1.5e9)` checks a student's answer against it.

The worked answers, with their reasoning, are for instructors (instructor/chapter_answers/).
"""
from __future__ import annotations

import importlib
import json
from importlib.resources import files
from pathlib import Path
from typing import Callable, Dict, NamedTuple

CHAPTERS = ("01_kv_cache", "02_cache_size", "03_gqa", "04_paged", "05_batching",
            "06_quantization", "07_gpu_kernels", "08_fewer_positions", "09_speculative",
            "10_weight_quantization", "11_serving_at_scale")


class Number(NamedTuple):
    expected: Callable[[], float]   # works the answer out with the kit, when asked
    unit: str                       # what the number counts ("bytes", "x", "%", ...)
    rel_tol: float = 0.01           # an answer this close (relative) is right
    hint: str = ""                  # said when the answer is wrong
    whole: bool = False             # a count of whole things (requests, blocks): 30.2 is wrong


def figures(name: str) -> dict:
    """A chapter's measurements, chapters/figures/NAME ("ch05.json"): installed with the
    package as kvlab.chapters, or read from the repository beside the kit (an editable
    install, a clone)."""
    try:
        # kvlab.chapters has no __init__.py: files() gives a MultiplexedPath, whose
        # joinpath takes one part at a time ("/" does the same)
        return json.loads((files("kvlab.chapters") / "figures" / name).read_text())
    except (ModuleNotFoundError, OSError):       # FileNotFoundError, NotADirectoryError too
        path = Path(__file__).resolve().parents[2] / "chapters" / "figures" / name
        return json.loads(path.read_text())


def numbers(chapter: str) -> Dict[int, Number]:
    """The number questions of one chapter ("05_batching"), by question number."""
    if chapter not in CHAPTERS:
        raise ValueError(f"no chapter {chapter!r}; the chapters are {', '.join(CHAPTERS)}")
    try:
        module = importlib.import_module(f"{__name__}.ch{chapter[:2]}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.ch{chapter[:2]}":
            raise
        return {}
    return dict(module.NUMBERS)
