"""A grade: each test's result, the score the judge computed, and Gradescope's results.json."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional, Union


@dataclasses.dataclass
class TestResult:
    name: str
    score: float
    max_score: float
    output: str = ""
    visibility: str = "visible"
    status: str = "failed"

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def function(self) -> str:
        """The test's function name (name is "function: its first docstring line")."""
        return self.name.split(":")[0]


@dataclasses.dataclass
class GradeReport:
    lab: str
    submission: str
    tests: List[TestResult]
    output: str = ""            # what concerns the whole submission (an import error, ...)
    execution_time: float = 0.0
    graded_with: str = ""       # "hidden tests" or "public checks"
    seed: Optional[int] = None  # the hidden cases' seed (rerun with it to see the same cases)
    refused: str = ""           # why no grade could be given, when none could (scores are 0)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def failed(self) -> List[str]:
        """Function names of the tests that did not pass."""
        return [t.function for t in self.tests if not t.passed]

    def headline(self) -> str:
        seed = f", seed {self.seed}" if self.seed is not None else ""
        # a file is named by its path inside the submission where there is one (Gradescope)
        name = Path(self.submission).name if Path(self.submission).is_absolute() else self.submission
        if self.refused:
            return (f"lab {self.lab}: NOT GRADED ({self.refused})  ({name}, with the "
                    f"{self.graded_with}{seed})")
        return (f"lab {self.lab}: {self.score:g} / {self.max_score:g} points  ({name}, graded "
                f"with the {self.graded_with}{seed})")

    def gradescope(self) -> dict:
        """The results.json Gradescope's autograder reads (its documented format)."""
        output = self.headline() + (f"\n\n{self.output}" if self.output else "")
        return {"score": self.score, "execution_time": round(self.execution_time, 2),
                "output": output, "visibility": "visible", "stdout_visibility": "hidden",
                "tests": [{"name": t.name, "number": str(i + 1), "score": t.score,
                           "max_score": t.max_score, "status": t.status, "output": t.output,
                           "visibility": t.visibility}
                          for i, t in enumerate(self.tests)]}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GradeReport":
        fields = dict(data)
        fields["tests"] = [TestResult(**t) for t in data["tests"]]
        return cls(**fields)

    def save(self, path: Union[str, Path]) -> None:
        """Write results.json (Gradescope's format) atomically."""
        write_atomically(path, json.dumps(self.gradescope(), indent=2) + "\n")

    def summary(self) -> str:
        lines = [self.headline()]
        if self.output:
            lines.append(self.output)
        for t in self.tests:
            mark = "PASS" if t.passed else "FAIL"
            lines.append(f"  {mark} {t.score:>4g}/{t.max_score:<4g} {t.name}")
            if t.output:            # why it failed, or what a passed one measured
                lines += ["         " + line for line in t.output.splitlines()[:8]]
        return "\n".join(lines)


def write_atomically(path: Union[str, Path], text: str) -> None:
    """Write `text` to `path` through a new file renamed over it: a reader sees the old
    file or the whole new one, and whatever sat at `path` (a file, a link) is replaced."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
