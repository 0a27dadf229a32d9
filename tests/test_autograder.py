"""The Gradescope package (kvlab/grading/autograder.py): what the zip holds, and the zip run
end to end in a folder laid out like /autograder.

The run here uses this Python and grades as the same user. As root with
KVLAB_TEST_GRADESCOPE_SETUP=1 (CI sets it), the zip's setup.sh also runs as Gradescope runs
it (apt, a venv from the system Python, kvlab built from the zip, the unprivileged user), and
the student's code is shown to run as that user: it can read neither the tests nor the
results.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("kvlab._kvlab")
from kvlab.grading import LABS  # noqa: E402
from kvlab.grading.autograder import WORKER_USER, build, find_submission  # noqa: E402
import gradescope_setup  # noqa: E402
from gradescope_setup import unpack  # noqa: E402

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return build("cache_size", tmp_path_factory.mktemp("zip") / "cache_size.zip", INSTRUCTOR)


def run_autograder(root, env_extra, timeout=600):
    env = {**os.environ, "KVLAB_AUTOGRADER_ROOT": str(root), **env_extra}
    return subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)


def results(root):
    return json.loads((root / "results" / "results.json").read_text())


def test_the_zip_has_what_gradescope_needs_and_nothing_of_the_instructors(package):
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in archive.infolist()}
        settings = json.loads(archive.read("lab.json"))
        hidden = archive.read("tests/cache_size.py")
    assert {"setup.sh", "run_autograder", "lab.json", "tests/cache_size.py"} <= set(names)
    assert modes["setup.sh"] == modes["run_autograder"] == 0o755
    assert settings["lab"] == "cache_size" and settings["test_timeout"] == 60
    assert settings["total_timeout"] + settings["test_timeout"] < 600   # Gradescope's default limit
    assert hidden == (INSTRUCTOR / "graders" / "cache_size.py").read_bytes()
    for needed in ("kvlab-src/pyproject.toml", "kvlab-src/setup.py", "kvlab-src/kvlab_build.py",
                   "kvlab-src/csrc/kvlab.h",
                   "kvlab-src/kvlab/grading/judge.py", "kvlab-src/kvlab/assets/shakespeare-1m.bin",
                   # setup.py installs chapters/ as kvlab.chapters: pip needs it there
                   "kvlab-src/chapters/01_kv_cache.md"):
        assert needed in names
    for name in names:
        assert "solutions" not in name and "mistakes" not in name and "__pycache__" not in name
        assert not name.endswith((".so", ".o", ".pyc")), name
    # only the one lab's hidden tests travel
    assert [n for n in names if n.startswith("tests/")] == ["tests/cache_size.py"]


def test_the_package_grades_a_submission_in_a_folder_laid_out_like_autograder(package, tmp_path):
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "cache_size.py", root / "submission" / "cache_size.py")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert data["score"] == 16 == sum(t["max_score"] for t in data["tests"])
    assert all(t["status"] == "passed" for t in data["tests"])
    assert "hidden tests" in data["output"]


def test_a_missing_or_misnamed_submission(package, tmp_path):
    root = unpack(package, tmp_path / "autograder")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert data["score"] == 0 and "submit one file named cache_size.py" in data["output"]
    assert len(data["tests"]) == 10 and all(t["max_score"] > 0 for t in data["tests"])
    # one file under another name is taken; two are not
    (root / "submission" / "mine.py").write_text("x = 1\n")
    assert find_submission(root / "submission", "cache_size")[0].name == "mine.py"
    # what a Mac's zip adds is not a second file
    (root / "submission" / "__MACOSX").mkdir()
    (root / "submission" / "__MACOSX" / "._mine.py").write_text("\x00\x05")
    (root / "submission" / "._mine.py").write_text("\x00\x05")
    assert find_submission(root / "submission", "cache_size")[0].name == "mine.py"
    (root / "submission" / "other.py").write_text("y = 1\n")
    assert find_submission(root / "submission", "cache_size")[0] is None
    # a link is never taken, even under the lab's name: it could point at a root-only file
    (root / "submission" / "other.py").unlink()
    (root / "submission" / "cache_size.py").symlink_to(tmp_path / "elsewhere.py")
    (tmp_path / "elsewhere.py").write_text("z = 1\n")
    assert find_submission(root / "submission", "cache_size")[0].name == "mine.py"


def test_a_lab_whose_model_stays_in_the_judge_is_graded_in_its_package(tmp_path):
    """speculative_decoding serves its model from the judge's process (kvlab/grading/served.py):
    the zip's judge loads it, and its worker never loads kvlab."""
    package = build("speculative_decoding", tmp_path / "speculative_decoding.zip", INSTRUCTOR)
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
    assert [n for n in names if n.startswith("tests/")] == ["tests/speculative_decoding.py"]
    assert "kvlab-src/kvlab/grading/served.py" in names
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "speculative_decoding.py",
                root / "submission" / "speculative_decoding.py")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    full = LABS["speculative_decoding"].points
    assert data["score"] == full == sum(t["max_score"] for t in data["tests"]), data


