"""Imports the compiled core (kvlab._kvlab) with a helpful error when it is missing.

The usual cause is running Python from the repository root, where the source folder
`kvlab/` (which has no compiled extension in it) shadows the installed package.
"""
import os
from pathlib import Path

# OpenMP threads that finish their share of a matrix product wait for the others. By
# default GNU OpenMP spins for about 300,000 iterations before sleeping, which is fastest
# on an idle machine but disastrous on a busy one (a notebook next to a browser, a shared
# lab server): the spinning thread steals the core the thread it waits for needs. On two
# cores with two other busy processes, a decode step of the bundled model took 28 ms
# instead of 0.4 ms; with a spin of 1,000 it took 1.5 ms (10,000: 4.9 ms), at a cost of
# about 7 % on an idle machine. libgomp reads this once, when the extension below first
# loads it; a value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

try:
    from . import _kvlab  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on how kvlab was installed
    package_dir = Path(__file__).resolve().parent
    in_source_tree = (package_dir.parent / "setup.py").exists()
    built_here = any(package_dir.glob("_kvlab*.so")) or any(package_dir.glob("_kvlab*.pyd"))
    if in_source_tree and not built_here:
        hint = ("you are importing kvlab from its source folder "
                f"({package_dir}), which has no compiled extension. Either run from another "
                "directory so the installed kvlab is used, or build in place with "
                "`pip install -e .`")
    else:
        hint = "rebuild it (`pip install .`, a C compiler is needed)"
    raise ImportError(f"kvlab's C extension could not be imported: {error}; {hint}") from error

core = _kvlab
