"""The build itself (issue 38): kvlab_build.py, the flags and kernel variants setup.py
chooses and the record of what built each extension.

A build with another compiler, other flags or other KVLAB_* options once reused build/'s old
.so (a KVLAB_PORTABLE=1 wheel shipped -march=native code); here a tiny extension is built
twice in one folder with different options and must come out different, and the flag
choice is checked on platforms this machine is not (macOS with and without Homebrew's
libomp), and the kernel variants' flags are checked against what csrc/dispatch.c asks the
CPU for and what tests/c/Makefile compiles. kvlab's own extension is rebuilt with other
options by .ci/lanes, which takes a minute; these take seconds. Not here: whether the flags
give the right bits (tests/test_bits.py, each variant in turn) or a working wheel on another
system (.ci/lanes runs one under emulated older CPUs; CI's cibuildwheel).
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_kvlab_build():
    spec = importlib.util.spec_from_file_location("kvlab_build", REPO / "kvlab_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kvlab_build = load_kvlab_build()

# ---- the record --------------------------------------------------------------------------


def record_for(env, compile_args=("-O3",)):
    flags = kvlab_build.Flags(list(compile_args), [])
    return kvlab_build.build_record(["cc"], ["cc", "-shared"], flags, env=env)


def test_the_record_names_every_option_that_changes_a_build():
    """Two builds that differ in any compiler variable or KVLAB_* build option have
    different records; variables that no build reads (kvlab's run-time ones included) do
    not enter it, so setting KVLAB_NUM_THREADS does not recompile kvlab."""
    base = record_for({"PATH": "/bin", "HOME": "/root", "KVLAB_NUM_THREADS": "2",
                       "KVLAB_KERNELS": "plain", "KVLAB_CACHE": "/tmp"})
    assert base["environment"] == {}
    for name, value in [("CC", "clang"), ("CFLAGS", "-O0"), ("KVLAB_PORTABLE", "1"),
                        ("KVLAB_NATIVE", "1"),
                        ("KVLAB_NO_OPENMP", "1"), ("KVLAB_CUDA", "1"),
                        ("KVLAB_CUDA_ARCH", "86")]:
        assert record_for({name: value}) != base, name


def test_every_kvlab_option_the_build_reads_is_recorded():
    """Each KVLAB_ name setup.py or kvlab_build.py spells is in BUILD_VARIABLES, so a new
    build option cannot be forgotten there (and its change not rebuild)."""
    spelled = set()
    for source in ("setup.py", "kvlab_build.py"):
        spelled |= set(re.findall(r"KVLAB_[A-Z][A-Z_]*", (REPO / source).read_text()))
    assert spelled and spelled <= set(kvlab_build.BUILD_VARIABLES), \
        spelled - set(kvlab_build.BUILD_VARIABLES)
    assert record_for({}, ["-O3", "-march=native"]) != record_for({}, ["-O3"])
    several = kvlab_build.Flags(["-O3"], [], variants=list(kvlab_build.VARIANTS))
    assert (kvlab_build.build_record(["cc"], ["cc"], several, env={})
            != record_for({}, ["-O3"])), "the variants compiled are part of the record"
    assert kvlab_build.describe(record_for({"KVLAB_PORTABLE": "1"})).endswith("KVLAB_PORTABLE=1")


def test_an_extension_is_current_only_when_built_as_recorded(tmp_path):
    records = kvlab_build.BuildRecords(tmp_path / "temp")
    target = tmp_path / "lib" / "ext.so"
    first, second = record_for({}), record_for({"KVLAB_PORTABLE": "1"})
    assert not records.matches(target, first)          # never built
    target.parent.mkdir()
    target.write_bytes(b"")
    records.write(target, first)
    assert records.matches(target, first) and not records.matches(target, second)
    other = tmp_path / "inplace" / "ext.so"            # another output has its own record
    assert not records.matches(other, first)
    target.unlink()                                    # the output is gone: build again
    assert not records.matches(target, first)


def test_a_describe_line_is_a_plain_c_string():
    record = record_for({"CFLAGS": '-DX="a\\b"'})
    line = kvlab_build.describe(record)
    assert '"' not in line and "\\" not in line and "CFLAGS=-DX=ab" in line


# ---- two builds in one folder --------------------------------------------------------------

TINY_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_tiny(void) {
    PyObject *m = PyModule_Create(&tiny);
    if (m == NULL) return NULL;
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "OPENMP", 1);
#else
    PyModule_AddIntConstant(m, "OPENMP", 0);
#endif
    PyModule_AddStringConstant(m, "BUILD", KV_BUILD);
    return m;
}
"""

TINY_SETUP = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import kvlab_build
from setuptools import Extension, setup
setup(name="tiny", ext_modules=[Extension("tiny", ["tiny.c"])],
      cmdclass={{"build_ext": kvlab_build.BuildExt}})
"""


def build_tiny(folder, **options):
    """Builds the tiny extension in place with these KVLAB_* options (and no others), and
    returns (its BUILD, its OPENMP, its bytes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")}
    env.update(options)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=folder,
                   env=env, check=True, capture_output=True, timeout=300)
    [built] = Path(folder).glob("tiny*.so") if sys.platform != "win32" else Path(folder).glob("tiny*.pyd")
    probe = subprocess.run([sys.executable, "-c", "import json, tiny; "
                            "print(json.dumps([tiny.BUILD, tiny.OPENMP]))"],
                           cwd=folder, env=env, check=True, capture_output=True, text=True)
    build, openmp = json.loads(probe.stdout)
    return build, openmp, built.read_bytes()


def test_two_builds_with_different_options_differ(tmp_path):
    """The bug of issue 38: an unchanged source tree built again with KVLAB_NO_OPENMP=1
    kept the OpenMP build. Now the second build is compiled as asked, and a third with the
    first build's options is the first build again."""
    (tmp_path / "tiny.c").write_text(TINY_C)
    (tmp_path / "setup.py").write_text(TINY_SETUP)
    first = build_tiny(tmp_path)
    second = build_tiny(tmp_path, KVLAB_NO_OPENMP="1")
    assert second[0] != first[0] and second[0].endswith("KVLAB_NO_OPENMP=1")
    assert second[1] == 0
    assert first[1] == ("-fopenmp" in first[0].split("; ")[1].split())
    assert second[2] != first[2]
    third = build_tiny(tmp_path)
    assert third[:2] == first[:2]


# ---- the flag choice on other platforms --------------------------------------------------


def accepting(*accepted):
    """A fake compiler probe that takes exactly these flag lists."""
    def accepts(flags):
        return list(flags) in [list(a) for a in accepted]
    return accepts


def no_libomp():
    return None


def test_every_compiler_gets_ffp_contract_off():
    """clang fuses multiply-adds by default and gcc only leaves them in ISO C mode; the
    flag is given to every compiler, whatever it accepts otherwise."""
    for accepts in (accepting(), accepting(["-march=native"], ["-fopenmp"])):
        for platform in ("linux", "darwin", "win32"):
            flags = kvlab_build.choose_flags(accepts, env={}, platform=platform,
                                             libomp=no_libomp)
            assert "-ffp-contract=off" in flags.compile


def test_linux_with_openmp_and_native_tuning_when_asked():
    """-march=native only with KVLAB_NATIVE=1 (issue 38): the default build runs anywhere."""
    flags = kvlab_build.choose_flags(accepting(["-march=native"], ["-fopenmp"]),
                                     env={"KVLAB_NATIVE": "1"}, platform="linux",
                                     libomp=no_libomp)
    assert "-march=native" in flags.compile and "-fopenmp" in flags.compile
    assert flags.link == ["-fopenmp"] and flags.notices == []
    default = kvlab_build.choose_flags(accepting(["-march=native"], ["-fopenmp"]), env={},
                                       platform="linux", libomp=no_libomp)
    assert not any(f.startswith("-march") for f in default.compile)


@pytest.mark.parametrize("env", [{"KVLAB_NATIVE": "1", "KVLAB_NO_OPENMP": "1"},
                                 {"KVLAB_NO_OPENMP": "1"}])
def test_the_options_turn_tuning_and_openmp_off(env):
    flags = kvlab_build.choose_flags(accepting(["-march=native"], ["-fopenmp"]), env=env,
                                     platform="linux", libomp=no_libomp)
    assert ("-march=native" in flags.compile) == ("KVLAB_NATIVE" in env)
    assert ("-fopenmp" in flags.compile) == ("KVLAB_NO_OPENMP" not in env)
    assert flags.notices == []          # asked for: nothing to tell


def test_an_option_set_to_0_is_off():
    flags = kvlab_build.choose_flags(accepting(["-march=native"], ["-fopenmp"]),
                                     env={"KVLAB_NATIVE": "0", "KVLAB_NO_OPENMP": "0"},
                                     platform="linux", libomp=no_libomp)
    assert "-march=native" not in flags.compile and "-fopenmp" in flags.compile


def test_macos_uses_homebrews_libomp_when_apple_clang_refuses_fopenmp():
    prefix = "/opt/homebrew/opt/libomp"
    expected_compile = ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"]
    expected_link = [f"-L{prefix}/lib", "-lomp"]
    flags = kvlab_build.choose_flags(accepting(expected_compile + expected_link), env={},
                                     platform="darwin", libomp=lambda: prefix)
    assert flags.compile[-3:] == expected_compile and flags.link == expected_link
    assert flags.notices == []


def test_macos_without_libomp_builds_single_threaded_with_one_notice():
    asked = []
    flags = kvlab_build.choose_flags(accepting(), env={}, platform="darwin",
                                     libomp=lambda: asked.append(1))
    assert asked == [1]
    assert not any("openmp" in f.lower() or f == "-lomp" for f in flags.compile + flags.link)
    [notice] = flags.notices
    assert "\n" not in notice and "brew install libomp" in notice


def test_macos_with_a_compiler_that_has_openmp_needs_no_libomp():
    """Homebrew's gcc or LLVM clang (CC=...) take -fopenmp themselves."""
    flags = kvlab_build.choose_flags(accepting(["-fopenmp"]), env={}, platform="darwin",
                                     libomp=lambda: pytest.fail("libomp looked for"))
    assert "-fopenmp" in flags.compile and flags.link == ["-fopenmp"]


def test_macos_libomp_that_does_not_link_is_not_used():
    flags = kvlab_build.choose_flags(accepting(), env={}, platform="darwin",
                                     libomp=lambda: "/usr/local/opt/libomp")
    assert "-lomp" not in flags.link and len(flags.notices) == 1


def test_no_openmp_asked_for_looks_for_no_libomp():
    flags = kvlab_build.choose_flags(accepting(), env={"KVLAB_NO_OPENMP": "1"},
                                     platform="darwin",
                                     libomp=lambda: pytest.fail("libomp looked for"))
    assert flags.notices == []


def test_homebrew_libomp_is_found_in_its_usual_places(tmp_path, monkeypatch):
    """find_libomp asks brew first, then tries the usual prefixes; a prefix without omp.h
    does not count."""
    fake = tmp_path / "libomp"
    (fake / "include").mkdir(parents=True)
    monkeypatch.setattr(kvlab_build, "HOMEBREW_LIBOMP", (str(tmp_path / "none"), str(fake)))
    monkeypatch.setattr(kvlab_build.shutil, "which", lambda name: None)
    assert kvlab_build.find_libomp() is None
    (fake / "include" / "omp.h").write_text("")
    assert kvlab_build.find_libomp() == str(fake)


# ---- the kernel variants -----------------------------------------------------------------


ARCHITECTURE_PROGRAMS = {"x86_64": kvlab_build.X86_64_PROGRAM,
                         "aarch64": kvlab_build.AARCH64_PROGRAM}


def compiling(target="x86_64", lacking=()):
    """A fake compiler for choose_variants: one for the target CPU ("x86_64", "aarch64", or
    None: another) that builds every variant program except with the flags named in
    `lacking`."""
    def compiles(program, flags):
        if program in ARCHITECTURE_PROGRAMS.values():
            return program == ARCHITECTURE_PROGRAMS.get(target)
        return not set(flags) & set(lacking)
    return compiles


def names(variants):
    return [v.name for v in variants]


def test_an_x86_64_build_has_three_variants_best_first():
    variants = kvlab_build.choose_variants(compiling(), env={})
    assert names(variants) == ["avx512", "avx2", "baseline"]
    assert variants[-1].flags == ()                       # the compiler's default target
    assert set(variants[1].flags) < set(variants[0].flags)  # AVX-512's CPUs have AVX2 too


def test_a_variant_the_compiler_cannot_build_is_left_out():
    assert names(kvlab_build.choose_variants(compiling(lacking=["-mavx512vnni"]), env={})) \
        == ["avx2", "baseline"]
    assert kvlab_build.choose_variants(compiling(lacking=["-mavx2"]), env={}) == []


def test_a_tuning_the_compiler_does_not_know_is_left_out_not_its_variant():
    tuned = kvlab_build.choose_variants(compiling(), env={})
    assert tuned[0].tuning == ("-mtune=icelake-server",)
    untuned = kvlab_build.choose_variants(compiling(lacking=["-mtune=icelake-server"]), env={})
    assert names(untuned) == names(tuned) and untuned[0].tuning == ()


@pytest.mark.parametrize("env", [{"KVLAB_NATIVE": "1"}, {"KVLAB_PORTABLE": "1"}])
def test_native_and_portable_builds_have_one_variant(env):
    assert kvlab_build.choose_variants(compiling(), env=env) == []
    flags = kvlab_build.choose_flags(accepting(["-march=native"]), env=env, platform="linux",
                                     libomp=no_libomp, compiles=compiling())
    assert flags.variants == []


def test_a_compiler_for_another_cpu_has_one_variant():
    """A CPU other than x86-64 and aarch64, and a macOS universal2 build (arm64 and x86_64
    in one compiler call, which neither architecture's program builds), compile the kernels
    once, for the compiler's default target."""
    assert kvlab_build.choose_variants(compiling(target=None), env={}) == []


def test_an_aarch64_build_has_a_dotprod_variant_and_the_baseline():
    variants = kvlab_build.choose_variants(compiling(target="aarch64"), env={})
    assert names(variants) == ["dotprod", "baseline"]
    assert variants[0].flags == ("-march=armv8.2-a+dotprod",) and variants[-1].flags == ()
    # the probes are each variant's own, not x86-64's
    assert "vdotq_s32" in kvlab_build.variant_program(variants[0])
    assert "immintrin" not in kvlab_build.variant_program(variants[-1])


def test_an_aarch64_compiler_without_dotprod_builds_one_variant():
    lacking = compiling(target="aarch64", lacking=["-march=armv8.2-a+dotprod"])
    assert kvlab_build.choose_variants(lacking, env={}) == []
    for env in ({"KVLAB_NATIVE": "1"}, {"KVLAB_PORTABLE": "1"}):
        assert kvlab_build.choose_variants(compiling(target="aarch64"), env=env) == []


def test_the_aarch64_probes_build_with_a_cross_compiler():
    """The ARM probes are real C: an aarch64 gcc (Debian's gcc-aarch64-linux-gnu, which
    .ci/lanes' aarch64 lane installs) builds both, and an x86-64 compiler neither."""
    cross = ["aarch64-linux-gnu-gcc"]
    if shutil.which(cross[0]) is None:
        pytest.skip("no aarch64-linux-gnu-gcc here")
    compiles = (lambda program, flags: kvlab_build.compiler_accepts(cross, flags, program))
    assert names(kvlab_build.choose_variants(compiles, env={})) == ["dotprod", "baseline"]
    assert not compiles(kvlab_build.X86_64_PROGRAM, [])


def test_native_and_portable_together_are_refused():
    with pytest.raises(SystemExit, match="KVLAB_NATIVE=1.*KVLAB_PORTABLE=1"):
        kvlab_build.choose_flags(accepting(["-march=native"]),
                                 env={"KVLAB_NATIVE": "1", "KVLAB_PORTABLE": "1"},
                                 platform="linux", libomp=no_libomp)


def test_the_variant_probe_builds_with_this_compiler():
    """The probes are real C: gcc (CI's) builds each variant's, so no variant is left out
    here by a typo in a probe."""
    compiles = (lambda program, flags: kvlab_build.compiler_accepts(["cc"], flags, program))
    if not compiles(kvlab_build.X86_64_PROGRAM, []):
        pytest.skip("not an x86-64 compiler")
    assert names(kvlab_build.choose_variants(compiles, env={})) == ["avx512", "avx2", "baseline"]


def checked_features(source, name):
    """The CPU features dispatch.c's cpu_has_<name>() asks for, following its calls to the
    other cpu_has_ functions (cpu_has_f16c asks cpuid for F16C's bit)."""
    body = re.search(r"static int cpu_has_%s\(void\) \{(.*?)\n\}" % name, source, re.S).group(1)
    features = set(re.findall(r'__builtin_cpu_supports\("([\w.]+)"\)', body))
    if "bit_F16C" in body:
        features.add("f16c")
    for other in re.findall(r"cpu_has_(\w+)\(\)", body):
        features |= checked_features(source, other)
    return features


def test_dispatch_checks_every_feature_a_variant_is_compiled_for():
    """A variant compiled with -mX runs only where dispatch.c has asked the CPU for X, else
    an older CPU dies of an illegal instruction; F16C is asked of cpuid itself (clang's
    __builtin_cpu_supports has no name for it)."""
    source = (REPO / "csrc" / "dispatch.c").read_text()
    for variant in kvlab_build.VARIANTS[:-1]:
        assert checked_features(source, variant.name) == set(variant.features()), variant.name
        assert f"KV_WITH_{variant.name.upper()}" in source


def test_the_c_tests_build_both_aarch64_variants_with_a_cross_compiler():
    """tests/c/Makefile's second build, for an aarch64 compiler (make -n: the commands, not
    run), compiles each kernel file as dotprod with its flag and as the baseline, and tells
    dispatch.c there is a dotprod variant."""
    cross = "aarch64-linux-gnu-gcc"
    if shutil.which(cross) is None or shutil.which("make") is None:
        pytest.skip("no aarch64-linux-gnu-gcc or make here")
    commands = subprocess.run(["make", "-n", "-B", "-C", str(REPO / "tests" / "c"), f"CC={cross}",
                               "test_core_dispatch"], capture_output=True, text=True,
                              check=True).stdout.replace("\\\n", " ")   # one command a line
    for kernel in ("ops", "attention", "weight_formats", "plain", "bandwidth", "variant"):
        dotprod = [line for line in commands.splitlines() if f"variants/dotprod/{kernel}.o" in line
                   and " -c " in line]
        baseline = [line for line in commands.splitlines()
                    if f"variants/baseline/{kernel}.o" in line and " -c " in line]
        assert len(dotprod) == 1 and "-march=armv8.2-a+dotprod" in dotprod[0], kernel
        assert len(baseline) == 1 and "-march" not in baseline[0], kernel
    link = [line for line in commands.splitlines() if "-o test_core_dispatch" in line]
    assert len(link) == 1 and "-DKV_WITH_DOTPROD" in link[0] and "KV_WITH_AVX" not in link[0]


def test_dispatch_asks_the_operating_system_for_arms_dot_product():
    """ARM's ID registers trap in user code: dispatch.c asks Linux (the auxiliary vector's
    HWCAP_ASIMDDP) or macOS (sysctl's FEAT_DotProd) before it runs the dotprod variant, and
    runs the baseline where it cannot ask."""
    source = (REPO / "csrc" / "dispatch.c").read_text()
    body = re.search(r"static int cpu_has_dotprod\(void\) \{(.*?)\n\}", source, re.S).group(1)
    assert "getauxval(AT_HWCAP) & HWCAP_ASIMDDP" in body
    assert '"hw.optional.arm.FEAT_DotProd"' in body
    assert re.search(r"#else[^\n]*\n\s*return 0;", body)
    assert [v.name for v in kvlab_build.ARM_VARIANTS[:-1]] == ["dotprod"]
    assert "KV_WITH_DOTPROD" in source


def test_the_c_tests_compile_the_variants_as_setup_py_does():
    """tests/c/Makefile's second build is the extension's: the same kernel files, each
    variant with the same flags."""
    makefile = (REPO / "tests" / "c" / "Makefile").read_text()
    setup = (REPO / "setup.py").read_text()
    variables = dict(re.findall(r"^(\w+) :=[ \t]*(.*)$", makefile, re.M))

    def expand(value):
        return re.sub(r"\$\((\w+)\)", lambda m: " ".join(expand(variables[m.group(1)])),
                      value).split()
    for variant in (*kvlab_build.VARIANTS, *kvlab_build.ARM_VARIANTS):
        assert expand(variables[f"VARIANT_FLAGS_{variant.name}"]) == list(variant.flags)
    assert expand(variables["X86_64_VARIANTS"]) == names(kvlab_build.VARIANTS)
    assert expand(variables["AARCH64_VARIANTS"]) == names(kvlab_build.ARM_VARIANTS)
    withs = {name: re.findall(r"-DKV_WITH_(\w+)", part) for name, part in
             re.findall(r"\$\(if \$\((X86_64|AARCH64)\),([^,)]*)", variables["WITH"])}
    assert withs == {"X86_64": [v.name.upper() for v in kvlab_build.VARIANTS[:-1]],
                     "AARCH64": [v.name.upper() for v in kvlab_build.ARM_VARIANTS[:-1]]}
    kernels = re.search(r"KERNEL_SOURCES = .*? in\s*\((.*?)\)\]", setup, re.S).group(1)
    assert expand(variables["KERNELS"]) == re.findall(r'"(\w+)"', kernels)


def test_every_compiler_that_can_hides_the_cores_names():
    flags = kvlab_build.choose_flags(accepting(["-fvisibility=hidden"]), env={},
                                     platform="linux", libomp=no_libomp)
    assert "-fvisibility=hidden" in flags.compile


def test_the_extension_shows_the_dynamic_linker_only_its_init_function():
    """With -fvisibility=hidden the core's functions are the module's own: calls between
    its files go direct, not through the PLT (a kernel's dispatch, attention's softmax
    step), and no other library's function of the same name can take one's place."""
    from kvlab import _kvlab
    if not sys.platform.startswith("linux") or "-fvisibility=hidden" not in _kvlab.BUILD:
        pytest.skip("an ELF module built with -fvisibility=hidden (Linux, gcc or clang)")
    listed = subprocess.run(["nm", "-D", "--defined-only", _kvlab.__file__],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("no nm here")
    functions = {line.split()[-1] for line in listed.stdout.splitlines()
                 if line.split()[1:2] == ["T"]}
    assert functions == {"PyInit__kvlab"}