@pytest.mark.parametrize("lab", ["cache_eviction", "weight_quantization"])
def test_a_lab_that_needs_a_named_model_fetches_it_in_setup_and_grades_with_it(lab, tmp_path,
                                                                              smollm2_path):
    """cache_eviction's curves and weight_quantization's searches on its layers run SmolLM2
    (Lab.models): the lab's setup.sh fetches it once, where the judge will read it, and no
    other lab's does; its zip grades the solution to full marks (here with the SmolLM2 this
    machine has: the fixture skips where it cannot be had)."""
    assert LABS[lab].models == ("smollm2-135m",)
    package = build(lab, tmp_path / f"{lab}.zip", INSTRUCTOR)
    with zipfile.ZipFile(package) as archive:
        setup = archive.read("setup.sh").decode()
    assert setup.rstrip().endswith("-m kvlab fetch smollm2-135m")
    with zipfile.ZipFile(build("cache_size", tmp_path / "cache_size.zip", INSTRUCTOR)) as archive:
        assert "kvlab fetch" not in archive.read("setup.sh").decode()
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / f"{lab}.py", root / "submission" / f"{lab}.py")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert data["score"] == LABS[lab].points == sum(t["max_score"] for t in data["tests"]), data


def test_a_lab_in_c_is_graded_in_its_package(tmp_path):
    """decode_kernel's file is C: the zip's kvlab carries the lab's header, harness and
    starter, the judge has it built by a worker (a compiler is on Gradescope's image:
    setup.sh installs build-essential) and loads it in each test's worker."""
    package = build("decode_kernel", tmp_path / "decode_kernel.zip", INSTRUCTOR)
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
    for needed in ("decode_kernel.h", "harness.py", "starter.c", "checks.py", "README.md"):
        assert f"kvlab-src/kvlab/labs/decode_kernel/{needed}" in names, needed
    assert "kvlab-src/kvlab/grading/cbuild.py" in names
    assert not any("decode_kernel_plain" in n or n.endswith(".edit") for n in names)
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "decode_kernel.c", root / "submission" / "mine.c")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert sum(t["max_score"] for t in data["tests"]) == LABS["decode_kernel"].points
    untimed = [t for t in data["tests"] if "bandwidth" not in t["name"]]
    assert len(untimed) == 9 and all(t["status"] == "passed" for t in untimed), data
    assert "(mine.c, graded" in data["output"]


def test_the_top_level_file_wins_over_an_old_copy_in_a_folder(package, tmp_path):
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "cache_size.py", root / "submission" / "cache_size.py")
    (root / "submission" / "backup").mkdir()
    shutil.copy(LABS["cache_size"].starter, root / "submission" / "backup" / "cache_size.py")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert data["score"] == 16 and "(cache_size.py, graded" in data["output"]


def full_marks_in_package(lab, top, env):
    """Lab `lab`'s package unpacked in top/lab, its reference solution graded there with
    `env`: full marks. Returns the package's root."""
    root = unpack(build(lab, top / f"{lab}.zip", INSTRUCTOR), top / lab)
    shutil.copy(INSTRUCTOR / "solutions" / f"{lab}.py", root / "submission" / f"{lab}.py")
    run = run_autograder(root, env)
    assert run.returncode == 0, run.stderr
    assert results(root)["score"] == LABS[lab].points, results(root)
    return root


@pytest.mark.skipif(not gradescope_setup.wanted(),
                    reason="runs setup.sh as Gradescope does: needs root and "
                           "KVLAB_TEST_GRADESCOPE_SETUP=1 (.ci/run sets both)")
