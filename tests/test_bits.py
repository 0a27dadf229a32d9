"""One set of bits on every compiler (issue 38, item 3): the bundled model's logits for a
fixed prompt, hashed, against digests stored here.

The C core fixes the order of every sum (csrc/ops.c), and kvlab_build.py compiles it with
-ffp-contract=off, so no compiler fuses a multiply and an add that the source does not fuse
itself: gcc and clang then give the same bits. What still changes bits is whether the
kernels fuse their multiply-adds on purpose, which they do where they are built for a CPU
with FMA (kvlab._kvlab.FUSED_MULTIPLY_ADD: x86 with -march=native on a 2013 or later CPU);
so there are two digests, one for each. A compiler, flag or library that gives any other
bits fails here, where the rest of the suite (tolerances, equal tokens) would not notice.

Not covered: the CUDA backend (its own tests compare it with the CPU), other cache and
weight formats (their tests compare them with the fp32 path), and a C library whose expf
or sinf rounds differently (glibc's are what these digests were made with).
"""
import hashlib

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
# without OpenMP, on x86-64 Linux (glibc 2.36).
DIGESTS = {
    1: "44d3098e2c8427f8976769d915414d7014d2b4f9a8d3dfe41fe90bbbccfdc12c",
    0: "834a741a714f181a5819d3c87757e06ecf3866317a7addaad78c9f8820597441",
}


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
