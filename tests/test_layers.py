"""The package's layers: no module imports one that imports it back, and the imports made
inside functions are the few with a reason other than dodging a cycle (issue 19)."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvlab"

# module -> modules it imports lazily, and why (never "to break a cycle")
LAZY_ALLOWED = {
    "kvlab.cli": "each command imports what it needs, so `kvlab --help` starts fast",
    "kvlab.sampling": "the scheduler uses its checks without the compiled core",
    "kvlab.cuda": "the CUDA extension is optional: built only where nvcc was found",
    "kvlab._core": "the compiled core's import error is turned into a clear message",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> list:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    target = ".".join(base + ([node.module] if node.module else []))
    if node.module:
        return [target]
    return [f"{target}.{alias.name}" for alias in node.names]


def imports(lazy: bool) -> dict:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if "labs" in path.parts:          # students' starters and checks, not the package's code
            continue
        name, tree = module_name(path), ast.parse(path.read_text())
        nodes = ast.walk(tree) if lazy else tree.body
        found = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                if lazy and node in tree.body:
                    continue
                found.update(resolve(name, node, path.name == "__init__.py"))
        graph[name] = found
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = imports(lazy=False)
    modules = set(graph)

    def known(target):       # `from . import x` may name a module or a name of a package
        return target if target in modules else target.rsplit(".", 1)[0]
    edges = {m: {known(t) for t in targets} - {m} for m, targets in graph.items()}
    cycles = []

    def visit(node, path):
        for nxt in edges.get(node, ()):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt in edges and len(path) < 30:
                visit(nxt, path + [nxt])
    for start in edges:
        if start != "kvlab":                 # the package imports its modules, by design
            visit(start, [start])
    cycles = [c for c in cycles if "kvlab" not in c]
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_imports_inside_functions_have_a_reason():
    lazy = {m: t for m, t in imports(lazy=True).items() if t}
    unexplained = {m: sorted(t) for m, t in lazy.items()
                   if m not in LAZY_ALLOWED and not m.startswith("kvlab.grading")}
    assert not unexplained, f"imports inside functions without a stated reason: {unexplained}"


CSRC = PACKAGE.parent / "csrc"
BINDING = CSRC / "python"     # the Python binding: the one layer above the core (csrc/*.c)


def c_functions(folder: Path) -> dict:
    """Each kv_* function defined in folder's C files -> its file, relative to csrc/."""
    defined = {}
    for path in sorted(folder.glob("*.c")):
        for match in re.finditer(r"^[A-Za-z][\w \*]*?\b(kv_\w+)\([^;]*?\)\s*\{", path.read_text(),
                                 re.M | re.S):
            defined[match.group(1)] = str(path.relative_to(CSRC))
    return defined


def c_calls(folder: Path, defined: dict) -> dict:
    """For each C file of folder: the other files, among those of `defined`, whose kv_*
    functions it calls (a function belongs to the file that defines it)."""
    calls = {}
    for path in sorted(folder.glob("*.c")):
        name = str(path.relative_to(CSRC))
        used = set(re.findall(r"\b(kv_\w+)\s*\(", path.read_text()))
        calls[name] = {defined[f] for f in used if f in defined and defined[f] != name}
    return calls


def call_cycles(calls: dict) -> list:
    cycles = []

    def visit(node, path):
        for nxt in calls.get(node, ()):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif len(path) < 20:
                visit(nxt, path + [nxt])
    for start in calls:
        visit(start, [start])
    return cycles


def test_no_c_file_calls_a_file_that_calls_it_back():
    calls = c_calls(CSRC, c_functions(CSRC))
    assert "model.c" in calls and calls["model.c"], "the scan found nothing: fix the test"
    cycles = call_cycles(calls)
    assert not cycles, f"C files that call each other back: {cycles[:5]}"
    # the run-time settings are a leaf: every math file may use them, they use none
    assert calls["runtime.c"] == set()
    # the binding's files (one per object) layer the same way among themselves
    binding = c_calls(BINDING, c_functions(BINDING))
    assert binding.get("python/model.c"), "the scan found no binding: fix the test"
    cycles = call_cycles(binding)
    assert not cycles, f"binding files that call each other back: {cycles[:5]}"


def test_the_python_binding_is_the_only_layer_above_the_core():
    """The core (csrc/*.c, *.h) is plain C: it includes neither Python.h nor NumPy and calls
    nothing of the binding (csrc/python/), which calls into it."""
    with_python = [p.name for p in [*CSRC.glob("*.c"), *CSRC.glob("*.h")]
                   if re.search(r'^\s*#\s*include\s*[<"](Python\.h|numpy/)', p.read_text(), re.M)]
    assert not with_python, f"core files that include Python or NumPy: {with_python}"
    binding_functions = c_functions(BINDING)
    assert "kv_py_array" in binding_functions, "the scan found no binding: fix the test"
    calls_up = {f: sorted(t) for f, t in c_calls(CSRC, binding_functions).items() if t}
    assert not calls_up, f"core files that call the binding: {calls_up}"
    assert any(c_calls(BINDING, c_functions(CSRC)).values()), "the binding calls no core file?"
