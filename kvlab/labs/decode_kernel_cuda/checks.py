"""Public self-checks for lab 14 on a GPU (a decode-attention kernel in CUDA):
`kvlab check decode_kernel_cuda decode_kernel_cuda.cu` (needs an NVIDIA GPU and nvcc).

A few cases shaped the way GPU kernels go wrong (many query heads on one KV head, a long
sequence through small blocks, one short sequence in a block far larger than it, the same
call twice), each compared bit for bit with kvlab's plain tier on the CPU, and one timing of
the layer the grade is timed on, which fails, saying the share your kernel reached, until it
reaches the full-marks target. The grade comes from hidden tests: more shapes, block sizes,
lengths, groups and softmax scales, drawn anew each time. Lab 14's own cases (kvlab check
decode_kernel) are the small ones to start from.
"""
from kvlab.grading.gpu_kernel_cases import TARGET_SHARE, bandwidth_share, measure_probe
from kvlab.grading.kernel_cases import check_bits, make_case
from kvlab.grading.testkit import points


def prepare():
    """The GPU's copy bandwidth, measured before your code runs."""
    measure_probe()


def same_bits(sub, case, calls=1):
    want = case.want()
    for call in range(calls):
        check_bits(sub.decode_attention(*case.arguments()), want, f"call {call + 1}: {case.shape}")


@points(1)
def test_32_query_heads_on_one_kv_head(sub, rng):
    """MQA: 32 query heads of 64 values on one KV head, 200 positions in blocks of 16"""
    same_bits(sub, make_case(rng, 1, 32, 64, 200, 16))


@points(1)
def test_a_long_sequence_through_small_blocks(sub, rng):
    """4 KV heads of 128, 2 query heads each, 2,001 positions in blocks of 5, scales per 32"""
    same_bits(sub, make_case(rng, 4, 2, 128, 2001, 5, group=32))


@points(1)
def test_a_short_sequence_in_a_large_block(sub, rng):
    """17 positions in one block of 1,024 (the rest of it not the sequence's), scales per 32,
    softmax scale 1/sqrt(96) for heads of 64"""
    same_bits(sub, make_case(rng, 2, 3, 64, 17, 1024, group=32, scale_dim=96))


@points(1)
def test_the_same_bits_on_every_call(sub, rng):
    """8 KV heads of 128, 4 query heads each, 1,000 positions, called three times"""
    same_bits(sub, make_case(rng, 8, 4, 128, 1000, 16, group=64), calls=3)


@points(1, timed=True)
def test_the_share_of_the_copy_bandwidth(sub, rng):
    """the graded layer (71 MB of cache): the full-marks share of the GPU's copy bandwidth"""
    share = bandwidth_share(sub, rng)
    assert share.share >= TARGET_SHARE, (f"reached {share.describe()}; full marks take "
                                         f"{TARGET_SHARE:.0%}")
