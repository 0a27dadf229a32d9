"""The notebooks' "Your turn" exercises (kvlab/your_turn.py): the worked answers in
instructor/notebook_answers/ pass, the stubs as shipped say "not attempted yet" without
raising, plausible wrong answers fail with a hint, and every notebook has its exercise."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab import your_turn

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ANSWERS = REPO / "instructor" / "notebook_answers"
EXERCISES = sorted(your_turn.EXERCISES)


def worked_answer(exercise):
    """The function instructor/notebook_answers/<exercise>.py defines for the exercise."""
    path = ANSWERS / f"{exercise}.py"
    spec = importlib.util.spec_from_file_location(f"notebook_answer_{exercise}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, your_turn.EXERCISES[exercise].function)


def your_turn_cells(exercise):
    """The notebook's "## Your turn" markdown cell and the two code cells after it."""
    nbformat = pytest.importorskip("nbformat")
    cells = nbformat.read(NOTEBOOKS / f"{exercise}.ipynb", as_version=4).cells
    starts = [i for i, c in enumerate(cells)
              if c.cell_type == "markdown" and c.source.splitlines()[0] == "## Your turn"]
    assert len(starts) == 1, f"{exercise}: {len(starts)} '## Your turn' cells"
    i = starts[0]
    assert i + 2 < len(cells), f"{exercise}: the Your turn cell must be followed by two cells"
    return cells[i], cells[i + 1], cells[i + 2]


def shipped_stub(exercise):
    """The stub function exactly as the notebook ships it."""
    _, stub, _ = your_turn_cells(exercise)
    namespace = {"np": np, "kvlab": kvlab}
    exec(compile(stub.source, f"<{exercise} stub>", "exec"), namespace)
    return namespace[your_turn.EXERCISES[exercise].function]


def run_check(exercise, answer, capsys, seed=0):
    ok = your_turn.check(exercise, answer, seed=seed)
    return ok, capsys.readouterr().out


# ---- the notebooks --------------------------------------------------------------------

def test_every_notebook_has_an_exercise_and_every_exercise_a_notebook():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == EXERCISES
    assert sorted(p.stem for p in ANSWERS.glob("*.py")) == EXERCISES
    for exercise in EXERCISES:
        name, description = your_turn.EXERCISES[exercise]
        assert name.isidentifier() and description


@pytest.mark.parametrize("exercise", EXERCISES)
def test_notebook_has_the_exercise_cells(exercise):
    text, stub, check = your_turn_cells(exercise)
    name = your_turn.EXERCISES[exercise].function
    assert stub.cell_type == "code" and check.cell_type == "code"
    assert stub.source.startswith(f"def {name}(")
    assert '"""' in stub.source                                   # a docstring says what to write
    assert stub.source.rstrip().endswith("raise NotImplementedError  # your code here")
    assert f'your_turn.check("{exercise}", {name})' in check.source
    assert f"`{name}(" in text.source                             # the text names the function
    for cell in (stub, check):
        assert not cell.outputs and cell.execution_count is None


# ---- the verdicts ---------------------------------------------------------------------

@pytest.mark.parametrize("exercise", EXERCISES)
def test_worked_answer_passes(exercise, capsys):
    answer = worked_answer(exercise)
    for seed in (0, 1):
        ok, out = run_check(exercise, answer, capsys, seed)
        assert ok is True, out
        assert out.startswith(f"✓ correct: {your_turn.EXERCISES[exercise].function}."), out
        assert out.count("\n") == 1                               # one line


@pytest.mark.parametrize("exercise", EXERCISES)
def test_shipped_stub_is_not_attempted_yet(exercise, capsys):
    ok, out = run_check(exercise, shipped_stub(exercise), capsys)
    assert ok is False
    assert "not attempted yet" in out and "not yet:" not in out


