"""Public self-checks for lab 14 on a GPU (a decode-attention kernel in CUDA):
`kvlab check decode_kernel_cuda decode_kernel_cuda.cu` (needs an NVIDIA GPU and nvcc).

Small cases, each compared bit for bit with kvlab's plain tier on the CPU, and one timing
of the layer the grade is timed on, which fails, saying the share your kernel reached, until
it reaches the full-marks target. The grade comes from hidden tests: more shapes, block
sizes, lengths, groups and softmax scales, drawn anew each time.
"""
from kvlab.grading.gpu_kernel_cases import TARGET_SHARE, bandwidth_share, measure_probe
from kvlab.grading.kernel_cases import check_bits, make_case
from kvlab.grading.testkit import points


def prepare():
    """The GPU's copy bandwidth, measured before your code runs."""
    measure_probe()


@points(1)
def test_one_kv_head_in_one_block(sub, rng):
    """one query head, one KV head of 8 values, 5 positions in one block of 16"""
    case = make_case(rng, 1, 1, 8, 5, 16)
    check_bits(sub.decode_attention(*case.arguments()), case.want(), case.shape)


@points(1)
def test_gqa_through_a_shuffled_table(sub, rng):
    """2 KV heads with 3 query heads each, 100 positions in blocks of 16 in shuffled order"""
    case = make_case(rng, 2, 3, 32, 100, 16)
    check_bits(sub.decode_attention(*case.arguments()), case.want(), case.shape)


@points(1)
def test_small_blocks_and_a_length_inside_a_tile(sub, rng):
    """blocks of 3 rows, 37 positions: tiles of 16 span blocks, the last one ends early"""
    case = make_case(rng, 2, 2, 16, 37, 3)
    check_bits(sub.decode_attention(*case.arguments()), case.want(), case.shape)


@points(1)
def test_a_scale_per_group_and_another_softmax_scale(sub, rng):
    """scales per 8 values of 32, and a softmax scale of 1/sqrt(48), not 1/sqrt(32)"""
    case = make_case(rng, 2, 2, 32, 50, 16, group=8, scale_dim=48)
    check_bits(sub.decode_attention(*case.arguments()), case.want(), case.shape)


@points(1, timed=True)
def test_the_share_of_the_copy_bandwidth(sub, rng):
    """the graded layer (71 MB of cache): the full-marks share of the GPU's copy bandwidth"""
    share = bandwidth_share(sub, rng)
    assert share.share >= TARGET_SHARE, (f"reached {share.describe()}; full marks take "
                                         f"{TARGET_SHARE:.0%}")