def test_setup_sh_and_the_unprivileged_student_as_on_gradescope():
    # cache_size's package, its setup.sh started when this test was collected (its build
    # runs beside the gradings before this test: tests/support/gradescope_setup.py)
    setup = gradescope_setup.start()
    try:
        top, root, venv = setup.top, setup.root, setup.venv
        status, said = setup.wait(timeout=1200)
        assert status == 0, said
        env = {"KVLAB_VENV": str(venv)}                  # and the default user, kvlab-student
        shutil.copy(INSTRUCTOR / "solutions" / "cache_size.py", root / "submission" / "cache_size.py")
        run = run_autograder(root, env)
        assert run.returncode == 0, run.stderr
        assert results(root)["score"] == 16, results(root)
        # a lab whose model, served from the judge (root), logs every call of the worker's
        # code (kvlab-student), with the same installation
        other = unpack(build("own_cache", top / "own_cache.zip", INSTRUCTOR), top / "other")
        shutil.copy(INSTRUCTOR / "solutions" / "own_cache.py", other / "submission" / "own_cache.py")
        run = run_autograder(other, env)
        assert run.returncode == 0, run.stderr
        assert results(other)["score"] == 17, results(other)
        # a lab whose model stays in the judge (root), its worker kvlab-student
        full_marks_in_package("speculative_decoding", top, env)
        # the student's code runs as kvlab-student: the tests, the results and kvlab itself
        # are out of reach, even with the worker's import guard taken away
        kvlab_init = next(venv.glob("lib/python3*/site-packages/kvlab/__init__.py"))
        (root / "submission" / "cache_size.py").write_text(f'''
import shutil as _ue
import os

def kv_bytes_per_token(*args):
    seen = [str(os.getuid())]
    for path in ({str(root / "source" / "tests" / "cache_size.py")!r},
                 {str(root / "results" / "results.json")!r}, {str(kvlab_init)!r}):
        try:
            open(path, "a").close()
            seen.append("opened " + path)
        except OSError as error:
            seen.append(type(error).__name__)
    system = _ue.sys                                  # sys by another name
    _getattr = system.modules["buil" + "tins"].getattr
    _getattr(system, "meta_" + "path").pop(0)         # the worker's finder
    try:
        _getattr(system, "mod" + "ules")["importlib"].import_module("kvlab.quant")
        seen.append("imported kvlab")
    except ImportError as error:
        seen.append("ImportError")
    raise RuntimeError(" ".join(seen))
''')
        run = run_autograder(root, env)
        assert run.returncode == 0, run.stderr
        first = results(root)["tests"][0]["output"]
        import pwd
        uid = pwd.getpwnam(WORKER_USER).pw_uid
        assert f"RuntimeError: {uid} PermissionError PermissionError PermissionError ImportError" \
            in first, first
        # a kernel in C, as kvlab-student, cannot read kvlab's own library (to load it and
        # call kvlab's kernels) nor the hidden tests: it prints what fopen said
        library = next(venv.glob("lib/python3*/site-packages/kvlab/_kvlab*.so"))
        kernel = unpack(build("decode_kernel", top / "decode_kernel.zip", INSTRUCTOR), top / "kernel")
        (kernel / "submission" / "decode_kernel.c").write_text(f'''
#include "decode_kernel.h"
#include <errno.h>
#include <stdio.h>
void decode_attention(float *out, const float *q, const kv_cache_view *view, int n_heads,
                      int n_threads) {{
    const char *paths[] = {{"{library}", "{kernel / "source" / "tests" / "decode_kernel.py"}"}};
    for (int i = 0; i < 2; i++) {{
        FILE *f = fopen(paths[i], "rb");
        printf(f ? "opened " : "refused %d ", f ? 0 : errno);
    }}
    fflush(stdout);
    NOT_WRITTEN();
}}
''')
        run = run_autograder(kernel, env)
        assert run.returncode == 0, run.stderr
        first = results(kernel)["tests"][0]["output"]
        assert "refused 13 refused 13" in first, first
        # lab 15, whose worker may have one process and no thread as kvlab-student: the
        # reference solution still gets full marks (the plug-ins' CPU time on the clock)
        capstone = full_marks_in_package("serving_capstone", top, env)
        # its hidden tests hold the reference scheduler, and kvlab the bundled model's
        # weights (a drafter that runs them in NumPy): kvlab-student reads neither; nor can
        # it start a process (whose CPU time could escape the judge's meter) or a thread
        weights = next(venv.glob("lib/python3*/site-packages/kvlab/assets/shakespeare-1m.bin"))
        (capstone / "submission" / "serving_capstone.py").write_text(f'''
seen = []
for path in ({str(capstone / "source" / "tests" / "serving_capstone.py")!r}, {str(weights)!r}):
    try:
        open(path, "rb").close()
        seen.append("opened " + path)
    except OSError as error:
        seen.append(type(error).__name__)
import shutil as _ue
import threading
_os, _sys = _ue.os, _ue.sys                      # os by another name, past the source check
for start in (_os.fork, threading.Thread(target=print).start):
    try:
        if start() == 0:
            _os._exit(0)
        seen.append("started")
    except (OSError, RuntimeError) as error:
        seen.append(type(error).__name__)
raise RuntimeError(" ".join(seen))
''')
        run = run_autograder(capstone, env)
        assert run.returncode == 0, run.stderr
        said = results(capstone)["output"]
        assert "RuntimeError: PermissionError PermissionError BlockingIOError RuntimeError" \
            in said, said
    finally:
        gradescope_setup.remove()


