"""The test functions of a grader or public-check file, loaded once per test session.

kvlab.grading.judge.load_tests runs the file's prepare() (what the judge reads before any
worker starts): for cache_eviction and weight_quantization that loads SmolLM2, 3-5 s of
CPU each time. The suite reads the lists only for names, points and marks (timed), many
times over: once per file is enough, and prepare() still runs that once here. The judge
itself always loads its own, in its own process."""
import functools
from pathlib import Path


@functools.lru_cache(maxsize=None)
def _loaded(path: Path) -> tuple:
    from kvlab.grading.judge import load_tests     # (imported late: kvlab may be unbuilt)
    return tuple(load_tests(path))


def grader_tests(path) -> list:
    """load_tests(path), the first time; the same functions after that (a new list)."""
    return list(_loaded(Path(path).resolve()))
