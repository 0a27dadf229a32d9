"""What a lab's submission may import and name: one policy, enforced twice.

A lab is about writing something yourself (a cache, a quantizer, an allocator), so the
submission may import numpy, math and the rest of Python's standard library, plus the few
kvlab pieces its lab names (for example kvlab.measure.resident_bytes in the cache-size
lab), and nothing else: not kvlab's own version of what the lab asks for, not the
course's solutions in instructor/, not the modules that load code or start processes.

The judge reads the submission's source before running it (check_source: every import,
every dotted name rooted in one, with its line), and the worker refuses the same imports
while the submission runs (import_refusal, from its __import__ hook). Neither is a
sandbox: Python code can reach almost anything through enough indirection. They turn the
easy ways of delegating into a clear failing line; the process boundary, the judge's own
oracle and hidden randomized tests are what keep the score honest (see the README's
section on grading).

Standard library only and no relative imports: the worker loads this file by path.
"""
from __future__ import annotations

import ast
import dataclasses
import sys
from typing import Iterable, List, Optional, Tuple

# Modules that load code, reach into the interpreter or start processes (asyncio starts them
# too, create_subprocess_exec). No lab needs them.
DENIED_MODULES = frozenset({
    "importlib", "imp", "pkgutil", "zipimport", "runpy", "code", "codeop", "builtins",
    "ctypes", "_ctypes", "cffi", "gc", "inspect", "marshal", "posix", "nt",
    "subprocess", "_posixsubprocess", "multiprocessing", "concurrent", "pty", "signal",
    "_signal", "atexit", "socket", "_socket", "instructor", "asyncio", "_asyncio",
    # modules that import or run code named in a string
    "pydoc", "pickle", "_pickle", "copyreg", "shelve", "timeit", "doctest", "trace",
    "profile", "cProfile", "pdb", "bdb", "unittest", "modulefinder", "xmlrpc", "logging.config",
})

