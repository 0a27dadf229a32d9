"""What a build of kvlab installs: every file of every lab's folder, of the bundled models
(kvlab/assets) and of the chapters' figures (their PNG, JSON and the scripts that made
them), with no warning from setuptools.

setuptools installs only the files of the packages it is told of; for a folder it is not
told of whose files package-data names, it warns today ("Package would be ignored") and
will leave the files out in a future release. So the test fails on the warning, not only on
a missing file. It runs setup.py's build_py (copying the Python and data files, no
compiling) on a copy of the sources in a temporary folder, so that nothing is written into
the repository. Not here: the compiled extension (tests/test_build.py, .ci/lanes' wheel lane).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what setup.py reads: its own module beside it, the metadata and the packages' folders
SOURCES = ("setup.py", "kvlab_build.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in",
           "kvlab", "chapters")
# what a build or a run leaves in a clone, which no package installs
LEFT_BY_BUILDS = (".so", ".pyd", ".o", ".pyc")
# repository folder -> where its files are installed
INSTALLED = {"kvlab/labs": "kvlab/labs", "kvlab/assets": "kvlab/assets",
             "chapters/figures": "kvlab/chapters/figures"}


def source_files(folder: Path) -> list:
    return sorted(p.relative_to(folder) for p in folder.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and not p.name.endswith(LEFT_BY_BUILDS))


def build_py(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVLAB_NO_CUDA="1")
    return subprocess.run([sys.executable, "setup.py", "build_py", "--build-lib", "out"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def copy_sources(tree: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", *(f"*{ext}" for ext in LEFT_BY_BUILDS))
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore)
        else:
            shutil.copy2(source, tree / name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tree = tmp_path_factory.mktemp("source")
    copy_sources(tree)
    result = build_py(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    return tree, result


def test_the_build_gives_no_warning_that_a_future_setuptools_drops_files(built):
    _, result = built
    output = result.stdout + result.stderr
    for warning in ("would be ignored", "absent from the `packages` configuration",
                    "as data is deprecated"):
        assert warning not in output, output


@pytest.mark.parametrize("folder", sorted(INSTALLED))
def test_every_file_of_the_folder_is_installed(built, folder):
    tree, _ = built
    expected = source_files(REPO / folder)
    assert expected, f"{folder} is empty"
    installed = set(source_files(tree / "out" / INSTALLED[folder]))
    missing = [str(p) for p in expected if p not in installed]
    assert not missing, f"the build leaves out of {folder}: {missing}"


def test_a_new_lab_with_c_and_cuda_files_is_installed_whole(tmp_path):
    """A lab folder nobody listed, with the file kinds a GPU lab has, is installed whole:
    the rule covers any lab, not the labs of today."""
    copy_sources(tmp_path)
    lab = tmp_path / "kvlab" / "labs" / "a_lab_of_tomorrow"
    lab.mkdir()
    names = ["README.md", "checks.py", "starter.cu", "kernel.cuh", "decls.h", "host.c"]
    for name in names:
        (lab / name).write_text("// part of a lab\n" if not name.endswith(".py") else "\n")
    result = build_py(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = tmp_path / "out" / "kvlab" / "labs" / "a_lab_of_tomorrow"
    assert sorted(p.name for p in installed.iterdir()) == sorted(names)
    assert "would be ignored" not in result.stdout + result.stderr