def test_errors_in_the_answer_are_reported_not_raised(capsys):
    def expand_kv_heads(keys, n_heads):
        groups = {}
        return np.repeat(keys, groups[n_heads], axis=1)

    ok, out = run_check("03_gqa", expand_kv_heads, capsys)
    assert ok is False
    assert out.startswith("not yet: expand_kv_heads, case 1 of ")
    assert "KeyError: 8" in out and "line 3 of expand_kv_heads" in out and "groups[n_heads]" in out


@pytest.mark.parametrize("expand", [
    lambda keys, n: keys[:, [h // (n // keys.shape[1]) for h in range(n)]],
    lambda keys, n: np.broadcast_to(keys[:, :, None], (keys.shape[0], keys.shape[1],
                                                        n // keys.shape[1], keys.shape[2])
                                    ).reshape(keys.shape[0], n, keys.shape[2]),
    lambda keys, n: np.repeat(keys, n // keys.shape[1], axis=1)[:, :, ::-1][:, :, ::-1]],
    ids=["fancy indexing", "broadcast view", "strided view"])
def test_a_right_answer_passes_whatever_its_memory_layout(expand, capsys):
    # (strided answers were refused by the check's own KVCache.append)
    ok, out = run_check("03_gqa", expand, capsys)
    assert ok is True, out


def test_answer_that_is_not_a_function(capsys):
    ok, out = run_check("04_paged", None, capsys)
    assert ok is False and "should be a function" in out


def test_unknown_exercise_is_the_notebooks_error():
    with pytest.raises(ValueError, match="03_gqa"):
        your_turn.check("03_gq", lambda keys, n_heads: keys)


# ---- plausible wrong answers: each fails, with a hint that points at the mistake --------

def _cached_loop(model, prompt_ids, n_new, feed_newest=True, cache_len=None, with_prompt=False):
    cache = model.new_cache(cache_len or len(prompt_ids) + n_new)
    logits = model.prefill(prompt_ids, cache)
    tokens = []
    for _ in range(n_new):
        tokens.append(int(np.argmax(logits)))
        logits = model.decode(tokens[-1] if feed_newest else prompt_ids[-1], cache)
    return list(prompt_ids) + tokens if with_prompt else tokens


def _uncached_loop(model, prompt_ids, n_new):
    ids = list(prompt_ids)
    for _ in range(n_new):
        ids.append(int(np.argmax(model.forward(ids))))
    return ids[len(prompt_ids):]


def _fit(config, memory_bytes, seq_len, cache_dtype="fp16", weights=True, dtype=True,
         kv_heads=True, rounding=lambda a, b: a // b, clamp=True):
    if not kv_heads:
        config = config.replace(n_kv_heads=config.n_heads)
    left = memory_bytes - (2 * config.n_params() if weights else 0)
    per = kvlab.kv_cache_bytes(config, seq_len, dtype=cache_dtype if dtype else "fp16")
    return max(0, rounding(left, per)) if clamp else rounding(left, per)


def _footprint(lengths, block_size, blocks_of, unused_of):
    return (sum(blocks_of(n, block_size) for n in lengths),
            sum(unused_of(n, block_size) for n in lengths))


def _ceil(n, b):
    return -(-n // b)


def _static(lengths, slots):
    return sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))


def _continuous(lengths, slots):
    waiting, running, steps = list(lengths), [], 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        running = [n - 1 for n in running if n > 1]
        steps += 1
    return steps


def _int8(x, divisor=127, rounding=np.rint, symmetric=True):
    x = np.asarray(x, dtype=np.float32)
    scale = np.float32((np.abs(x).max() if symmetric else x.max() - x.min()) / np.float32(divisor))
    return rounding(x / (scale if scale > 0 else 1)).astype(np.int8), scale


def _merge(a, b, rescale_acc=True, rescale_l=True, subtract_max=True, normalize=False):
    (acc1, m1, l1), (acc2, m2, l2) = a, b
    m = max(m1, m2)
    if subtract_max:
        r1, r2 = np.exp(m1 - m), np.exp(m2 - m)
    else:
        r1, r2 = np.exp(m1) / np.exp(m), np.exp(m2) / np.exp(m)
    acc = (r1 * acc1 + r2 * acc2) if rescale_acc else acc1 + acc2
    l = (r1 * l1 + r2 * l2) if rescale_l else l1 + l2
    return (acc / l, m, np.float32(1)) if normalize else (acc, m, l)


def _h2o(weights, n_keep, recent, rank_all=False, heavy_among_all=False, in_weight_order=False,
         ties_to_later=False, smallest=False):
    weights = np.asarray(weights)
    recent = min(recent, n_keep)
    if rank_all:                                  # the newest rows not set apart
        return np.sort(np.argsort(-weights, kind="stable")[:n_keep])
    older = len(weights) if heavy_among_all else len(weights) - recent
    scores = weights[:older] if smallest else -weights[:older]
    order = np.argsort(scores, kind="stable")
    if ties_to_later:
        order = np.argsort(-scores, kind="stable")[::-1]
    heavy = order[:n_keep - recent]
    newest = np.arange(len(weights) - recent, len(weights))
    if in_weight_order:
        return np.concatenate([heavy, newest])
    return np.sort(np.concatenate([heavy, newest]))
def _spec_step(model, cache, tokens, drafts, cut=0, own=True, stop=True, shift=0, one_pass=True):
    """One greedy speculative step, with the mistakes students make as switches."""
    if one_pass:
        rows = model.forward([tokens[-1]] + list(drafts), cache, all_logits=True)
    else:
        rows = [model.decode(t, cache) for t in [tokens[-1]] + list(drafts)]
    if stop:
        kept = 0
        while kept < len(drafts) and int(np.argmax(rows[min(kept + shift, len(drafts))])) == drafts[kept]:
            kept += 1
    else:                                          # counts every draft that matches its row
        kept = sum(int(np.argmax(rows[i])) == d for i, d in enumerate(drafts))
    out = list(drafts[:kept]) + ([int(np.argmax(rows[min(kept + shift, len(drafts))]))] if own else [])
    if cut is not None:
        cache.truncate(len(tokens) + kept + cut)
    return out


WRONG = [
    # (exercise, what the student wrote, words the hint must contain)
    ("01_kv_cache", _uncached_loop, "model.prefill"),
    ("01_kv_cache", lambda m, p, n: _cached_loop(m, p, n, feed_newest=False), "feed the token"),
    ("01_kv_cache", lambda m, p, n: _cached_loop(m, p, n, with_prompt=True), "without the prompt"),
    ("01_kv_cache", lambda m, p, n: _cached_loop(m, p, n, cache_len=len(p)), "needs room"),
    ("02_cache_size", lambda *a: _fit(*a, weights=False), "subtract them"),
    ("02_cache_size", lambda *a: _fit(*a, clamp=False), "return 0"),
    ("02_cache_size", lambda *a: _fit(*a, rounding=lambda x, y: -(-x // y)), "round down"),
    ("02_cache_size", lambda *a: _fit(*a, rounding=lambda x, y: x / y), "round down"),
    ("02_cache_size", lambda *a: _fit(*a, dtype=False), "format"),
    ("02_cache_size", lambda *a: _fit(*a, kv_heads=False), "n_kv_heads"),
    ("02_cache_size", lambda c, m, n, d: (_fit(c, m, n, d) if d != "int8" else max(
        0, (m - 2 * c.n_params()) // (2 * c.n_layers * c.n_kv_heads * c.head_dim * n))),
     "float32 scale"),
    ("03_gqa", lambda keys, n: np.tile(keys, (1, n // keys.shape[1], 1)), "np.tile"),
    ("03_gqa", lambda keys, n: np.repeat(keys, n // keys.shape[1], axis=2), "axis 1"),
    ("03_gqa", lambda keys, n: keys, "one slot per query head"),
    ("04_paged", lambda ls, b: _footprint(ls, b, lambda n, b: n // b + 1,
                                          lambda n, b: (n // b + 1) * b - n), "multiple of block_size"),
    ("04_paged", lambda ls, b: _footprint(ls, b, _ceil, lambda n, b: b - n % b if n else 0),
     "leaves 0 slots empty"),
    ("04_paged", lambda ls, b: _footprint(ls, b, lambda n, b: max(1, _ceil(n, b)),
                                          lambda n, b: max(1, _ceil(n, b)) * b - n), "takes no block"),
    ("05_batching", lambda ls, s: (_static(ls, s), _static(ls, s)), "does not wait for the group"),
    ("05_batching", lambda ls, s: (_static(ls, s), math.ceil(sum(ls) / s)), "perfect packing"),
    ("05_batching", lambda ls, s: (sum(ls), _continuous(ls, s)), "longest request"),
    ("06_quantization", lambda x: _int8(x, rounding=np.trunc), "truncates"),
    ("06_quantization", lambda x: (np.rint(x / (np.abs(x).max() / np.float32(127))).astype(np.int8),
                                   np.abs(x).max() / np.float32(127)), "divided 0 by 0"),
    ("06_quantization", lambda x: _int8(x, rounding=lambda v: np.floor(v + 0.5)), "halves to even"),
    ("06_quantization", lambda x: _int8(x, divisor=128), "not 128"),
    ("06_quantization", lambda x: _int8(x, divisor=255, symmetric=False), "not the range"),
    ("06_quantization", lambda x: (_int8(x)[0].astype(np.float32), _int8(x)[1]), "astype(np.int8)"),
    ("07_gpu_kernels", lambda a, b: _merge(a, b, rescale_acc=False, rescale_l=False), "own max"),
    ("07_gpu_kernels", lambda a, b: _merge(a, b, rescale_l=False), "own max"),
    ("07_gpu_kernels", lambda a, b: _merge(a, b, rescale_acc=False), "same rescaling as l"),
    ("07_gpu_kernels", lambda a, b: _merge(a, b, subtract_max=False), "overflows"),
    ("07_gpu_kernels", lambda a, b: _merge(a, b, normalize=True), "after the last merge"),
    ("07_gpu_kernels", lambda a, b: (_merge(a, b)[0], a[1], _merge(a, b)[2]), "max(m1, m2)"),
    ("08_fewer_positions", lambda w, n, r: _h2o(w, n, r, rank_all=True), "newest `recent` rows"),
    ("08_fewer_positions", lambda w, n, r: _h2o(w, n, r, heavy_among_all=True), "older rows only"),
    ("08_fewer_positions", lambda w, n, r: _h2o(w, n, r, in_weight_order=True), "increasing order"),
    ("08_fewer_positions", lambda w, n, r: _h2o(w, n, r, ties_to_later=True), "earlier row"),
    ("08_fewer_positions", lambda w, n, r: _h2o(w, n, r, smallest=True), "largest weights"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, cut=None), "still in the cache"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, cut=1), "first refused draft"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, own=False), "model's own"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, stop=False), "stop at the first"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, shift=1), "rows[i]"),
    ("09_speculative", lambda m, c, t, d: _spec_step(m, c, t, d, one_pass=False), "one pass"),
]


@pytest.mark.parametrize("exercise, answer, hint", WRONG,
                         ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(WRONG)])
def test_wrong_answer_fails_with_a_hint(exercise, answer, hint, capsys):
    for seed in (0, 1):
        ok, out = run_check(exercise, answer, capsys, seed)
        assert ok is False, out
        assert out.startswith("not yet: "), out
        # one failing case only: what it is, what was expected, what came back, a hint
        lines = out.splitlines()
        assert len(lines) in (3, 4) and lines[-2].startswith("  got:      "), out
        assert lines[-1].startswith("  hint:     ") and hint in lines[-1], out