# Attributes of allowed modules that do what the denied modules do.
DENIED_ATTRIBUTES = {
    "os": frozenset({"system", "popen", "fork", "forkpty", "register_at_fork", "kill",
                     "killpg", "setsid", "setpgid", "setpgrp", "execl", "execle", "execlp",
                     "execlpe", "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle",
                     "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                     "posix_spawn", "posix_spawnp"}),
    "sys": frozenset({"modules", "meta_path", "path_hooks", "path_importer_cache", "path",
                      "_getframe", "settrace", "setprofile", "addaudithook"}),
    "numpy": frozenset({"ctypeslib", "f2py", "distutils"}),
    "operator": frozenset({"attrgetter", "methodcaller"}),     # getattr under another name
}

# Builtins that run strings as code or hand out namespaces; and those that take an
# attribute's name as a string, which the check cannot read (write obj.name instead).
DENIED_NAMES = frozenset({"__import__", "exec", "eval", "compile", "breakpoint", "globals",
                          "vars", "__builtins__", "__loader__", "__spec__",
                          "getattr", "setattr", "delattr"})

# Attribute names that walk from any object to modules, frames or code.
DENIED_ATTRIBUTE_NAMES = frozenset({
    "__globals__", "__builtins__", "__subclasses__", "__code__", "__closure__",
    "__import__", "__loader__", "__spec__", "__dict__", "__bases__", "__base__", "__mro__",
    "__getattribute__", "__reduce__", "__reduce_ex__", "f_globals", "f_locals", "f_back",
    "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame", "co_code",
})

# Module names refused as any link of a dotted chain too (x.inspect.importlib reaches the
# same module as importing it); names that are common attributes (trace, code) are not.
DENIED_LINKS = frozenset({
    "importlib", "inspect", "builtins", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
    "multiprocessing", "pydoc", "pickle", "_pickle", "marshal", "gc", "signal", "_signal",
    "atexit", "runpy", "posix", "pty", "socket", "_socket", "pkgutil", "zipimport",
    "asyncio", "_asyncio",
})

ALWAYS_ALLOWED = frozenset(getattr(sys, "stdlib_module_names", ())) | {"numpy", "math"}


def refused_text() -> str:
    """The lists above as every lab's instructions end with them: "you may import the
    standard library" is true except for these, which reach around the grader."""
    def names(items):
        return ", ".join(f"`{n}`" for n in sorted(items, key=lambda n: n.lstrip("_")))
    attributes = [f"{module}.{name}" for module, denied in sorted(DENIED_ATTRIBUTES.items())
                  for name in sorted(denied)]
    return ("## What the grader refuses\n\n"
            "A few parts of Python reach around the grader (they load code, read other "
            "objects' namespaces or frames, or start processes), so a file that uses any of "
            "them is not graded at all. `kvlab check LAB your_file.py` names every one it "
            "finds. Write `obj.name` where you would write `getattr(obj, \"name\")`.\n\n"
            f"- the builtins {names(DENIED_NAMES)};\n"
            f"- the attributes {names(DENIED_ATTRIBUTE_NAMES)};\n"
            f"- the modules {names(DENIED_MODULES)};\n"
            f"- {names(attributes)}.\n")


@dataclasses.dataclass(frozen=True)
class Policy:
    """One lab's rule. topic: what the lab is about writing ("a KV cache"); kvlab: the
    dotted kvlab names it may use ("kvlab.measure.resident_bytes", ...)."""
    topic: str
    kvlab: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"topic": self.topic, "kvlab": list(self.kvlab)}

    @classmethod
    def from_dict(cls, data: dict) -> "Policy":
        return cls(str(data["topic"]), tuple(str(name) for name in data["kvlab"]))

    def kvlab_allows(self, dotted: str) -> bool:
        """`dotted` is an allowed name, a module on the way to one, or inside one."""
        return any(dotted == name or name.startswith(dotted + ".") or dotted.startswith(name + ".")
                   for name in self.kvlab)

    def allowed_kvlab_text(self) -> str:
        return ", ".join(self.kvlab) if self.kvlab else "nothing"


def _kvlab_refusal(policy: Policy, dotted: str) -> str:
    return (f"`{dotted}` is not allowed here: this lab is about writing {policy.topic} "
            f"yourself (from kvlab it allows {policy.allowed_kvlab_text()})")


def import_refusal(policy: Policy, name: str, fromlist: Iterable[str] = (),
                   level: int = 0) -> Optional[str]:
    """Why `import name` (or `from name import fromlist`) is refused, or None."""
    if level:
        return "relative imports are not allowed: your file is graded on its own"
    top = name.partition(".")[0]
    fromlist = [item for item in (fromlist or ()) if isinstance(item, str)]
    if top == "kvlab":
        for dotted in [name] + [f"{name}.{item}" for item in fromlist if item != "*"]:
            if not policy.kvlab_allows(dotted):
                return _kvlab_refusal(policy, dotted)
        if "*" in fromlist:
            return _kvlab_refusal(policy, f"from {name} import *")
        return None
    if top == "instructor":
        return "`instructor` is the course's own material: it is not yours to import"
    if top in DENIED_MODULES or name in DENIED_MODULES:
        return (f"`{name}` is not allowed in a lab submission: it loads code, reaches into "
                f"the interpreter or starts processes")
    if top not in ALWAYS_ALLOWED:
        lent = f" (and from kvlab: {policy.allowed_kvlab_text()})" if policy.kvlab else ""
        return (f"`{name}` is not allowed here: a submission is one file, which may import "
                f"numpy, math and Python's standard library{lent}; put helpers of your own in it")
    denied = DENIED_ATTRIBUTES.get(name, frozenset())
    for item in fromlist:
        if item in denied or item == "*" and denied:
            return f"`from {name} import {item}` is not allowed in a lab submission"
    return None


@dataclasses.dataclass(frozen=True)
class Violation:
    line: int
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.why}"


