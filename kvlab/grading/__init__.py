"""Graded labs: hand a student a starter file, grade what they hand back.

    kvlab lab list                         # the labs, in course order, with their points
    kvlab lab start cache_size .           # copy the starter and its instructions
    kvlab check cache_size cache_size.py   # the lab's public self-checks
    kvlab grade cache_size cache_size.py   # the hidden tests where instructor/ is found
    kvlab lab autograder cache_size -o cache_size.zip   # a Gradescope autograder
    kvlab grade-all cache_size submissions/ --instructor DIR   # a class, summary.csv

How a grade is made (each file does one part):
    labs.py      the labs, their points, what each lets a submission import
    policy.py    that rule, checked in the source and enforced at import time
    judge.py     the process that owns the tests, the points and the score
    worker.py    the process that runs the student's code, one per test
    process.py   starting, timing, silencing and killing workers, from the judge
    wire.py      the values that pass between them (no pickle)
    remote.py    the student's functions and objects as a test calls them
    testkit.py   what tests are written with: @points, raises, check_close
    handouts.py  what the own-cache, cache-size and GQA labs lend (models, kvlab functions)
    served.py    the speculative-decoding lab's model and the passes it ran
                 (both stay in the judge: the student's code holds proxies)
    cbuild.py    a lab in C: its file checked, and the command a worker builds it with
    kernel_cases.py  the kernel lab's cases (a paged int8 pool), and its timing
    gpu_kernel_cases.py  its GPU edition's timing (chains on the device, a copy's bandwidth)
    report.py    the grade, and Gradescope's results.json
    runner.py    grade() and check(): start a judge, read its report
    batch.py     grade_all(): a folder of submissions, a judge each, and a CSV summary
    autograder.py  the Gradescope package, and its entry point on Gradescope
"""
from .labs import LABS, Lab, get_lab, start_lab
from .report import GradeReport, TestResult
from .runner import check, grade

__all__ = ["LABS", "Lab", "get_lab", "start_lab", "grade", "check", "GradeReport", "TestResult"]
