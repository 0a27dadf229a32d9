"""Hidden grading tests for lab 11 (cache eviction). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

The oracles are the judge's own: kvlab's AttentionSinks and HeavyHitters (kvlab.cache_policy)
for the rows to keep, and RoPE in float64 (kvlab.reference.rope) for every rotation, applied
to raw keys at the positions wanted: a re-rotated key must be the key RoPE gives at its new
position, not merely one turned by some amount. Then the policies run on SmolLM2-135M
(fp32 activations: the same rows and keys to rounding give the same perplexity to 1e-5)
through kvlab/grading/eviction.py, once with the student's functions (called in the worker
at every drop) and once with kvlab's, and the two budget-against-perplexity curves must
agree to TOLERANCE.

Cases are drawn at grading time: shapes, frequencies, positions, shifts, scores with and
without ties, the sizes of every keep; the text of the curves is a stretch of a course
chapter starting at a paragraph drawn each time.
"""
import functools

import numpy as np

import kvlab
from kvlab.grading import eviction
from kvlab.grading.eviction import KitFunctions
from kvlab.grading.labs import chapter_file
from kvlab.grading.testkit import as_array, check_close, points

BUDGETS = (16, 32, 64)
N_TOKENS = 192            # the curves' text; its second half is scored
TOLERANCE = 0.01          # the largest relative difference of a perplexity from kvlab's
CHAPTERS = ("01_kv_cache", "02_cache_size", "03_gqa", "04_paged", "05_batching",
            "06_quantization", "07_gpu_kernels", "08_fewer_positions", "09_speculative")


def prepare():
    smollm2()


@functools.lru_cache(maxsize=None)
def smollm2():
    """SmolLM2-135M-Instruct (kvlab fetch smollm2-135m), its activations in float32: with
    int8 activations a change of one rounding in a key moves a perplexity by 1 %."""
    return kvlab.load("smollm2-135m", activations="fp32")


def rope(raw, positions, inv_freq, interleaved):
    """The keys RoPE gives raw (unrotated) keys at these positions, in float64."""
    return KitFunctions.rotate(raw, positions, inv_freq, interleaved)


def frequencies(rng, head_dim):
    theta = float(rng.choice([10_000.0, 100_000.0, 500_000.0]))
    return (theta ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)


def int_rows(got, what, shape):
    """What came back as an int array of this shape, or a failed test."""
    array = as_array(got, what, shape=shape)
    if array.dtype.kind not in "iu":
        raise AssertionError(f"{what}: expected integer row numbers, got dtype {array.dtype}")
    return array


# ---- rotate -----------------------------------------------------------------------------------

def rotation_case(sub, rng, interleaved, shape, what):
    """rotate on keys RoPE put at drawn positions, by drawn shifts, against RoPE at the sums."""
    head_dim = shape[-1]
    inv_freq = frequencies(rng, head_dim)
    raw = rng.standard_normal(shape)
    at = rng.integers(0, 2048, shape[:-1])
    shift = rng.integers(-600, 601, shape[:-1])
    shift.flat[0] = 0                                    # no turn: the key as it is
    x = rope(raw, at, inv_freq, interleaved).astype(np.float32)
    got = sub.rotate(x, shift, inv_freq, interleaved)
    other = "halves (x[i], x[i + head_dim // 2])" if interleaved else "neighbours (x[2i], x[2i + 1])"
    check_close(got, rope(raw, at + shift, inv_freq, interleaved),
                f"{what}: rotate(x, shift, inv_freq, interleaved={interleaved}), x {shape} with "
                f"shifts from -600 to 600", atol=2e-3, rtol=0,
                hints=[(rope(raw, at - shift, inv_freq, interleaved),
                        "you turned each pair the wrong way: by -shift"),
                       (KitFunctions.rotate(x, shift, inv_freq, not interleaved),
                        f"you paired the {other}, the other layout")])


@points(2)
def test_rotate_turns_each_pair_by_its_angle(sub, rng):
    """rotate, pairs (x[2i], x[2i+1]): a key RoPE put at p, turned by s, is RoPE's key at p + s"""
    for shape in ((int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.choice([8, 16, 64]))),
                  (int(rng.integers(2, 5)), int(rng.integers(1, 6)), 3, 16)):
        rotation_case(sub, rng, True, shape, f"{len(shape)}-D keys")
    # one shift for every vector: a plain int
    inv_freq = frequencies(rng, 8)
    raw = rng.standard_normal((3, 2, 8))
    shift = int(rng.integers(-50, 51))
    x = rope(raw, np.zeros((3, 2), int), inv_freq, True).astype(np.float32)
    check_close(sub.rotate(x, shift, inv_freq, True), rope(raw, np.full((3, 2), shift), inv_freq, True),
                f"rotate(x, {shift}, inv_freq, True): one int shift for every vector", atol=2e-3, rtol=0)


