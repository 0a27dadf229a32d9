"""Graded labs: hand a student a starter file, grade what they hand back.

    kvlab lab list                         # the labs, in course order
    kvlab lab start cache_size .           # copy the starter and its instructions
    kvlab grade cache_size cache_size.py   # run the grader, print a summary, write results.json

A lab is a folder in kvlab/labs/<name>/: README.md (the instructions), starter.py (what
the student edits; every function raises NotImplementedError until written) and
test_<name>.py (the grader: pytest tests, each worth `@pytest.mark.points(n)`, that import
the submission through the `submission` fixture). Reference solutions are not shipped
with the package: they live in the repository's instructor/ folder.

`grade` runs pytest in a child process (a student's infinite loop or crash cannot take the
notebook down with it) and returns a GradeReport; its `gradescope()` dict is the
results.json format Gradescope's autograder reads.
"""
from .labs import LABS, Lab, get_lab, start_lab
from .runner import GradeReport, TestResult, grade

__all__ = ["LABS", "Lab", "get_lab", "start_lab", "grade", "GradeReport", "TestResult"]
