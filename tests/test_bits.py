"""One set of bits on every compiler (issue 38, item 3): the bundled model's logits for a
fixed prompt, hashed, against digests stored here.

The C core fixes the order of every sum (csrc/ops.c), and kvlab_build.py compiles it with
-ffp-contract=off, so no compiler fuses a multiply and an add that the source does not fuse
itself: gcc and clang then give the same bits. What still changes bits is whether the
kernels fuse their multiply-adds on purpose, which they do in a kernel variant built for
CPUs with FMA (kvlab._kvlab.FUSED_MULTIPLY_ADD: the avx2 and avx512 variants that an x86-64
build runs on a 2013 or later CPU, or a KVLAB_NATIVE=1 build there); so there are two
digests, one for each. Every variant of the build is checked, each in a process of its own
(KVLAB_VARIANT): the baseline gives the unfused digest, avx2 and avx512 the fused one, and
each variant's plain tier its fast tier's. A compiler, flag or library that gives any other
bits fails here, where the rest of the suite (tolerances, equal tokens) would not notice.

Not covered: the CUDA backend (its own tests compare it with the CPU), other cache and
weight formats (their tests compare them with the fp32 path), and a C library whose expf
or sinf rounds differently (glibc's are what these digests were made with).
"""
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab import _kvlab

# A prompt of bytes (the bundled model's tokens), long enough that the prefill runs the
# matrix kernels on several tokens at once and attention over a few dozen positions.
PROMPT = b"ROMEO: But soft, what light through yonder window breaks? It is the east,"
DECODE_STEPS = 8

# sha256 of the float32 bytes of digest_logits()'s array, by FUSED_MULTIPLY_ADD. Made with
# gcc 12 (-march=native and KVLAB_PORTABLE=1 builds) and reproduced by clang 14 with and
# without OpenMP, on x86-64 Linux (glibc 2.36); the unfused one also by aarch64's dotprod
# and baseline variants (gcc 12's cross compiler, Debian 12's arm64 Python under qemu-user:
# .ci/lanes aarch64_python).
DIGESTS = {
    1: "44d3098e2c8427f8976769d915414d7014d2b4f9a8d3dfe41fe90bbbccfdc12c",
    0: "834a741a714f181a5819d3c87757e06ecf3866317a7addaad78c9f8820597441",
}

# Whether each kernel variant fuses its multiply-adds (kvlab_build.VARIANTS' flags: avx2 and
# avx512 are compiled with -mfma, the baseline for any x86-64 CPU, without; aarch64's
# baseline and dotprod never fuse, since only x86's __FMA__ turns fusing on). A build of one
# variant (KVLAB_NATIVE=1's "native", another CPU's "baseline") fuses where its target has
# x86's FMA.
FUSES = {"baseline": 0, "avx2": 1, "avx512": 1, "dotprod": 0}


def digest_logits():
    """The prefill's logits for every prompt position, then DECODE_STEPS greedy decode
    steps' logits, as one float32 array (len(PROMPT) + DECODE_STEPS, 256)."""
    model = kvlab.load()
    cache = model.new_cache(max_seq_len=len(PROMPT) + DECODE_STEPS, dtype="fp32")
    rows = [model.prefill(np.frombuffer(PROMPT, dtype=np.uint8).astype(np.int32), cache,
                          all_logits=True)]
    token = int(np.argmax(rows[0][-1]))
    for _ in range(DECODE_STEPS):
        rows.append(model.decode(token, cache)[None, :])
        token = int(np.argmax(rows[-1][-1]))
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def digest():
    return hashlib.sha256(digest_logits().tobytes()).hexdigest()


def test_the_bundled_models_logits_have_the_stored_digest():
    """Any compiler, flag or thread count that gives other bits than the stored ones
    fails: the digest names every bit of 81 rows of 256 logits."""
    expected = DIGESTS[_kvlab.FUSED_MULTIPLY_ADD]
    assert digest() == expected, (
        f"the bundled model's logits have other bits than the stored digest for a build "
        f"with{'' if _kvlab.FUSED_MULTIPLY_ADD else 'out'} fused multiply-adds "
        f"(this build: {_kvlab.BUILD})")


@pytest.mark.parametrize("threads", [1, 3])
def test_the_digest_holds_for_any_thread_count(threads):
    """The threads split rows, never a sum, so their count changes no bit."""
    before = kvlab.get_num_threads()
    kvlab.set_num_threads(threads)
    try:
        assert digest() == DIGESTS[_kvlab.FUSED_MULTIPLY_ADD]
    finally:
        kvlab.set_num_threads(before)


