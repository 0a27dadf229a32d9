"""Hidden grading tests for lab 13 (weight quantization: AWQ's activation-aware scales).
Each test says in its message what it expected. Run by the judge (kvlab/grading/judge.py),
never shipped in the package.

Q4_0's round to nearest is checked bit for bit against kvlab.weight_formats (ggml's
quantizer) on drawn matrices and on blocks built to trip it; the scales, the output error,
the grid search and the fold against kvlab.weight_quantization on small layers drawn now.
Then the submission's search on SmolLM2-135M's own layers (wq/wk/wv and w1/w3 of three
layers drawn now, on their inputs from a stretch of the verse below drawn now) against
kvlab's. The last test is the lab's point, measured on the whole model: the submission's
scales, searched on every layer's wq/wk/wv and w1/w3 (the lab's fold), must bring SmolLM2
in Q4_0 closer to the float model than round to nearest does: a mean KL divergence of the
next-token distributions at least KL_MARGIN below round to nearest's (kvlab.accuracy's
compare_models). It grades the KL, not the perplexity, because the perplexity of the text
a grading can afford moves by several percent either way between draws at these KLs (the
reference solution was worse than round to nearest in 4 draws of 10), while its KL was
lower in every draw measured; the perplexities are reported beside it. The judge
calibrates on windows of the course's chapters (their prose, installed with kvlab: no
download) drawn now, folds the submission's scales into its own copy of the weights (the
fold itself is graded above), stores both models in Q4_0 and evaluates them on other
windows drawn now; the worker only searches. The verse below is too short and too well
known for it. instructor/README.md has the measurements (the solution's margin in every
draw, what the planted mistakes give, the cost).
SmolLM2 is kvlab's named model (kvlab fetch smollm2-135m), loaded in prepare().
"""
import dataclasses
import functools
import re

import numpy as np

import kvlab
from kvlab import accuracy, reference, weight_formats
from kvlab import weight_quantization as wq
from kvlab.grading.labs import chapter_file
from kvlab.grading.testkit import as_array, check_close, described, number, points

# Text for calibration and evaluation (public domain: Shakespeare, Hamlet act 3 scene 1,
# Julius Caesar act 3 scene 2, As You Like It act 2 scene 7, sonnet 18).
TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life.

Friends, Romans, countrymen, lend me your ears;
I come to bury Caesar, not to praise him.
The evil that men do lives after them;
The good is oft interred with their bones;
So let it be with Caesar. The noble Brutus
Hath told you Caesar was ambitious:
If it were so, it was a grievous fault,
And grievously hath Caesar answer'd it.
Here, under leave of Brutus and the rest,
For Brutus is an honourable man;
So are they all, all honourable men,
Come I to speak in Caesar's funeral.
He was my friend, faithful and just to me:
But Brutus says he was ambitious;
And Brutus is an honourable man.

