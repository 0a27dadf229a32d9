"""Imports the compiled core (kvlab._kvlab) with a helpful error when it is missing.

The usual cause is running Python from the repository root, where the source folder
`kvlab/` (which has no compiled extension in it) shadows the installed package.
"""
from pathlib import Path

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