@points(1)
def test_rotate_pairs_the_halves_when_not_interleaved(sub, rng):
    """rotate with interleaved=False: the pairs are (x[i], x[i + head_dim/2]), Hugging Face's layout"""
    for shape in ((int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.choice([8, 16, 64]))),
                  (int(rng.integers(2, 5)), int(rng.integers(1, 6)), 3, 16)):
        rotation_case(sub, rng, False, shape, f"{len(shape)}-D keys")


# ---- which rows stay --------------------------------------------------------------------------

@points(2)
def test_sink_rows_are_the_first_and_the_newest(sub, rng):
    """sink_rows: the first `sinks` rows and the newest n_keep - sinks, as kvlab's AttentionSinks keeps them"""
    drawn = []
    for length in rng.integers(3, 80, 6).tolist():
        n_keep = int(rng.integers(1, length))
        drawn.append((length, n_keep, int(rng.integers(1, n_keep + 1))))
    length = int(rng.integers(6, 40))
    drawn += [(length, length - 1, 1), (length, 4, 4), (length, 5, 4)]
    for length, n_keep, sinks in drawn:
        want = KitFunctions.sink_rows(length, n_keep, sinks).tolist()
        what = f"sink_rows({length}, {n_keep}, {sinks})"
        got = int_rows(sub.sink_rows(length, n_keep, sinks), what, (n_keep,)).tolist()
        assert got == want, (f"{what}: expected rows {want} (the first {sinks}, then the newest "
                             f"{n_keep - sinks}), got {got}")


def check_heavy_hitters(sub, scores, n_keep, n_recent, why):
    """The student's rows for these scores against kvlab's HeavyHitters, the first layer and
    head that differ named."""
    n_layers, length, n_kv_heads = scores.shape
    what = (f"heavy_hitter_rows(scores of shape {scores.shape}, n_keep={n_keep}, "
            f"n_recent={n_recent}) ({why})")
    want = KitFunctions.heavy_hitter_rows(scores, n_keep, n_recent)
    got = int_rows(sub.heavy_hitter_rows(scores, n_keep, n_recent), what, want.shape)
    if np.array_equal(got, want):
        return
    layer, _, head = (int(i[0]) for i in np.nonzero(got != want))
    shown = np.array2string(scores[layer, :, head], precision=3, max_line_width=200)
    raise AssertionError(
        f"{what}: layer {layer}, KV head {head}, scores {shown}: expected rows "
        f"{want[layer, :, head].tolist()} (the {n_recent} newest, then of rows 0 .. "
        f"{length - n_recent - 1} the {n_keep - n_recent} largest, a tie to the earlier row, in "
        f"increasing order), got {got[layer, :, head].tolist()}")


@points(2)
def test_heavy_hitters_keep_the_newest_and_the_most_attended(sub, rng):
    """heavy_hitter_rows on drawn scores, per layer and KV head, as kvlab's HeavyHitters keeps them"""
    for _ in range(6):
        shape = (int(rng.integers(1, 5)), int(rng.integers(4, 60)), int(rng.integers(1, 4)))
        n_keep = int(rng.integers(1, shape[1]))
        n_recent = int(rng.integers(0, n_keep + 1))
        scores = rng.random(shape) * rng.integers(1, 40, shape[1])[None, :, None]
        check_heavy_hitters(sub, scores, n_keep, n_recent, "scores drawn, no ties")


@points(1)
def test_heavy_hitters_break_ties_and_count_no_row_twice(sub, rng):
    """ties go to the earlier row; the newest rows are kept once however large their scores; n_recent 0 and n_keep"""
    shape = (int(rng.integers(1, 4)), int(rng.integers(12, 40)), int(rng.integers(1, 4)))
    n_keep = int(rng.integers(4, shape[1] - 4))
    n_recent = int(rng.integers(1, n_keep))
    ties = rng.integers(0, 3, shape).astype(np.float64)
    check_heavy_hitters(sub, ties, n_keep, n_recent, "scores of 0, 1 and 2: many ties")
    heavy_newest = rng.random(shape)
    heavy_newest[:, -n_recent:] += 10.0
    check_heavy_hitters(sub, heavy_newest, n_keep, n_recent,
                        "the newest rows have the largest scores: still kept once")
    check_heavy_hitters(sub, rng.random(shape), n_keep, 0, "no newest rows kept as such")
    check_heavy_hitters(sub, rng.random(shape), n_keep, n_keep, "only the newest rows")


# ---- re-rotation ------------------------------------------------------------------------------