All the world's a stage,
And all the men and women merely players;
They have their exits and their entrances;
And one man in his time plays many parts,
His acts being seven ages. At first the infant,
Mewling and puking in the nurse's arms.
And then the whining school-boy, with his satchel
And shining morning face, creeping like snail
Unwillingly to school. And then the lover,
Sighing like furnace, with a woeful ballad
Made to his mistress' eyebrow. Then a soldier,
Full of strange oaths and bearded like the pard,
Jealous in honour, sudden and quick in quarrel,
Seeking the bubble reputation
Even in the cannon's mouth.

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
"""
CALIBRATION_TOKENS = 64
MODEL_ALPHAS = [0.0, 0.25, 0.5]      # the grid of the SmolLM2 test
GROUPS = (("attn", ("wq", "wk", "wv"), "attn_norm"), ("ffn", ("w1", "w3"), "ffn_norm"))
# The whole-model test: windows of the chapters' prose, each after SmolLM2's <|endoftext|>
# (id 0, how its training text starts a document), calibration windows drawn from the
# text's first half and evaluation windows from its second; the submission's KL from the
# float model must be at least KL_MARGIN below round to nearest's. Sizes and margin are
# measured in instructor/README.md (the reference solution's margin in every draw).
DOCUMENT_START = 0
CALIBRATION_WINDOWS, CALIBRATION_WINDOW = 8, 128
EVALUATION_WINDOWS, EVALUATION_WINDOW = 4, 256
# 2 %, not 5 %: the reference solution's margin was 8.9-31 % in 38 draws (median 23 %,
# spread about 5-6 points): a normal curve of that spread puts a correct search under 5 %
# in about 1 grading of 700-6,000, under 2 % in 1 of 4,000-80,000, and its one outlier
# (8.9 %: one window of four swung) says the low tail is heavier than that curve. Every
# planted mistake and cheat aimed here fails as far below either bar: scales of 1 or
# alpha 0 are round to nearest itself (exactly 0 %), inverse scales +273-356 %.
KL_MARGIN = 0.02


@functools.lru_cache(maxsize=None)
def smollm2():
    """SmolLM2-135M-Instruct (its file's values in float32) and its token ids of TEXT."""
    model = kvlab.load("smollm2-135m")
    weights = model.weights.float32()
    return model, weights, np.asarray(model.encode(TEXT), dtype=np.int64)


@functools.lru_cache(maxsize=None)
def chapters_tokens():
    """SmolLM2's token ids of the course's chapters, their prose only: fenced code blocks,
    table rows, directive lines and display math are left out."""
    model, _, _ = smollm2()
    first = chapter_file("01_kv_cache.md")
    if first is None:
        raise RuntimeError("this kvlab has no chapters (kvlab.chapters): the whole-model test "
                           "calibrates and evaluates on their prose")
    folder = first.parent
    prose = []
    for path in sorted(folder.glob("[0-9][0-9]_*.md")):
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        prose += [line for line in text.splitlines()
                  if not line.lstrip().startswith(("|", ":", "{", "$$"))]
    return np.asarray(model.encode(re.sub(r"\n{3,}", "\n\n", "\n".join(prose))),
                      dtype=np.int64)


def prepare():
    smollm2()
    chapters_tokens()


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def kits_q4_0(w):
    return wq.rounded(np.asarray(w, np.float32), "q4_0")


def check_exact(got, want, what):
    got = as_array(got, what, shape=want.shape)
    if not np.array_equal(got.astype(np.float32), want):
        bad = np.argwhere(got.astype(np.float32) != want)[0]
        at = tuple(int(i) for i in bad)
        raise AssertionError(f"{what}: {int(np.sum(got != want))} of {want.size} values differ "
                             f"from Q4_0's (first at {at}: expected {want[at]!r}, got "
                             f"{float(got[at])!r}); block {at[1] // 32} of row {at[0]} is "
                             f"{want[at[0], at[1] // 32 * 32:at[1] // 32 * 32 + 32].tolist()} "
                             f"as stored")


def layer_inputs(rng, n, in_dim):
    """Activations (n, in_dim) with a few input channels much larger than the rest, as a
    model's are (chapter 10)."""
    x = normal(rng, n, in_dim)
    loud = rng.choice(in_dim, size=int(rng.integers(1, 4)), replace=False)
    x[:, loud] *= rng.uniform(8, 40, size=len(loud)).astype(np.float32)
    return x


@points(3)
def test_round_to_nearest_is_q4_0s(sub, rng):
    """round to nearest into Q4_0 of drawn matrices, bit for bit as kvlab.weight_formats stores them"""
    for _ in range(3):
        out_dim, in_dim = int(rng.integers(1, 24)), 32 * int(rng.integers(1, 6))
        w = normal(rng, out_dim, in_dim, scale=float(rng.choice([0.02, 1.0, 300.0])))
        check_exact(sub.q4_0_round_to_nearest(w), kits_q4_0(w),
                    f"q4_0_round_to_nearest of a ({out_dim}, {in_dim}) matrix")


@points(2)
def test_round_to_nearest_edge_blocks(sub, rng):
    """blocks built to trip it: all zeros, a negative largest value, a tie of +-max, a code of 16 cut to 15, tiny values"""
    blocks = np.zeros((6, 32), np.float32)
    blocks[1] = normal(rng, 32)
    blocks[1, int(rng.integers(32))] = -6.0                  # the largest magnitude, negative
    blocks[2] = normal(rng, 32)
    i, j = rng.choice(32, 2, replace=False)
    blocks[2, min(i, j)], blocks[2, max(i, j)] = (5.0, -5.0) if rng.integers(2) else (-5.0, 5.0)
    blocks[3] = rng.uniform(-8, 8, 32).astype(np.float32)
    blocks[3, int(rng.integers(32))] = 8.0                   # d = -1: -8 would be code 16
    blocks[3, int(rng.integers(32))] = -8.0 + 1e-3
    blocks[4] = normal(rng, 32, scale=1e-6)                  # d below half precision's normals
    blocks[5] = np.round(normal(rng, 32) * 4) / 4            # many exact halves of a step
    order = rng.permutation(6)
    w = blocks[order].reshape(2, 96)
    check_exact(sub.q4_0_round_to_nearest(w), kits_q4_0(w),
                "q4_0_round_to_nearest of blocks with a zero block, a negative largest value, a "
                "tie of +max and -max (the first one sets d), a value at code 16 (cut to 15), "
                "values of 1e-6 and exact quarter steps")


@points(2)
def test_channel_scales_are_awqs(sub, rng):
    """s = magnitude ** alpha, divided by sqrt(max(s) * min(s)); alpha 0 gives ones"""
    magnitude = np.abs(normal(rng, int(rng.integers(8, 200)))) + np.float32(0.01)
    magnitude[int(rng.integers(len(magnitude)))] *= 50
    for alpha in (0.0, float(rng.uniform(0.1, 0.9)), 1.0):
        check_close(sub.channel_scales(magnitude, alpha), wq.awq_scales(magnitude, alpha),
                    f"channel_scales of {len(magnitude)} magnitudes with alpha {alpha:.3f}",
                    atol=0, rtol=1e-5)


@points(1)
def test_output_error(sub, rng):
    """||x w^T - x w_stored^T||^2 summed over every output"""
    x, w = normal(rng, 12, 64), normal(rng, 10, 64)
    stored = kits_q4_0(w)
    check_close(np.array([number(sub.output_error(x, w, stored), "output_error")]),
                np.array([wq.output_error(x, w, stored)]), "output_error of a (10, 64) layer "
                "on 12 inputs, against its Q4_0 values", atol=0, rtol=1e-4)


@points(3)
def test_search_picks_the_alpha_with_the_least_error(sub, rng):
    """on small layers with loud channels: every alpha's error, the least one's alpha, its scales"""
    for _ in range(2):
        in_dim = 32 * int(rng.integers(2, 5))
        x = layer_inputs(rng, int(rng.integers(16, 48)), in_dim)
        matrices = [normal(rng, int(rng.integers(8, 40)), in_dim, scale=0.1)
                    for _ in range(int(rng.integers(1, 4)))]
        alphas = [0.0] + sorted(float(a) for a in rng.choice(np.arange(1, 10) / 10,
                                                             int(rng.integers(3, 7)), replace=False))
        check_search(sub, x, matrices, alphas, f"search_scales over {len(matrices)} matrices "
                     f"of {in_dim} columns, alphas {alphas}")


@points(2)
def test_fold_into_norm_keeps_the_layer(sub, rng):
    """norm / s and w * s: RMSNorm then the matrices give the same outputs as before"""
    dim = 32 * int(rng.integers(1, 4))
    norm = (1 + 0.2 * normal(rng, dim)).astype(np.float32)
    matrices = [normal(rng, int(rng.integers(4, 20)), dim) for _ in range(2)]
    s = np.exp(normal(rng, dim)).astype(np.float32)
    got = sub.fold_into_norm(norm, matrices, s)
    assert isinstance(got, (tuple, list)) and len(got) == 2 and len(got[1]) == 2, (
        f"fold_into_norm should return (norm_weight, [matrices...]), got {described(got)}")
    check_close(got[0], norm / s, f"the folded RMSNorm weight ({dim} channels)", atol=0, rtol=1e-6)
    x = normal(rng, 5, dim)
    for i, (w, folded) in enumerate(zip(matrices, got[1])):
        check_close(folded, w * s, f"folded matrix {i}: its columns times the scales", atol=0,
                    rtol=1e-6)
        check_close(reference.rmsnorm(x, np.asarray(got[0], np.float32), 1e-5) @
                    np.asarray(folded, np.float32).T,
                    reference.rmsnorm(x, norm, 1e-5) @ w.T,
                    f"matrix {i} after the folded RMSNorm: the layer's outputs", atol=1e-4, rtol=1e-4)


def check_search(sub, x, matrices, alphas, what):
    """The submission's search over these matrices against kvlab's: every alpha's error,
    the least one's alpha, its scales."""
    got = sub.search_scales(x, matrices, alphas)
    assert isinstance(got, dict) and {"alpha", "scales", "errors"} <= set(got), (
        f"{what}: expected a dict with 'alpha', 'scales' and 'errors', got {described(got)}")
    magnitude = np.abs(x).mean(axis=0)
    want = [sum(wq.output_error(x, w, kits_q4_0(w * s) / s) for w in matrices)
            for s in (wq.awq_scales(magnitude, a) for a in alphas)]
    check_close(as_array(got["errors"], f"{what}: errors", shape=(len(alphas),)),
                np.array(want), f"{what}: the output error of each alpha", atol=0, rtol=1e-4)
    alpha = number(got["alpha"], f"{what}: alpha")
    assert alpha in alphas, f"{what}: alpha {alpha!r} is not one of the grid's"
    assert want[alphas.index(alpha)] <= min(want) * (1 + 1e-6), (
        f"{what}: alpha {alpha} gives output error {want[alphas.index(alpha)]:.6g}, but alpha "
        f"{alphas[int(np.argmin(want))]} gives {min(want):.6g}")
    check_close(got["scales"], wq.awq_scales(magnitude, alpha),
                f"{what}: the scales of alpha {alpha} (from mean |x| of each input channel)",
                atol=0, rtol=1e-5)


@points(5, slow=2)
def test_your_search_on_smollm2s_layers(sub, rng):
    """SmolLM2-135M's own layers (wq/wk/wv and w1/w3 of layers drawn now, on their inputs from text drawn now): the search as kvlab's"""
    model, weights, ids = smollm2()
    start = int(rng.integers(0, len(ids) - CALIBRATION_TOKENS))
    layers = sorted(int(i) for i in rng.choice(model.config.n_layers, 3, replace=False))
    calibration = wq.calibrate(model.config, weights, ids[start:start + CALIBRATION_TOKENS],
                               window=CALIBRATION_TOKENS)
    for layer in layers:
        for inputs, names, _ in GROUPS:
            check_search(sub, getattr(calibration, inputs)[layer],
                         [getattr(weights, name)[layer] for name in names], MODEL_ALPHAS,
                         f"search_scales on SmolLM2's layer {layer}, {'/'.join(names)}, "
                         f"alphas {MODEL_ALPHAS}")


def document_windows(ids, starts, length):
    """The stretches ids[start:start + length], each after the document-start token."""
    return [np.concatenate([[DOCUMENT_START], ids[int(s):int(s) + length]]).astype(np.int64)
            for s in starts]


def calibration_of(model, weights, windows):
    """Every matrix's inputs on these windows, without each window's first position: the
    document-start token's activations are the same in every draw and tens of times larger
    than the text's (an attention sink), and would set the scales alone."""
    length = len(windows[0])            # (document_windows gives windows of one length)
    run = wq.calibrate(model.config, weights, np.concatenate(windows), window=length)
    text = np.arange(len(windows) * length) % length != 0
    return wq.Calibration(**{key: getattr(run, key)[:, text]
                             for key in ("attn", "wo", "ffn", "w2")})


def submitted_scales(sub, x, matrices, what):
    """The scales the submission's search_scales chooses (grid MODEL_ALPHAS): positive and
    finite, one per input channel."""
    got = sub.search_scales(x, matrices, MODEL_ALPHAS)
    assert isinstance(got, dict) and "scales" in got, (
        f"{what}: search_scales should return a dict with 'scales', got {described(got)}")
    s = as_array(got["scales"], f"{what}: the scales", shape=(x.shape[1],)).astype(np.float32)
    assert np.all(np.isfinite(s)) and np.all(s > 0), f"{what}: the scales must be positive and finite"
    return s


def folded_by_the_judge(sub, config, weights, calibration):
    """weights (float32) with the submission's scales of every layer's wq/wk/wv and w1/w3
    folded in by the judge: the norm weight divided by them, the matrices' columns
    multiplied (what fold_into_norm does, graded on its own above)."""
    arrays = {name: getattr(weights, name).copy()
              for name in ("wq", "wk", "wv", "w1", "w3", "attn_norm", "ffn_norm")}
    for layer in range(config.n_layers):
        for inputs, names, norm in GROUPS:
            s = submitted_scales(sub, getattr(calibration, inputs)[layer],
                                 [arrays[name][layer] for name in names],
                                 f"search_scales on SmolLM2's layer {layer}, {'/'.join(names)}")
            arrays[norm][layer] /= s
            for name in names:
                arrays[name][layer] *= s
    return dataclasses.replace(weights, **arrays)


def in_q4_0(model, weights):
    """A Model of weights with every layer matrix stored in Q4_0 by kvlab (round to
    nearest), float32 activations (chapter 10.5's comparison)."""
    stored = dataclasses.replace(weights, **{name: weight_formats.stored(getattr(weights, name), "q4_0")
                                             for name in wq.LAYER_MATRICES})
    return kvlab.Model(model.config, stored, model.tokenizer, activations="fp32")


def kl_against_round_to_nearest(sub, rng):
    """Calibration and evaluation windows drawn by rng, the submission's scales folded in:
    (round to nearest's, the submission's) rows of kvlab.accuracy.compare_models."""
    model, weights, _ = smollm2()
    ids = chapters_tokens()
    half = len(ids) // 2
    calibration = calibration_of(model, weights, document_windows(
        ids, rng.integers(0, half - CALIBRATION_WINDOW, CALIBRATION_WINDOWS), CALIBRATION_WINDOW))
    folded = folded_by_the_judge(sub, model.config, weights, calibration)
    windows = document_windows(ids, rng.integers(half, len(ids) - EVALUATION_WINDOW,
                                                 EVALUATION_WINDOWS), EVALUATION_WINDOW)
    exact = kvlab.Model(model.config, weights, model.tokenizer, activations="fp32")
    _, (rtn, yours) = accuracy.compare_models(
        exact, {"rtn": in_q4_0(model, weights), "yours": in_q4_0(model, folded)},
        np.concatenate(windows), context=EVALUATION_WINDOW + 1)
    return rtn, yours


@points(3, slow=4)
def test_your_scales_beat_round_to_nearest_on_smollm2(sub, rng):
    """your search on every layer's wq/wk/wv and w1/w3 of SmolLM2, calibrated on chapter text drawn now, in Q4_0: KL from the float model at least 2 % below round to nearest's on other chapter text drawn now"""
    rtn, yours = kl_against_round_to_nearest(sub, rng)
    measured = (f"SmolLM2 in Q4_0 with your scales (searched on {CALIBRATION_WINDOWS} x "
                f"{CALIBRATION_WINDOW} tokens of the chapters, grid {MODEL_ALPHAS}), over "
                f"{EVALUATION_WINDOWS} x {EVALUATION_WINDOW} other tokens: KL from the float model "
                f"{yours.kl:.4f} nats a token against round to nearest's {rtn.kl:.4f} "
                f"({100 * (yours.kl / rtn.kl - 1):+.1f} %); perplexity {yours.perplexity:.3f} "
                f"against {rtn.perplexity:.3f} ({100 * (yours.perplexity / rtn.perplexity - 1):+.1f} %"
                f", not graded: over this little text it moves by several percent either way "
                f"between draws)")
    assert yours.kl <= rtn.kl * (1 - KL_MARGIN), (
        f"{measured}. The KL must be at least {100 * KL_MARGIN:.0f} % lower than round to "
        f"nearest's (the reference search lowered it by more in every draw measured)")
    return measured
