"""Grading tests for lab 14 on a GPU (decode attention in CUDA over a paged int8 cache).

The cases are lab 14's (kvlab/grading/kernel_cases.py): K and V quantized by a kvlab int8
cache, scattered through a shuffled block table (never naming block 0) into a pool whose
other rows all have NaN scales, softmax scales of 1/sqrt(d) for a d of head_dim or more.
The student's output, computed on the GPU, must be the CPU plain tier's bit for bit
(csrc/plain.c; the lab's header pins every rounding). Each correctness test draws its shapes
so that a planted mistake either always or never shows in it
(instructor/mistakes/decode_kernel_cuda/): the GQA tests have several KV heads and several
query heads on each, the MHA ones one, and every test has lengths that end inside a tile.

The bandwidth tests time the kernel on the device over lab 14's Llama-3-8B-shaped layer
(kvlab/grading/gpu_kernel_cases.py: chains of calls on the device, outputs drawn and
checked) against the GPU's copy bandwidth, measured by prepare() before any worker runs;
they share one measurement, taken by the first of them, and pass at a quarter, half and
all of gpu_kernel_cases.TARGET_SHARE. Needs an NVIDIA GPU: `kvlab grade` refuses this lab
without one (kvlab.grading.labs.require_gpu).
"""
import numpy as np

from kvlab.grading.gpu_kernel_cases import OneMeasurement, TARGET_SHARE, measure_probe
from kvlab.grading.kernel_cases import check_bits, make_case
from kvlab.grading.testkit import points

MEASURED = OneMeasurement()   # the bandwidth tests' one measurement of this grading


def prepare():
    """The GPU's copy bandwidth, now: before any code of the student's runs (a GPU runs
    work a stopped process queued, so it could not be measured alone later)."""
    measure_probe()


def attend(sub, case, what=""):
    check_bits(sub.decode_attention(*case.arguments()), case.want(), what + case.shape)


def scale_dim(rng, head_dim, group):
    """d of the softmax's scale 1/sqrt(d): head_dim, or head_dim plus whole groups."""
    return head_dim + group * int(rng.integers(0, 4))


def inside_a_tile(rng, low, high):
    """A length of `low` to `high` whole tiles and 1 to 15 positions more."""
    return int(rng.integers(low, high)) * 16 + int(rng.integers(1, 16))


@points(2)
def test_mha_through_a_shuffled_block_table(sub, rng):
    """MHA: each query head reads its own KV head, block after block through the table"""
    for head_dim in (32, 64, 128):
        case = make_case(rng, int(rng.integers(2, 9)), 1, head_dim, inside_a_tile(rng, 3, 40),
                         int(rng.choice([16, 32])), scale_dim=scale_dim(rng, head_dim, head_dim))
        attend(sub, case, f"head_dim {head_dim}: ")


@points(2)
def test_gqa_query_heads_share_their_kv_head(sub, rng):
    """GQA: query head h reads KV head h / kv_mul, for groups of 2, 3, 4, 8 and 32"""
    for kv_mul in (2, 3, 4, 8, 32):
        case = make_case(rng, int(rng.integers(2, 5)), kv_mul, 64, inside_a_tile(rng, 6, 30), 16,
                         scale_dim=scale_dim(rng, 64, 64))
        attend(sub, case, f"kv_mul {kv_mul}: ")


@points(1)
def test_mqa_one_kv_head_for_every_query_head(sub, rng):
    """MQA: one KV head for 4 to 32 query heads"""
    case = make_case(rng, 1, int(rng.integers(4, 33)), 64, inside_a_tile(rng, 3, 40), 16,
                     scale_dim=scale_dim(rng, 64, 64))
    attend(sub, case)


@points(2)
def test_blocks_smaller_than_a_tile(sub, rng):
    """blocks of 1 to 12 rows: a tile of 16 positions spans several blocks"""
    for block_size in rng.choice([1, 2, 3, 5, 7, 12], size=3, replace=False):
        case = make_case(rng, 2, 2, 32, inside_a_tile(rng, 2, 12), int(block_size),
                         scale_dim=scale_dim(rng, 32, 32))
        attend(sub, case, f"blocks of {block_size}: ")


@points(1)
def test_a_sequence_inside_one_large_block(sub, rng):
    """blocks of 64 to 1,024 rows, the sequence shorter than one: the rest of it is not its"""
    block_size = int(rng.choice([64, 256, 1024]))
    case = make_case(rng, int(rng.integers(2, 5)), 1, 64, inside_a_tile(rng, 1, block_size // 16),
                     block_size, scale_dim=scale_dim(rng, 64, 64))
    attend(sub, case)


@points(2)
def test_lengths_at_tile_and_block_edges(sub, rng):
    """lengths of 1, a tile, a block, and one either side of them"""
    block_size = int(rng.choice([16, 32]))
    for length in (1, 2, 15, 16, 17, block_size - 1, block_size + 1, 3 * block_size + 1):
        case = make_case(rng, 2, 1, 32, length, block_size, scale_dim=scale_dim(rng, 32, 32))
        attend(sub, case, f"length {length}: ")


@points(2)
def test_a_scale_per_group_of_values(sub, rng):
    """int8 scales per group of 8, 16 or 32 values inside a head, not one per row"""
    for group in (8, 16, 32):
        head_dim = int(rng.choice([64, 128]))
        case = make_case(rng, 2, 2, head_dim, inside_a_tile(rng, 4, 20), 16, group,
                         scale_dim=scale_dim(rng, head_dim, group))
        attend(sub, case, f"groups of {group}: ")


@points(1)
def test_a_long_context_gives_the_same_bits_every_call(sub, rng):
    """thousands of positions, called three times: the same bits each time (no sum whose
    order depends on which thread came first)"""
    case = make_case(rng, 2, 4, 128, inside_a_tile(rng, 150, 400), 16, 64,
                     scale_dim=scale_dim(rng, 128, 64))
    want = case.want()
    for call in range(3):
        check_bits(sub.decode_attention(*case.arguments()), want, f"call {call + 1}: {case.shape}")


@points(1)
def test_rows_of_very_different_sizes(sub, rng):
    """rows whose scales span two powers of ten: scores tens apart, far from 0"""
    case = make_case(rng, 2, 1, 64, inside_a_tile(rng, 4, 20), 16, spread=2.0, q_scale=3.0,
                     scale_dim=scale_dim(rng, 64, 64))
    attend(sub, case)


@points(2, timed=True)
def test_bandwidth_reaches_a_quarter_of_the_target(sub, rng):
    """Llama-3-8B-shaped layer: at least a quarter of the target share of the copy bandwidth"""
    MEASURED.reaches(sub, rng, TARGET_SHARE / 4)


@points(2, timed=True)
def test_bandwidth_reaches_half_the_target(sub, rng):
    """the same layer: at least half of the target share"""
    MEASURED.reaches(sub, rng, TARGET_SHARE / 2)


@points(2, timed=True)
def test_bandwidth_reaches_the_target(sub, rng):
    """the same layer: the target share of the GPU's copy bandwidth"""
    MEASURED.reaches(sub, rng, TARGET_SHARE)
