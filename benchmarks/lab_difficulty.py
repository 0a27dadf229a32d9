"""How big each graded lab is: the lines of its reference solution, the lines a student
starts from, and how long an honest run of its hidden tests takes.

    python benchmarks/lab_difficulty.py [--seeds 3] [--json lab_difficulty.json] [--lab NAME ...]

Needs a clone (instructor/ holds the solutions and the hidden tests). Lines are code
lines: not blank, not only a comment, not inside a docstring (in a C lab's file: not
blank and not only a comment). The grading time is the wall
time of `kvlab.grading.grade` on the reference solution, the judge's start and every
worker's included, for each seed (each draws other cases); the table shows the median.
That is the time a student waits for a grade, and about the time one submission costs an
autograder; a student's slower code can take longer, up to each test's 60 s limit.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import statistics
import time
import tokenize
from pathlib import Path

from kvlab.grading import grade
from kvlab.grading.cbuild import blank_comments_and_strings
from kvlab.grading.labs import LABS

REPO = Path(__file__).resolve().parents[1]
INSTRUCTOR = REPO / "instructor"


def code_lines(path: Path) -> int:
    """Lines holding code: comments, blank lines and docstrings left out."""
    source = path.read_text()
    if path.suffix in (".c", ".h"):
        return sum(1 for line in blank_comments_and_strings(source).split("\n") if line.strip())
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="grading runs per lab (default 3)")
    parser.add_argument("--json", default="lab_difficulty.json", help="where to write the figures")
    parser.add_argument("--lab", action="append", choices=list(LABS),
                        help="measure this lab only (repeatable; default: every lab)")
    args = parser.parse_args()
    rows = []
    for lab in sorted(LABS.values(), key=lambda lab: lab.number):
        if args.lab and lab.name not in args.lab:
            continue
        solution = INSTRUCTOR / "solutions" / f"{lab.name}{lab.suffix}"
        tests = INSTRUCTOR / "graders" / f"{lab.name}.py"
        seconds, scores = [], []
        for seed in range(1, args.seeds + 1):
            started = time.perf_counter()
            report = grade(lab.name, solution, tests=tests, seed=seed)
            seconds.append(time.perf_counter() - started)
            scores.append(report.score)
        rows.append({"lab": lab.name, "number": lab.number, "points": lab.points,
                     "hidden_tests": len(report.tests),
                     "solution_lines": code_lines(solution), "starter_lines": code_lines(lab.starter),
                     "grade_seconds": seconds, "grade_seconds_median": statistics.median(seconds),
                     "full_marks": all(score == lab.points for score in scores)})
    print(f"{'#':>2}  {'lab':<16} {'points':>6} {'tests':>5} {'solution':>8} {'starter':>7} "
          f"{'grading (s)':>11}  full marks")
    for r in rows:
        print(f"{r['number']:>2}  {r['lab']:<16} {r['points']:>6} {r['hidden_tests']:>5} "
              f"{r['solution_lines']:>8} {r['starter_lines']:>7} {r['grade_seconds_median']:>11.1f}  "
              f"{'yes' if r['full_marks'] else 'NO'}")
    Path(args.json).write_text(json.dumps({"seeds": args.seeds, "labs": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
