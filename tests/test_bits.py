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

A second set of digests pins the int8-activation rule (INT8_DIGESTS): the same model with
its matrices in Q8_0, Q4_1 and Q4_0, its activations quantized to int8 per block, through a
prefill, decode steps and batched steps, again fused and unfused.

Not covered: the CUDA backend (its own tests compare it with the CPU), other cache formats
and block weights with float32 activations or fp16/bf16 weights (their tests compare them
with the fp32 path), and a C library whose expf or sinf rounds differently (glibc's are
what these digests were made with).
"""
import functools
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


def prompt_tokens():
    return np.frombuffer(PROMPT, dtype=np.uint8).astype(np.int32)


def prefill_and_decode_rows(model):
    """The prefill's logits for every prompt position, then DECODE_STEPS greedy decode
    steps' logits: len(PROMPT) + DECODE_STEPS rows."""
    cache = model.new_cache(max_seq_len=len(PROMPT) + DECODE_STEPS, dtype="fp32")
    rows = [model.prefill(prompt_tokens(), cache, all_logits=True)]
    token = int(np.argmax(rows[0][-1]))
    for _ in range(DECODE_STEPS):
        rows.append(model.decode(token, cache)[None, :])
        token = int(np.argmax(rows[-1][-1]))
    return rows


def digest_logits():
    """prefill_and_decode_rows of the bundled model as one float32 array
    (len(PROMPT) + DECODE_STEPS, 256)."""
    rows = prefill_and_decode_rows(kvlab.load())
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def digest():
    return hashlib.sha256(digest_logits().tobytes()).hexdigest()


# ---- int8 activations ---------------------------------------------------------------------

# The int8 rule (csrc/plain.c, kv_plain_matmul_int8): each block's 32 products of weight code
# and activation code summed exactly as integers, that total times d_w * d_x multiply-added
# into one running float sum, block after block in order (Q4_1's m part in a running sum of
# its own, added at the end). The digests above run float32 weights and so never reach it;
# these run the bundled model with its matrices converted to each block format and int8
# activations. Batched steps of BATCH sequences: a first call of chunks of 5 .. 17 tokens,
# then BATCH_STEPS decode steps of BATCH tokens, the sizes a product of a few tokens takes.
INT8_FORMATS = ("q8_0", "q4_1", "q4_0")
BATCH = 5
BATCH_STEPS = 3

# sha256 of digest_int8_logits(format)'s float32 bytes, by FUSED_MULTIPLY_ADD, then format.
# Made with gcc 12 on x86-64 Linux: the avx512 and avx2 variants (their different tiles) give
# the fused ones, the baseline the unfused ones, each from both tiers.
INT8_DIGESTS = {
    1: {"q8_0": "3101174ac4b7ff8b4a0fd0c84ca059471b13e2f8ac8288fca0eda08104d9c04e",
        "q4_1": "c035b792bdd0cbefd02a9a59f20e8b66ca25b01bb4e59b281141abc668edef77",
        "q4_0": "4c966418fc18135a91b9a6a43d017836e199f96726190ab1bce87d0aaa03d8c1"},
    0: {"q8_0": "edfebe097588b73e9fd2d958ccc65d35e0a8a162b9ef306a8f5f6097989d3717",
        "q4_1": "beaad1e6c6537efd1e7e66eee28904e134420d6dd078f17fd8450ba591175cc5",
        "q4_0": "a9f568dbecf6ae130e8c214b05e60831acece237f4523e437447c0facca05d47"},
}


def batched_rows(model):
    """forward_batch's rows for BATCH sequences of one paged pool: every token's logits of
    a first call (sequence i gets prompt tokens 7i .. 7i + 5 + 3i), then the last token's
    logits of BATCH_STEPS greedy decode steps of the whole batch."""
    tokens = prompt_tokens()
    pool = model.new_paged_pool(num_blocks=4 * BATCH, block_size=16)
    seqs = [pool.new_sequence() for _ in range(BATCH)]
    chunks = [tokens[7 * i:7 * i + 5 + 3 * i] for i in range(BATCH)]
    rows = [model.forward_batch(seqs, chunks, all_logits=True)]
    last = np.cumsum([len(chunk) for chunk in chunks]) - 1
    next_tokens = np.argmax(rows[0][last], axis=1)
    for _ in range(BATCH_STEPS):
        rows.append(model.forward_batch(seqs, [np.array([t], dtype=np.int32)
                                               for t in next_tokens]))
        next_tokens = np.argmax(rows[-1], axis=1)
    return rows