def test_a_judge_that_fails_still_leaves_gradescope_a_results_json(package, tmp_path,
                                                                   monkeypatch):
    # a bug in the judge must not leave the submission as "the autograder failed" with no
    # results; it gives no points and says whose fault it is
    from kvlab.grading import autograder, judge, process
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "cache_size.py", root / "submission" / "cache_size.py")
    monkeypatch.setattr(process, "harden_judge", lambda: None)     # (this is the test process)

    def broken(self):
        raise RuntimeError("a bug of the judge's")
    monkeypatch.setattr(judge.Judge, "run", broken)
    report = autograder.run(root)
    data = results(root)
    assert report.score == data["score"] == 0 and len(data["tests"]) == 10
    # the student sees the kind of error, not its text (it may come from the hidden tests)
    assert "RuntimeError" in data["output"] and "kvlab's fault" in data["output"]
    assert "a bug of the judge's" not in json.dumps(data)
    assert all(t["score"] == 0 and t["max_score"] > 0 for t in data["tests"])
    # hidden tests that do not even load: still a results.json, one row worth the lab
    monkeypatch.undo()
    monkeypatch.setattr(process, "harden_judge", lambda: None)
    (root / "source" / "tests" / "cache_size.py").write_text("raise RuntimeError('secret 42')\n")
    autograder.run(root)
    data = results(root)
    assert data["score"] == 0 and [t["max_score"] for t in data["tests"]] == [16]
    assert "secret 42" not in json.dumps(data)


def test_an_instructor_with_a_plain_pip_install_builds_from_the_clone_root(tmp_path,
                                                                        monkeypatch):
    # pip install . (not -e) puts the package away from the clone: the instructor/ folder
    # of the directory kvlab runs in is the one, as the README's "from a clone" says
    from kvlab.grading import labs
    monkeypatch.setattr(labs, "LABS_DIR", tmp_path / "site-packages" / "kvlab" / "labs")
    monkeypatch.delenv("KVLAB_INSTRUCTOR", raising=False)
    monkeypatch.chdir(INSTRUCTOR.parent)
    assert labs.find_instructor(from_clone_here=True) == INSTRUCTOR.resolve()
    assert build("cache_size", tmp_path / "cache_size.zip").is_file()
    # never for grading, nor from a folder that is not a clone: a TA grading in a student's
    # folder must not take the "hidden tests" a student planted in instructor/graders/
    assert labs.find_instructor() is None
    planted = tmp_path / "student"
    (planted / "instructor" / "graders").mkdir(parents=True)
    monkeypatch.chdir(planted)
    assert labs.find_instructor() is None and labs.find_instructor(from_clone_here=True) is None


def test_the_serving_capstone_is_graded_in_its_package(tmp_path):
    """Lab 15's package grades the reference solution to full marks: its grader runs the
    engine, the virtual clock and the workload in the judge from the package's own kvlab
    (and reads chapter 5, the prompts' text, from the package's chapters)."""
    package = build("serving_capstone", tmp_path / "serving_capstone.zip", INSTRUCTOR)
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
    assert "tests/serving_capstone.py" in names
    assert not any("solutions" in n or "mistakes" in n or "cheats" in n for n in names)
    root = unpack(package, tmp_path / "autograder")
    shutil.copy(INSTRUCTOR / "solutions" / "serving_capstone.py",
                root / "submission" / "serving_capstone.py")
    run = run_autograder(root, {"KVLAB_PYTHON": sys.executable, "KVLAB_WORKER_USER": ""})
    assert run.returncode == 0, run.stderr
    data = results(root)
    assert data["score"] == LABS["serving_capstone"].points == sum(t["max_score"] for t in data["tests"])
