"""The tests of a grader or public-check file as the suite lists them, loaded once per session.

kvlab.grading.judge.load_tests runs the file's prepare() (what the judge reads before any
worker starts): for cache_eviction and weight_quantization that loads SmolLM2, 3-5 s of
CPU each time. The suite reads the lists only for names, points and marks (timed), many
times over: once per file is enough, and prepare() still runs that once here. What is kept
is those facts, not the functions: a function holds its module, and the module what its
prepare() loaded (SmolLM2 and its float32 weights, most of a gigabyte). The judge always
loads its own tests, in its own process."""
import functools
from pathlib import Path


class ListedTest:
    """What the suite reads of a grading test: its name, its points, whether it is timed."""

    def __init__(self, test):
        self.__name__ = test.__name__
        self.points = test.points
        self.timed = getattr(test, "timed", False)


@functools.lru_cache(maxsize=None)
def _listed(path: Path) -> tuple:
    from kvlab.grading.judge import load_tests     # (imported late: kvlab may be unbuilt)
    return tuple(ListedTest(test) for test in load_tests(path))


def grader_tests(path) -> list:
    """The tests load_tests(path) gives, in its order, as ListedTest (loaded the first time)."""
    return list(_listed(Path(path).resolve()))
