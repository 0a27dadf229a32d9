"""benchmarks/lab_difficulty.py: the lines it counts as a solution's code."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lab_difficulty  # noqa: E402


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(tmp_path):
    path = tmp_path / "solution.py"
    path.write_text('"""A module docstring\nover two lines."""\nimport math\n\n\n'
                    'def f(x):\n    """f\'s docstring."""\n    # a comment\n'
                    '    return (x +\n            1)   # a comment after code\n\n'
                    'class C:\n    "one line"\n    y = "not a docstring"\n')
    # import, def, return over two lines, class, y = ...
    assert lab_difficulty.code_lines(path) == 6


def test_code_lines_of_a_c_file_leave_out_comments_and_blank_lines(tmp_path):
    path = tmp_path / "solution.c"
    path.write_text('/* a comment\nover two lines */\n#include <math.h>\n\n'
                    '// a line comment\nint f(int x) {   /* after code */\n'
                    '    return x + 1;  // "not a string"\n}\nconst char *s = "/* not a comment */";\n')
    # include, int f, return, }, const char
    assert lab_difficulty.code_lines(path) == 5