@points(2)
def test_rerotate_puts_each_kept_key_at_its_place(sub, rng):
    """rerotate: a kept key of position p, now i-th in the cache, is RoPE's key at position i, for each layer and head"""
    for interleaved in (True, False, True):
        n_layers, n, n_kv_heads = int(rng.integers(1, 5)), int(rng.integers(2, 24)), int(rng.integers(1, 4))
        head_dim = int(rng.choice([8, 16, 64]))
        inv_freq = frequencies(rng, head_dim)
        raw = rng.standard_normal((n_layers, n, n_kv_heads, head_dim))
        # each layer and head kept its own positions, in order, as H2O leaves them
        span = int(rng.integers(n, 3000))
        positions = np.stack([np.sort(rng.choice(span, n, replace=False))
                              for _ in range(n_layers * n_kv_heads)], axis=-1)
        positions = positions.reshape(n, n_layers, n_kv_heads).transpose(1, 0, 2)
        keys = rope(raw, positions, inv_freq, interleaved).astype(np.float32)
        slots = np.broadcast_to(np.arange(n)[None, :, None], positions.shape)
        got = sub.rerotate(keys, positions, inv_freq, interleaved)
        check_close(got, rope(raw, slots, inv_freq, interleaved),
                    f"rerotate(keys {keys.shape}, positions from 0 to {span - 1}, inv_freq, "
                    f"interleaved={interleaved})", atol=2e-3, rtol=0,
                    hints=[(rope(raw, slots + 1, inv_freq, interleaved),
                            "each key went one place too far: the first kept key goes to position 0"),
                           (rope(raw, positions + slots, inv_freq, interleaved),
                            "you turned each key by its new place without taking its old position off"),
                           (rope(raw, 2 * positions - slots, inv_freq, interleaved),
                            "you turned each key the wrong way: by its old position minus its new one")])
    # positions already 0 .. n - 1: nothing moves
    keys = rng.standard_normal((2, 5, 1, 8)).astype(np.float32)
    inv_freq = frequencies(rng, 8)
    check_close(sub.rerotate(keys, np.broadcast_to(np.arange(5)[None, :, None], (2, 5, 1)), inv_freq, True),
                keys, "rerotate of keys already at positions 0 .. 4: unchanged", atol=1e-5, rtol=0)


# ---- the budget-against-perplexity curves on SmolLM2 --------------------------------------

def drawn_text(rng, model):
    """N_TOKENS tokens of a course chapter from a paragraph drawn at grading time, and where."""
    while True:
        name = str(rng.choice(CHAPTERS))
        text = chapter_file(f"{name}.md").read_text(encoding="utf-8")
        starts = [i + 2 for i in range(len(text)) if text.startswith("\n\n", i)]
        starts = [s for s in starts if len(text) - s > 8 * N_TOKENS]
        if not starts:
            continue
        start = starts[int(rng.integers(len(starts)))]
        ids = model.encode(text[start:start + 8 * N_TOKENS])[:N_TOKENS]
        if len(ids) == N_TOKENS:
            first_words = " ".join(text[start:start + 60].split()[:6])
            return ids, f"{N_TOKENS} tokens of chapters/{name}.md from {first_words!r}"


def check_curve(sub, rng, policy, name):
    model = smollm2()
    ids, where = drawn_text(rng, model)
    try:                                    # yours first: a run that fails costs no more
        yours = eviction.curve(model, ids, BUDGETS, policy, sub)
    except ValueError as error:             # what the functions returned, refused by the run
        raise AssertionError(f"{name} on SmolLM2 over {where}: {error}") from None
    kits = eviction.curve(model, ids, BUDGETS, policy, KitFunctions)
    shown = ", ".join(map(str, BUDGETS))
    for budget, mine, want in zip(BUDGETS, yours, kits):
        assert abs(mine / want - 1) <= TOLERANCE, (
            f"{name} on SmolLM2 over {where} (the second half scored), perplexity at budgets "
            f"{shown}: yours {', '.join(f'{p:.2f}' for p in yours)}, kvlab's "
            f"{', '.join(f'{p:.2f}' for p in kits)}: at budget {budget} more than "
            f"{TOLERANCE:.0%} apart (a quarter of the budget dropped at once, the kept keys "
            f"re-rotated by your rerotate)")


@points(3)
def test_sinks_curve_on_smollm2(sub, rng):
    """SmolLM2 with your sinks, re-rotated, at budgets 16, 32 and 64: the perplexity of kvlab's to 1 %"""
    check_curve(sub, rng, "sinks", "attention sinks (4 sinks)")


@points(3)
def test_heavy_hitters_curve_on_smollm2(sub, rng):
    """SmolLM2 with your heavy hitters, re-rotated, at budgets 16, 32 and 64: the perplexity of kvlab's to 1 %"""
    check_curve(sub, rng, "h2o", "heavy hitters (half the kept rows the newest)")
