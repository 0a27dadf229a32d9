"""A lab's grader file without some of its tests, and the proof that a planted mistake cannot
reach a test, for the suite's gradings of cheats and mistakes (test_grading_cheats.py,
test_grading.py) that leave out slow tests (@points(..., slow=N): lab 13's runs on SmolLM2,
30-60 s of CPU a grading) whose outcome they cannot change.

`unreachable` reads code, it runs nothing: it follows the submission (`sub`) from a test
through the grader's own functions to the names the test calls on it, then through the
reference solution's functions to every name those use. A mistake that defines none of them
runs the same code as the solution in that test, in a fresh worker (the judge starts one a
test). Anything it cannot follow (the submission handed to kvlab's code, or read by a name
built at run time, a mistake with code outside its functions) counts as reached: the test
is kept. It proves nothing about the grader or the solution, only that the mistake's run of
the test is the solution's.
"""
import ast
from pathlib import Path

# what a mistake file may hold besides functions, and still be read as only its functions
DECLARATIONS = {"EXPECTED_FAILURES", "TARGETS", "BUILT_ON"}


def slow_tests(grader: Path) -> set:
    """The tests of `grader` marked @points(..., slow=N)."""
    def slow(node):
        return any(isinstance(d, ast.Call) and any(k.arg == "slow" for k in d.keywords)
                   for d in node.decorator_list)
    return {node.name for node in ast.parse(grader.read_text()).body
            if isinstance(node, ast.FunctionDef) and slow(node)}


def without_tests(grader: Path, names: set, folder: Path) -> Path:
    """`grader` with the test functions `names` (and their decorators) cut out, written to
    `folder`; `grader` itself when there are none to cut."""
    source = grader.read_text()
    cut = [node for node in ast.parse(source).body
           if isinstance(node, ast.FunctionDef) and node.name in names]
    if not cut:
        return grader
    lines = source.splitlines(keepends=True)
    for node in sorted(cut, key=lambda node: node.lineno, reverse=True):
        del lines[min(d.lineno for d in node.decorator_list) - 1:node.end_lineno]
    trimmed = folder / f"{grader.stem}_graders.py"        # (beside the submission, not over it)
    trimmed.write_text("".join(lines))
    return trimmed


# names through which code reaches a module's names without naming them
DYNAMIC = {"globals", "vars", "eval", "exec", "__import__", "getattr", "setattr"}


def functions_of(tree: ast.Module) -> dict:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def definitions_of(tree: ast.Module) -> dict:
    """{name: the top-level statement that binds it} (functions, classes, assignments)."""
    bound = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        bound[name.id] = node
    return bound


def names_called_on(function: ast.FunctionDef, alias: str, local: dict, seen: set):
    """The attribute names `function` (and the functions of `local` it hands `alias` to) use
    on its parameter `alias`; None where `alias` goes anywhere else."""
    if (function.name, alias) in seen:
        return set()
    seen.add((function.name, alias))
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    names = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Name) or node.id != alias:
            continue
        parent = parents[node]
        if isinstance(parent, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(parent.attr)
            continue
        # handed on, whole, to a function of the grader's own: follow it there
        if (not isinstance(parent, ast.Call) or not isinstance(parent.func, ast.Name)
                or parent.func.id not in local or node not in parent.args):
            return None
        callee = local[parent.func.id]
        params = [a.arg for a in callee.args.posonlyargs + callee.args.args]
        index = parent.args.index(node)
        if index >= len(params):
            return None
        more = names_called_on(callee, params[index], local, seen)
        if more is None:
            return None
        names |= more
    return names


def used_by(names: set, solution: ast.Module):
    """`names` and every top-level name of the solution their definitions use, transitively;
    None where one of them reaches names without naming them (DYNAMIC)."""
    top = definitions_of(solution)
    used, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in used:
            continue
        used.add(name)
        if name in top:
            todo += [n.id for n in ast.walk(top[name]) if isinstance(n, ast.Name)]
    return None if used & DYNAMIC else used


def defined_by(mistake: ast.Module):
    """The top-level names a mistake file defines over the solution's; None where it holds
    anything but functions, its declarations and names bound to names (code run at import
    could change anything)."""
    names = set()
    for node in mistake.body:
        if isinstance(node, ast.FunctionDef):
            # (decorators and default values run at import)
            if node.decorator_list or node.args.defaults or any(node.args.kw_defaults):
                return None
            names.add(node.name)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue                                                   # the docstring
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            target = node.targets[0].id
            if target in DECLARATIONS:
                continue
            if not isinstance(node.value, ast.Name):
                return None
            names.add(target)
        else:
            return None
    return names


def unreachable(test: str, grader: Path, solution: Path, mistake_source: str) -> bool:
    """Whether the grader's test `test` provably calls none of what the mistake (code
    appended to the solution, its later definitions replacing the solution's) defines."""
    local = functions_of(ast.parse(grader.read_text()))
    function = local[test]
    params = [a.arg for a in function.args.args]
    called = names_called_on(function, params[0], local, set())      # test(sub, rng)
    defined = defined_by(ast.parse(mistake_source))
    if called is None or defined is None:
        return False
    used = used_by(called, ast.parse(solution.read_text()))
    return used is not None and not used & defined