class _SourceCheck(ast.NodeVisitor):
    """Walks a submission's syntax tree once, collecting every refused name with its line."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.aliases = {}           # local name -> the dotted module or object it stands for
        self.found: List[Violation] = []

    def refuse(self, node: ast.AST, why: str) -> None:
        self.found.append(Violation(getattr(node, "lineno", 0), why))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            why = import_refusal(self.policy, alias.name)
            if why:
                self.refuse(node, why)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.partition(".")[0]
                self.aliases[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        names = [alias.name for alias in node.names]
        why = import_refusal(self.policy, module, names, node.level)
        if why:
            self.refuse(node, why)
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def _chain(self, node: ast.Attribute) -> Tuple[Optional[str], List[str]]:
        """(root name, attributes) of a.b.c, or (None, ...) when the root is not a name."""
        attributes = []
        while isinstance(node, ast.Attribute):
            attributes.append(node.attr)
            node = node.value
        attributes.reverse()
        return (node.id if isinstance(node, ast.Name) else None), attributes

    def _check_dotted(self, node: ast.AST, dotted: str) -> None:
        top = dotted.partition(".")[0]
        if top == "kvlab":
            if not any(dotted == name or dotted.startswith(name + ".") for name in self.policy.kvlab):
                self.refuse(node, _kvlab_refusal(self.policy, dotted))
            return
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            module, attribute = ".".join(parts[:i]), parts[i]
            if attribute in DENIED_ATTRIBUTES.get(module, ()):
                self.refuse(node, f"`{module}.{attribute}` is not allowed in a lab submission")
                return

    def _check_attribute_name(self, node: ast.Attribute) -> None:
        """One link of a chain, by its own name and the name before it, wherever the chain
        starts (x.sys.modules is sys.modules, whatever x is)."""
        if node.attr in DENIED_ATTRIBUTE_NAMES:
            self.refuse(node, f"`.{node.attr}` is not allowed in a lab submission: it reaches "
                              f"into the interpreter")
        elif node.attr in DENIED_LINKS:
            self.refuse(node, f"`.{node.attr}` is not allowed in a lab submission: it loads code, "
                              f"reaches into the interpreter or starts processes")
        before = node.value
        name = before.attr if isinstance(before, ast.Attribute) else getattr(before, "id", None)
        if node.attr in DENIED_ATTRIBUTES.get(name, ()):
            self.refuse(node, f"`{name}.{node.attr}` is not allowed in a lab submission")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check_attribute_name(node)
        root, attributes = self._chain(node)
        if root not in self.aliases:
            self.generic_visit(node)
            return
        # a.b.c rooted in an import is judged whole; its inner links only by their names
        self._check_dotted(node, ".".join([self.aliases[root]] + attributes))
        inner = node.value
        while isinstance(inner, ast.Attribute):
            self._check_attribute_name(inner)
            inner = inner.value

    def visit_Constant(self, node: ast.Constant) -> None:
        # a denied attribute's name spelled as a string is on its way to something like
        # getattr, whatever does the looking up
        if isinstance(node.value, str) and node.value in DENIED_ATTRIBUTE_NAMES:
            self.refuse(node, f"the string {node.value!r} is not allowed in a lab submission: "
                              f"it names an attribute that reaches into the interpreter")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in DENIED_NAMES:
            why = (": it looks attributes up by a name in a string; write obj.name"
                   if node.id.endswith("attr") else "")
            self.refuse(node, f"`{node.id}` is not allowed in a lab submission{why}")
        dotted = self.aliases.get(node.id)
        if dotted and isinstance(node.ctx, ast.Load):
            top = dotted.partition(".")[0]
            if top == "kvlab":
                self._check_dotted(node, dotted)
            elif top in DENIED_ATTRIBUTES and "." not in dotted and top != "numpy":
                # `os` or `sys` passed around as a value would hide what is taken from it
                self.refuse(node, f"`{node.id}` ({dotted}) may only be used as `{node.id}.name`")
            else:
                self._check_dotted(node, dotted)


def _is_main_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`, which never runs when the file is graded."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__" and not node.orelse)


def _binds_dunder_name(tree: ast.AST) -> bool:
    """Whether the file binds the name `__name__` anywhere (an assignment, a def or class, a
    loop, `with ... as`, `except ... as`, an import as, a global, a match capture): a file
    that makes it "__main__" runs its main block when the grader imports it. Setting an
    object's `.__name__` is not counted (a decorator does that to its wrapper): reaching the
    module object to set its own takes what the check refuses anyway."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "__name__" and not isinstance(node.ctx, ast.Load):
            return True
        names = [getattr(node, "name", None), getattr(node, "asname", None), getattr(node, "arg", None)]
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            names += node.names
        if "__name__" in names:
            return True
    return False


def check_source(source: str, policy: Policy, filename: str = "<submission>") -> List[Violation]:
    """Every refused import and name in `source`, with its line (SyntaxError propagates).
    A top-level `if __name__ == "__main__":` block, where students try their code, is not
    read: the grader imports the file under another name, so it never runs; unless the file
    binds `__name__` itself, which would run the block at import."""
    tree = ast.parse(source, filename=filename)
    check = _SourceCheck(policy)
    skip_main = not _binds_dunder_name(tree)
    for node in tree.body:
        if not (skip_main and _is_main_block(node)):
            check.visit(node)
    return sorted(set(check.found), key=lambda v: (v.line, v.why))
