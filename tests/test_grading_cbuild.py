"""The C lab's build against a compiler that gets int8 sums wrong (kvlab/grading/cbuild.py's
int8_guard): the probe runs with the grader's own compiler and flags, a failing probe puts
VNNI_OFF into the student's build and a note into the log the student sees, and a student's
int8 loop built by the grader's command is right on this machine, whatever its compiler.

The failing probe is injected twice: in this process (int8_probe replaced) for the flags
and the note, and through $CC in a whole grading (a compiler that gets the probe wrong
unless VNNI is off), where the judge runs in a process of its own.
"""
import ctypes
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kvlab._kvlab")
from kvlab.grading import cbuild  # noqa: E402

LAB = Path(cbuild.__file__).resolve().parents[1] / "labs" / "decode_kernel"


@pytest.fixture
def fresh_guard():
    """int8_guard's cache emptied before and after, so that no verdict leaks between tests."""
    cbuild.int8_guard.cache_clear()
    yield
    cbuild.int8_guard.cache_clear()


def test_the_probe_runs_with_the_grader_compiler_and_the_build_follows_it(fresh_guard):
    cc, flags = cbuild.compiler(), tuple(cbuild.kit_flags())
    verdict = cbuild.int8_probe(cc, flags)
    assert verdict is not None, "the int8 probe could not be built or run with kvlab's own flags"
    assert cbuild.int8_probe(cc, ("-O0",)) is True          # unoptimized, every sum is right
    command = cbuild.build_command(Path("k.c"), Path("k.so"), LAB)
    guarded = all(f in command for f in cbuild.VNNI_OFF)
    assert guarded == (verdict is False)
    assert bool(cbuild.build_note()) == guarded
    version = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True).stdout
    if version.strip() == "12.2.0" and "-mavx512vnni" in flags and "clang" not in cc:
        # the miscompile this guard is for (kvlab runs its avx512 variant, so the CPU has VNNI)
        assert verdict is False and cbuild.int8_probe(cc, flags + cbuild.VNNI_OFF) is True


def test_a_failing_probe_turns_vnni_off_in_the_build_and_says_so(fresh_guard, monkeypatch):
    monkeypatch.setattr(cbuild, "int8_probe", lambda cc, flags: set(cbuild.VNNI_OFF) <= set(flags))
    command = cbuild.build_command(Path("k.c"), Path("k.so"), LAB)
    flags = cbuild.kit_flags()
    assert command[1:1 + len(flags)] == flags                # the kit's flags, then the guard
    assert command[1 + len(flags):1 + len(flags) + 2] == list(cbuild.VNNI_OFF)
    assert "-mno-avx512vnni -mno-avxvnni added" in cbuild.build_note()
    # wrong even without VNNI: nothing to add, and the log warns
    cbuild.int8_guard.cache_clear()
    monkeypatch.setattr(cbuild, "int8_probe", lambda cc, flags: False)
    assert not set(cbuild.VNNI_OFF) & set(cbuild.build_command(Path("k.c"), Path("k.so"), LAB))
    assert cbuild.build_note().startswith("warning:")
    # right, or not known: the kit's flags as they are, nothing said
    for verdict in (True, None):
        cbuild.int8_guard.cache_clear()
        monkeypatch.setattr(cbuild, "int8_probe", lambda cc, flags, v=verdict: v)
        command, flags = cbuild.build_command(Path("k.c"), Path("k.so"), LAB), cbuild.kit_flags()
        assert command[1:1 + len(flags)] == flags
        assert command[1 + len(flags)].startswith("-DKVLAB_FMA")
        assert cbuild.build_note() == ""


# A student's int8 sums as GCC 12.2 -O3 -mavx512vnni gets them wrong: bytes read as int8,
# and Q4 codes less 8, each times an int8.
STUDENT_SUMS = r"""
#include <stdint.h>
int32_t int8_sum(const uint8_t *w, const int8_t *x, int n) {
    int32_t total = 0;
    for (int i = 0; i < n; i++) total += (int8_t)w[i] * x[i];
    return total;
}
int32_t q4_sum(const uint8_t *w, const int8_t *x, int n) {
    int32_t total = 0;
    for (int i = 0; i < n; i++) total += ((w[i] & 15) - 8) * x[i];
    return total;
}
"""


def test_a_students_int8_sums_built_as_the_grader_builds_them_are_right(fresh_guard, tmp_path):
    source, library = tmp_path / "sums.c", tmp_path / "sums.so"
    source.write_text(STUDENT_SUMS)
    subprocess.run(cbuild.build_command(source, library, LAB), check=True, capture_output=True)
    sums = ctypes.CDLL(str(library))
    rng = np.random.default_rng(14)
    for n in (32, 37, 64, 256):
        w = rng.integers(0, 256, n, dtype=np.uint8)
        x = rng.integers(-127, 128, n, dtype=np.int8)
        wants = {"int8_sum": int(np.dot(w.view(np.int8).astype(np.int64), x)),
                 "q4_sum": int(np.dot((w & 15).astype(np.int64) - 8, x))}
        for name, want in wants.items():
            function = getattr(sums, name)
            function.restype = ctypes.c_int32
            got = function(w.ctypes.data_as(ctypes.c_void_p), x.ctypes.data_as(ctypes.c_void_p), n)
            assert got == want, (name, n, got, want)


def test_a_grading_with_a_compiler_failing_the_probe_builds_guarded_and_tells_the_student(
        fresh_guard, tmp_path, monkeypatch):
    """A wrapper around the real compiler that builds the probe into a program that says
    "wrong" unless VNNI is off, and logs every command it is given."""
    from kvlab.grading import grade
    real, log = cbuild.compiler(), tmp_path / "commands"
    wrong = tmp_path / "wrong.c"
    wrong.write_text(f"int main(void) {{ return {cbuild.PROBE_WRONG}; }}\n")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f"""#!/bin/bash
echo "$*" >> {log}
args=()
for a in "$@"; do
    if [[ $a == */int8_probe.c && " $* " != *" -mno-avx512vnni "* ]]; then a={wrong}; fi
    args+=("$a")
done
exec {real} "${{args[@]}}"
""")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    tests = tmp_path / "c_tests.py"
    tests.write_text('from kvlab.grading.testkit import points\n\n\n@points(1)\n'
                     'def test_it_loads(sub, rng):\n    """the library loads"""\n')
    submission = tmp_path / "decode_kernel.c"
    submission.write_text((LAB / "starter.c").read_text())
    report = grade("decode_kernel", submission, tests=tests, seed=1)
    assert report.score == 1, report.summary()
    assert "-mno-avx512vnni -mno-avxvnni added" in report.output, report.summary()
    built = [line for line in log.read_text().splitlines() if line.endswith("decode_kernel.c -lm")]
    assert len(built) == 1 and " -mno-avx512vnni -mno-avxvnni " in built[0], built
