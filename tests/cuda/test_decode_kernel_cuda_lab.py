"""Lab 14 on a GPU (kvlab/labs/decode_kernel_cuda): everything a machine without a GPU can
check, and the grading itself where a GPU is present.

Without a GPU: the lab's files and registration (apart from LABS, so the tests that grade
every lab of LABS never meet it); the refusal, in words, of `kvlab grade`, `grade-all` and
the Gradescope package; the package's layout; the source check; that nvcc compiles the
starter, the solutions and every planted mistake and cheat (where nvcc is found); and, on
the CPU emulator (tests/cuda/emulator: the real kernel source, one fiber per GPU thread),
the grader's correctness tests run against both solutions, and each planted mistake failing
exactly its EXPECTED_FAILURES among them. With a GPU: the starter scores 0, the reference
full marks but for speed, each mistake and cheat loses what it must, as tests/test_grading.py
and test_grading_cheats.py check for the other labs.
"""
import ctypes
import importlib.util
import faulthandler
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kvlab._kvlab")
import kvlab._kvlab as core  # noqa: E402
from kvlab import cli  # noqa: E402
from kvlab.grading import autograder, cbuild, labs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "emulator"))
from c_edits import apply_edit, declared  # noqa: E402
from grader_tests import grader_tests  # noqa: E402

LAB = labs.get_lab("decode_kernel_cuda")
INSTRUCTOR = REPO / "instructor"
GRADER = INSTRUCTOR / "graders" / "decode_kernel_cuda.py"
SOLUTIONS = INSTRUCTOR / "solutions"
MISTAKES = sorted((INSTRUCTOR / "mistakes" / LAB.name).glob("*.cu-edit"))
CHEATS = sorted((INSTRUCTOR / "cheats" / LAB.name).glob("*.cu-edit"))
GPU_MISSING = labs.gpu_missing()
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None,
                               reason=f"lab 14 on a GPU needs an NVIDIA GPU and nvcc: {GPU_MISSING}")
needs_nvcc = pytest.mark.skipif(cbuild.find_nvcc() is None, reason="no nvcc found")
# machine code for one architecture kvlab builds for (setup.py): that nvcc compiles, not runs
COMPILE_ONLY_ARCH = ["-gencode=arch=compute_80,code=sm_80"]


def sources():
    """{name: CUDA source} of every file of the lab's that must compile."""
    found = {"starter": LAB.starter.read_text(),
             "solution": (SOLUTIONS / "decode_kernel_cuda.cu").read_text(),
             "plain solution": (SOLUTIONS / "decode_kernel_cuda_plain.cu").read_text()}
    for edit in MISTAKES + CHEATS:
        found[f"{edit.parent.parent.name}/{edit.stem}"] = apply_edit(edit, SOLUTIONS)
    return found


def may_also_fail(mistake: Path) -> set:
    """The tests a mistake declares it may fail or not, as the draw and the GPU fall
    (MAY_ALSO_FAIL: the GPU's own __expf, whose last bits only a GPU knows)."""
    from c_edits import parse
    return set(parse(mistake)[0].get("MAY_ALSO_FAIL", []))


def timed_names():
    return {t.__name__ for t in grader_tests(GRADER) if t.timed}


# ---- on any machine ----------------------------------------------------------------------

def test_the_lab_is_listed_apart_with_its_files():
    assert LAB.name not in labs.LABS and LAB.name in labs.GPU_LABS and LAB.requires_gpu
    assert LAB.suffix == ".cu" and LAB.starter.name == "starter.cu"
    for name in ("README.md", "checks.py", "harness.py", "harness.cu", "decode_kernel_cuda.cuh"):
        assert (LAB.folder / name).is_file(), name
    assert "NOT_WRITTEN()" in LAB.starter.read_text()
    assert MISTAKES and CHEATS and GRADER.is_file()
    # the C lab's every-lab tests glob *.edit: these must not be among them
    assert not list((INSTRUCTOR / "mistakes" / LAB.name).glob("*.edit"))