def test_the_digest_holds_for_the_plain_kernels():
    """The plain tier (the readable kernels) gives the fast tier's bits, so the digest."""
    before = kvlab.get_kernels()
    kvlab.set_kernels("plain")
    try:
        assert digest() == DIGESTS[_kvlab.FUSED_MULTIPLY_ADD]
    finally:
        kvlab.set_kernels(before)


# ---- each kernel variant, in a process of its own -----------------------------------------

VARIANT_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import kvlab
from kvlab import _kvlab
import test_bits
fast = test_bits.digest()
kvlab.set_kernels("plain")
print(json.dumps({"variant": _kvlab.VARIANT, "fused": _kvlab.FUSED_MULTIPLY_ADD,
                  "build": _kvlab.BUILD, "fast": fast, "plain": test_bits.digest()}))
"""


def this_kvlab_first(**variables):
    """The environment for a child Python that imports the kvlab this process imported (a
    scratch build's, in .ci/lanes, not the installed one), with these variables set."""
    env = dict(os.environ, **variables)
    here = str(Path(kvlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def run_on_variant(variant):
    """The digests of a process whose kernels are KVLAB_VARIANT=variant's, or a skip where
    this CPU cannot run it (kvlab refuses it at import with ValueError)."""
    here = Path(__file__).parent     # not the repository, whose kvlab/ has no extension in CI
    done = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT, str(here)], cwd=here,
                          env=this_kvlab_first(KVLAB_VARIANT=variant), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0 and "this CPU cannot run it" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", _kvlab.VARIANTS)
def test_each_variant_has_the_digest_of_its_multiply_adds(variant):
    """Each variant this build has and this CPU runs gives the stored digest of its kind,
    fused (avx2, avx512) or not (baseline), from both tiers: its plain kernels are its fast
    ones' specification, compiled with the same instructions."""
    report = run_on_variant(variant)
    assert report["variant"] == variant and report["build"] == _kvlab.BUILD
    assert report["fused"] == FUSES.get(variant, report["fused"])
    assert report["fast"] == DIGESTS[report["fused"]], f"{variant}'s fast kernels"
    assert report["plain"] == DIGESTS[report["fused"]], f"{variant}'s plain kernels"


def test_a_variant_this_build_lacks_is_refused_with_the_choices():
    done = subprocess.run([sys.executable, "-c", "import kvlab"], capture_output=True,
                          env=this_kvlab_first(KVLAB_VARIANT="avx9000"), text=True,
                          timeout=300, cwd=Path(__file__).parent)
    assert done.returncode != 0
    assert "KVLAB_VARIANT must be one of this build's kernel variants" in done.stderr
    assert all(f"'{name}'" in done.stderr for name in _kvlab.VARIANTS)


# The line of Linux's /proc/cpuinfo that lists the CPU's features, by architecture
CPUINFO_FEATURES = {"x86_64": "flags", "aarch64": "Features"}


def cpu_flags():
    """This CPU's feature flags as Linux names them, or None off x86-64 and aarch64 Linux
    (and under qemu-user emulating another architecture, whose /proc/cpuinfo is the
    host's: cibuildwheel tests aarch64 wheels so on x86-64 runners)."""
    key = CPUINFO_FEATURES.get(platform.machine())
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if key is not None and line.split(":", 1)[0].strip() == key:
            return set(line.split(":", 1)[1].split())
    return None


def test_the_best_variant_this_cpu_has_runs_by_default():
    """The dispatcher's own reading of the CPU (cpuid; on aarch64 the auxiliary vector)
    agrees with Linux's: the AVX-512 variant where every feature it is compiled for is there,
    else AVX2's, else the baseline; on aarch64 dotprod where the CPU has the dot-product
    instructions (asimddp), else the baseline. (Under an emulator such as qemu-user of the
    same architecture, /proc/cpuinfo is the host's: not run there.)"""
    flags = cpu_flags()
    if len(_kvlab.VARIANTS) == 1 or flags is None or "KVLAB_VARIANT" in os.environ:
        pytest.skip("a build of one variant, not Linux, or a variant forced")
    if platform.machine() == "aarch64":
        best = "dotprod" if "asimddp" in flags else "baseline"
    else:
        avx2 = {"avx2", "fma", "f16c", "bmi1", "bmi2"}
        avx512 = avx2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                         "avx512_vnni"}
        best = "avx512" if avx512 <= flags else "avx2" if avx2 <= flags else "baseline"
    assert _kvlab.VARIANT == best, _kvlab.VARIANT_REASON
    assert _kvlab.VARIANT_REASON.startswith("the best of this build's")