def digest_int8_logits(fmt):
    """The bundled model's matrices in fmt, with int8 activations: prefill_and_decode_rows,
    then batched_rows, as one float32 array (256 logits a row)."""
    bundled = kvlab.load()
    model = kvlab.Model(bundled.config, bundled.weights.converted(fmt), activations="int8")
    rows = prefill_and_decode_rows(model) + batched_rows(model)
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def int8_digests():
    """{format: sha256 of digest_int8_logits(format)}"""
    return {fmt: hashlib.sha256(digest_int8_logits(fmt).tobytes()).hexdigest()
            for fmt in INT8_FORMATS}


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


@pytest.mark.parametrize("kernels, threads", [("fast", 1), ("fast", 3), ("plain", 1)])
def test_int8_activation_logits_have_the_stored_digests(kernels, threads):
    """The int8 rule is pinned: each block's 32 products summed exactly as integers, that
    total times d_w * d_x, multiply-added into one running sum in block order (Q4_1's m part
    apart). A change that moves every tier together (a sum regrouped, the scale applied per
    group of four, d_w * d_x * total rounded another way) keeps the tiers equal to each
    other and fails here: Q8_0, Q4_1 and Q4_0 weights, a prefill (the rows-in-lanes tiles),
    single decode steps (the streaming path) and batched steps of a few tokens, on either
    tier and any thread count (threads split rows, never a sum)."""
    before = kvlab.get_kernels(), kvlab.get_num_threads()
    kvlab.set_kernels(kernels)
    kvlab.set_num_threads(threads)
    try:
        assert int8_digests() == INT8_DIGESTS[_kvlab.FUSED_MULTIPLY_ADD], (
            f"int8-activation logits have other bits than the stored digests for a build "
            f"with{'' if _kvlab.FUSED_MULTIPLY_ADD else 'out'} fused multiply-adds "
            f"({kernels} kernels, {threads} threads; this build: {_kvlab.BUILD})")
    finally:
        kvlab.set_kernels(before[0])
        kvlab.set_num_threads(before[1])


# ---- each kernel variant, in a process of its own -----------------------------------------

VARIANT_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import kvlab
from kvlab import _kvlab
import test_bits
fast, int8_fast = test_bits.digest(), test_bits.int8_digests()
kvlab.set_kernels("plain")
print(json.dumps({"variant": _kvlab.VARIANT, "fused": _kvlab.FUSED_MULTIPLY_ADD,
                  "build": _kvlab.BUILD, "fast": fast, "plain": test_bits.digest(),
                  "int8_fast": int8_fast, "int8_plain": test_bits.int8_digests()}))
"""


def this_kvlab_first(**variables):
    """The environment for a child Python that imports the kvlab this process imported (a
    scratch build's, in .ci/lanes, not the installed one), with these variables set."""
    env = dict(os.environ, **variables)
    here = str(Path(kvlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


@functools.lru_cache(maxsize=None)   # both variant tests read one run
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


@pytest.mark.parametrize("variant", _kvlab.VARIANTS)
def test_each_variant_has_the_int8_digests_of_its_multiply_adds(variant):
    """The int8 rule's digests per variant, both tiers: the avx512 and avx2 variants (each
    with its own rows-in-lanes tile: 16 rows and dpbusd, 8 rows and maddubs) the fused ones,
    the baseline (scalar sums, multiply then add) the unfused ones."""
    report = run_on_variant(variant)
    expected = INT8_DIGESTS[report["fused"]]
    assert report["int8_fast"] == expected, f"{variant}'s fast kernels"
    assert report["int8_plain"] == expected, f"{variant}'s plain kernels"


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