def test_the_points_and_what_the_mistakes_and_cheats_name():
    tests = {t.__name__ for t in grader_tests(GRADER)}
    assert sum(t.points for t in grader_tests(GRADER)) == LAB.points
    assert timed_names() and timed_names() < tests
    for mistake in MISTAKES:
        expected = declared(mistake, "EXPECTED_FAILURES")
        assert expected <= tests and timed_names() <= expected, mistake.name
        assert may_also_fail(mistake) <= tests - expected, mistake.name
    aimed = set().union(*(declared(cheat, "TARGETS") for cheat in CHEATS))
    assert aimed == tests, f"no cheat targets {sorted(tests - aimed)}"


def test_the_package_names_none_of_the_hidden_tests():
    """The grader stays in instructor/: no file of the installed package names one of its
    tests that the public checks do not also have."""
    import re
    import kvlab
    hidden = {t.__name__ for t in grader_tests(GRADER)} - {t.__name__ for t in grader_tests(LAB.checks)}
    for path in Path(kvlab.__file__).resolve().parent.rglob("*"):
        if path.suffix in (".py", ".cu", ".cuh", ".md"):
            leaked = hidden & set(re.findall(r"\w+", path.read_text()))
            assert not leaked, f"{path} names hidden tests {sorted(leaked)}"


def test_the_source_check_allows_the_labs_files_and_refuses_cudas_loaders():
    for name, source in sources().items():
        assert cbuild.check_cuda_source(source, "decode_kernel_cuda.cuh") == [], name
    for refused in ("#include <cuda.h>", "#include <nvrtc.h>", "#include <dlfcn.h>",
                    "void *f = (void *)cudaGetDriverEntryPoint;",
                    "int g(void) { return cudaLibraryLoadData(0, 0, 0, 0, 0, 0, 0, 0); }",
                    "void *h = (void *)dlopen;"):
        assert cbuild.check_cuda_source(refused + "\n", "decode_kernel_cuda.cuh"), refused
    # the C lab's check stays as it was: CUDA's header is not one of its own
    assert cbuild.check_c_source("#include <cuda_runtime.h>\n", "decode_kernel.h")


def test_lab_start_copies_the_cu_file_and_its_header(tmp_path, capsys):
    assert cli.main(["lab", "start", LAB.name, str(tmp_path)]) == 0
    assert (tmp_path / "decode_kernel_cuda.cu").read_text() == LAB.starter.read_text()
    assert (tmp_path / "decode_kernel_cuda.cuh").is_file()
    text = (tmp_path / "decode_kernel_cuda.md").read_text()
    assert "## What the grader refuses" in text and "`cuda_runtime.h`" in text
    assert "`cudaGetDriverEntryPoint`" in text
    assert cli.main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"{LAB.name}" in listed and "needs an NVIDIA GPU and nvcc" in listed


def test_the_build_command_pins_the_arithmetic():
    command = cbuild.cuda_build_command(Path("s.cu"), Path("s.so"), Path("inc"),
                                        COMPILE_ONLY_ARCH, fma=1) if cbuild.find_nvcc() else None
    if command is None:
        pytest.skip("no nvcc found")
    for flag in ("--fmad=false", "-ftz=false", "-prec-div=true", "-DKVLAB_FMA=1", "-shared"):
        assert flag in command
    assert command[-2:] == ["inc/harness.cu", "s.cu"]
    assert cbuild.gpu_arch_flags((9, 0), ["80", "90"]) == ["-gencode=arch=compute_90,code=sm_90"]
    # a GPU newer than this nvcc: the newest PTX it can run, compiled by the driver
    assert cbuild.gpu_arch_flags((12, 1), ["80", "90"]) == ["-gencode=arch=compute_90,code=compute_90"]
    with pytest.raises(RuntimeError, match="none of the architectures"):
        cbuild.gpu_arch_flags((7, 0), ["80", "90"])


@needs_nvcc
def test_every_file_of_the_lab_compiles_with_nvcc(tmp_path):
    """The starter, both solutions and every planted mistake and cheat, each built as the
    judge builds it but for one named architecture (nothing runs): the reference solution
    linked with the harness into a library, the others to object files."""
    include = tmp_path / "include"
    include.mkdir()
    for name in (*LAB.extra_files, *LAB.build_files):
        (include / name).write_bytes((LAB.folder / name).read_bytes())

    def build(item):
        index, (name, source) = item
        path = tmp_path / f"file{index}.cu"
        path.write_text(source)
        link = name == "solution"
        command = cbuild.cuda_build_command(path, path.with_suffix(".so" if link else ".o"),
                                            include, COMPILE_ONLY_ARCH, fma=1, link=link)
        run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        return name, run.returncode, run.stdout + run.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(build, enumerate(sources().items())))
    failed = {name: said[-2000:] for name, code, said in results if code != 0}
    assert not failed, failed
    # a build that disagrees about KVLAB_FMA's presence is refused, in words
    path = tmp_path / "bare.cu"
    path.write_text('#include "decode_kernel_cuda.cuh"\n')
    command = [c for c in cbuild.cuda_build_command(path, tmp_path / "bare.o", include,
                                                    COMPILE_ONLY_ARCH, fma=1, link=False)
               if not c.startswith("-DKVLAB_FMA")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "KVLAB_FMA" in run.stdout + run.stderr


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present: nothing is refused here")
def test_grading_without_a_gpu_is_refused_in_words(tmp_path, capsys):
    from kvlab.grading import check, grade
    from kvlab.grading.batch import grade_all
    said = "needs an NVIDIA GPU and nvcc"
    for attempt in (lambda: grade(LAB.name, LAB.starter), lambda: check(LAB.name, LAB.starter),
                    lambda: grade_all(LAB.name, tmp_path, tmp_path / "out",
                                      instructor=INSTRUCTOR)):
        with pytest.raises(labs.GpuRequired, match=said):
            attempt()
    assert cli.main(["grade", LAB.name, str(LAB.starter)]) == 2
    assert said in capsys.readouterr().err
    # the judge itself refuses too (its exit status, its words), should it be started by hand
    judge = subprocess.run([sys.executable, "-m", "kvlab.grading.judge", "--lab", LAB.name,
                            "--submission", str(LAB.starter), "--tests", str(GRADER), "--out",
                            str(tmp_path / "r.json")], capture_output=True, text=True,
                           cwd=tmp_path)    # the kvlab the tests import, not the source folder
    assert judge.returncode != 0 and said in judge.stderr


def test_the_gradescope_package_checks_for_the_gpu_before_it_builds_kvlab(tmp_path):
    out = autograder.build(LAB.name, tmp_path / "lab.zip", INSTRUCTOR)
    with zipfile.ZipFile(out) as archive:
        names = set(archive.namelist())
        setup = archive.read("setup.sh").decode()
        settings = json.loads(archive.read("lab.json"))
    assert settings["lab"] == LAB.name and f"tests/{LAB.name}.py" in names
    for name in ("starter.cu", "harness.cu", "harness.py", "decode_kernel_cuda.cuh", "checks.py"):
        assert f"kvlab-src/kvlab/labs/{LAB.name}/{name}" in names, name
    assert not any("instructor" in n or "solutions" in n for n in names)
    check, install = setup.index("needs an NVIDIA GPU and nvcc"), setup.index("pip\" install \"$SOURCE")
    assert check < install and "KVLAB_CUDA=1" in setup[check:install]
    # the check, run where nvidia-smi is missing, stops setup.sh with its words
    snippet = autograder.GPU_CHECK.format(lab=LAB.name)
    run = subprocess.run([shutil.which("bash"), "-c", "set -euo pipefail\n" + snippet + "echo built"],
                         capture_output=True, text=True, env={"PATH": str(tmp_path / "empty")})
    assert run.returncode == 1 and "needs an NVIDIA GPU and nvcc" in run.stderr
    assert "built" not in run.stdout
    # a CPU lab's setup.sh has no such check
    assert "NVIDIA" not in autograder._setup_script(labs.get_lab("decode_kernel"))


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present: nothing is refused here")
def test_the_autograder_without_a_gpu_writes_a_zero_that_says_why(tmp_path):
    root = tmp_path / "autograder"
    (root / "source" / "tests").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "lab.json").write_text(json.dumps({"lab": LAB.name}))
    (root / "source" / "tests" / f"{LAB.name}.py").write_bytes(GRADER.read_bytes())
    (root / "submission" / f"{LAB.name}.cu").write_bytes((SOLUTIONS / "decode_kernel_cuda.cu").read_bytes())
    run = subprocess.run([sys.executable, "-m", "kvlab.grading.autograder", "run", "--root",
                          str(root)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)      # (CI installs kvlab: its source folder has no .so)
    assert run.returncode == 0, run.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and "needs an NVIDIA GPU and nvcc" in results["output"]
    assert sum(t["max_score"] for t in results["tests"]) == LAB.points


# ---- on the CPU emulator ----------------------------------------------------------------

def emulated(source: str, folder: Path, name: str):
    """The lab's harness.py bound to `source` and harness.cu built for the CPU emulator
    (tests/cuda/emulator/cuda_runtime.h), with this kvlab's KVLAB_FMA."""
    from build import translate
    cpp = folder / f"{name}.cpp"
    cpp.write_text(translate((LAB.folder / "harness.cu").read_text()) + "\n" + translate(source))
    library = folder / f"{name}.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-w",
                    f"-I{REPO / 'tests' / 'cuda' / 'emulator'}", f"-I{LAB.folder}",
                    f"-DKVLAB_FMA={core.FUSED_MULTIPLY_ADD}", "-include", "cuda_runtime.h",
                    "-o", str(library), str(cpp)], check=True, timeout=300)
    spec = importlib.util.spec_from_file_location(f"harness_{name}", LAB.folder / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    harness.bind(ctypes.CDLL(str(library)))
    return harness


def correctness_tests(path: Path = GRADER):
    """A test file's untimed tests, as functions (loaded as the judge loads them)."""
    from kvlab.grading.judge import load_tests
    return [t for t in load_tests(path) if not getattr(t, "timed", False)]


def _run_one(test, harness, seed, index):
    """A child's whole life: exit status 0 when the test passes, 1 when it fails."""
    faulthandler.disable()   # a mistake that faults is a failure, not a trace in the log
    try:
        test(harness, np.random.default_rng([seed, index]))
    except (AssertionError, RuntimeError):
        os._exit(1)
    os._exit(0)


def failing(harness, seed: int, path: Path = GRADER) -> set:
    """The grader's correctness tests the emulated kernel fails, each with its own draw, in
    a child process of its own: a kernel that reads past its rows faults on the GPU (a CUDA
    error, and the test is lost), and on the emulator, whose device memory is the host's, it
    may take the process down (a crash is a failure too)."""
    context = multiprocessing.get_context("fork")
    failed = set()
    for index, test in enumerate(correctness_tests(path)):
        child = context.Process(target=_run_one, args=(test, harness, seed, index))
        child.start()
        child.join(300)
        if child.is_alive():
            child.kill()
            child.join()
        if child.exitcode != 0:
            failed.add(test.__name__)
    return failed


emulator = pytest.mark.skipif(sys.platform != "linux", reason="the emulator's fibers are Linux's")


@emulator
@pytest.mark.parametrize("solution", ["decode_kernel_cuda.cu", "decode_kernel_cuda_plain.cu"])
def test_on_the_emulator_the_solutions_pass_every_correctness_test(solution, tmp_path):
    harness = emulated((SOLUTIONS / solution).read_text(), tmp_path, Path(solution).stem)
    assert failing(harness, seed=1) == set()
    assert failing(harness, seed=1, path=LAB.checks) == set()     # and the public checks


@emulator
@pytest.mark.parametrize("mistake", MISTAKES, ids=[p.stem for p in MISTAKES])
def test_on_the_emulator_a_planted_mistake_fails_what_it_says(mistake, tmp_path):
    harness = emulated(apply_edit(mistake, SOLUTIONS), tmp_path, mistake.stem)
    expected = declared(mistake, "EXPECTED_FAILURES") - timed_names()
    failed = failing(harness, seed=zlib.crc32(mistake.stem.encode()))
    assert expected <= failed <= expected | may_also_fail(mistake), failed


@emulator
def test_on_the_emulator_the_starter_says_it_is_not_written(tmp_path):
    harness = emulated(LAB.starter.read_text(), tmp_path, "starter")
    from kvlab.grading.kernel_cases import make_case
    case = make_case(np.random.default_rng(0), 1, 1, 8, 5, 16)
    with pytest.raises(NotImplementedError):
        harness.decode_attention(*case.arguments())


@emulator
def test_on_the_emulator_the_timing_checks_drawn_outputs_and_catches_skipped_calls(tmp_path):
    """gpu_kernel_cases.measure_share on a small pool (the probe a made-up number): the
    chain runs in the harness, outputs are drawn and checked; the cheat that hands back the
    last output for three calls in four is caught by them."""
    from kvlab.grading import gpu_kernel_cases
    from kvlab.grading.kernel_cases import make_case
    honest = emulated((SOLUTIONS / "decode_kernel_cuda.cu").read_text(), tmp_path, "honest")
    cheat = emulated(apply_edit(INSTRUCTOR / "cheats" / LAB.name / "skips_repeated_calls.cu-edit",
                                SOLUTIONS), tmp_path, "skips")
    for harness, caught in ((honest, False), (cheat, True)):
        rng = np.random.default_rng(5)
        case = make_case(rng, 2, 2, 32, 100, 16, spare_blocks=4)
        pool = harness.Pool(*case.key_codes.shape, case.group)
        for name in harness.ARRAYS:
            pool.put(name, 0, getattr(case, name))
        measure = lambda: gpu_kernel_cases.measure_share(pool, case, rng, 1e9, rounds=3,   # noqa: E731
                                                         chain_seconds=0.05, renew=8)
        if caught:
            with pytest.raises(AssertionError, match="timed call"):
                measure()
        else:
            share = measure()
            assert share.share > 0 and "of the GPU's copy bandwidth" in share.describe()


# ---- on a GPU ----------------------------------------------------------------------------

def graded(submission: Path, seed: int = 1, public: bool = False):
    from kvlab.grading import check, grade
    if public:
        return check(LAB.name, submission)
    return grade(LAB.name, submission, tests=GRADER, seed=seed)


def speed_only(report) -> bool:
    """Every test passed, or (a timed one) failed only for the share it measured."""
    return all(t.passed or (t.function in timed_names() and "reached" in t.output)
               for t in report.tests)


@needs_gpu
def test_on_a_gpu_the_starter_scores_zero_and_the_solution_full_marks():
    starter = graded(LAB.starter)
    assert starter.score == 0 and all("not written yet" in t.output for t in starter.tests), \
        starter.summary()
    report = graded(SOLUTIONS / "decode_kernel_cuda.cu")
    assert report.max_score == LAB.points and speed_only(report), report.summary()
    public = graded(SOLUTIONS / "decode_kernel_cuda.cu", public=True)
    assert public.graded_with == "public checks" and all(
        t.passed or "reached" in t.output for t in public.tests), public.summary()


@needs_gpu
@pytest.mark.parametrize("mistake", MISTAKES, ids=[p.stem for p in MISTAKES])
def test_on_a_gpu_a_planted_mistake_loses_the_right_points(mistake, tmp_path):
    submission = tmp_path / f"{LAB.name}.cu"
    submission.write_text(apply_edit(mistake, SOLUTIONS))
    report = graded(submission, seed=zlib.crc32(mistake.stem.encode()))
    expected = declared(mistake, "EXPECTED_FAILURES")
    assert expected <= set(report.failed()) <= expected | may_also_fail(mistake), report.summary()


@needs_gpu
@pytest.mark.parametrize("cheat", CHEATS, ids=[p.stem for p in CHEATS])
def test_on_a_gpu_a_cheat_earns_nothing_on_the_tests_whose_work_it_skips(cheat, tmp_path):
    submission = tmp_path / f"{LAB.name}.cu"
    submission.write_text(apply_edit(cheat, SOLUTIONS))
    report = graded(submission, seed=zlib.crc32(cheat.stem.encode()))
    aimed = declared(cheat, "TARGETS")
    assert not report.refused, report.summary()
    earned = {t.function: t.score for t in report.tests if t.function in aimed and t.score > 0}
    assert not earned, f"{cheat.name} earned {earned}\n{report.summary()}"
    assert report.score > 0, report.summary()
