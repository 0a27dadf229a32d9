"""Hidden grading tests for lab 2 (your own KV cache). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

The student's cache, attention and forward pass run around the model lent to them
(kvlab/grading/handouts.py, ReferenceModel: the NumPy reference's layers over the bundled
MHA model's weights, or random weights of a shape drawn here: chapter 1's labs are MHA).
The model stays in the judge and logs every call the student's code makes to it. Their
logits are compared with kvlab.reference.forward run here without a cache; their tokens
with its greedy tokens; what each step ran through the model (one new token's embedding
and one row of q, k and v a layer, once the prompt is cached) with that log; their cache's
bytes with the chapter 2 formula; their step times with the time each step's forward pass
took as the model saw it.
"""
import functools
import time

import numpy as np

import kvlab
from kvlab import reference
from kvlab.grading.handouts import ReferenceModel
from kvlab.grading.testkit import as_array, mha_model, check_close, described, number, points

PROMPT = "ROMEO:\nBut soft"


@functools.lru_cache(maxsize=None)
def oracle(seq: tuple) -> np.ndarray:
    """The reference's logits for a whole sequence, without a cache."""
    model = mha_model()
    return reference.forward(model.config, model.weights, list(seq))


def prepare():
    mha_model()
    oracle(tuple(mha_model().encode(PROMPT)))


def prompt_of(rng, length=None):
    """A prompt of real text (a slice of the bundled model's own prompt, then random bytes)."""
    model = mha_model()
    ids = list(model.encode(PROMPT))
    n = length or int(rng.integers(3, len(ids) + 1))
    return ids[:n] if n <= len(ids) else ids + [int(t) for t in rng.integers(32, 127, n - len(ids))]


def greedy(prompt, n_new):
    """The reference's greedy tokens and each step's logits, without a cache."""
    tokens, steps = list(prompt), []
    for _ in range(n_new):
        logits = oracle(tuple(tokens))[-1]
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):], np.array(steps)


class Step:
    """One forward pass as the lent model saw it: the rows it embedded, the rows of each
    qkv call, when model.embed began and model.logits ended (time.perf_counter), and the
    seconds between."""

    def __init__(self, embed):
        self.rows, self.qkv_rows, self.started, self.ended = embed.rows, [], embed.started, None
        self.seconds = None


def steps_seen(log, what):
    """The forward passes in the lent model's log (kvlab/grading/handouts.py, Call): each is
    one model.embed, its layers, then one model.logits."""
    steps, step = [], None
    for call in log:
        if call.name == "embed":
            assert step is None, (
                f"{what}: model.embed was called again before model.logits ended the forward "
                f"pass it began: a forward pass is one embed, the layers, then one logits")
            step = Step(call)
        elif step is None:
            raise AssertionError(f"{what}: model.{call.name} was called outside a forward pass "
                                 f"(before model.embed began one)")
        elif call.name == "qkv":
            step.qkv_rows.append(call.rows)
        elif call.name == "logits":
            step.ended = call.ended
            step.seconds = call.ended - step.started
            steps.append(step)
            step = None
    assert step is None, f"{what}: a forward pass called model.embed but never model.logits"
    return steps


def check_decoding_reads_the_cache(steps, first, what, n_layers=None):
    """After a prefill of `first` tokens, each cached step ran exactly one new token: one
    embedding, and q, k and v of one row in every layer (the earlier K and V are cached)."""
    n_layers = n_layers or mha_model().config.n_layers
    rows = [s.rows for s in steps]
    want = [first] + [1] * (len(steps) - 1)
    assert rows == want, (
        f"{what}: with the cache, the prefill runs the prompt's {first} tokens and every later "
        f"step only the one new token (its K and V come from the cache); the model was asked "
        f"to embed {rows} tokens")
    for i, (step, n) in enumerate(zip(steps, want)):
        wider = [r for r in step.qkv_rows if r != n]
        assert len(step.qkv_rows) == n_layers and not wider, (
            f"{what}: step {i} embedded {n} token{'s' * (n != 1)}, so each of the "
            f"{n_layers} layers computes q, k and v of {n} row{'s' * (n != 1)} once; "
            f"model.qkv ran {step.qkv_rows} rows: with a cache the earlier tokens' K and V "
            f"are read from it, not computed again")



def first_wrong_step(got, want):
    """The first step whose logits are off, for a message that points at it."""
    error = np.abs(np.asarray(got, np.float64) - want).max(axis=1)
    bad = np.nonzero(error > 1e-4 + 1e-4 * np.abs(want).max(axis=1))[0]
    return int(bad[0]) if len(bad) else None


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@points(2)
def test_the_cache_keeps_what_was_appended(sub, rng):
    """KVCache grows layer by layer, one or many positions at a time, and counts its bytes"""
    n_layers, n_kv_heads, head_dim = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.choice([4, 8, 16]))
    cache = sub.KVCache(n_layers)
    assert cache.length == 0 and cache.nbytes == 0, (
        f"a new cache holds nothing: expected length 0 and nbytes 0, got {cache.length!r} and "
        f"{cache.nbytes!r}")
    kept_k = [np.zeros((0, n_kv_heads, head_dim), np.float32) for _ in range(n_layers)]
    kept_v = [np.zeros((0, n_kv_heads, head_dim), np.float32) for _ in range(n_layers)]
    for step, n in enumerate([int(rng.integers(2, 7)), 1, 1, int(rng.integers(2, 4))]):
        for layer in range(n_layers):
            k, v = normal(rng, n, n_kv_heads, head_dim), normal(rng, n, n_kv_heads, head_dim)
            cache.append(layer, k, v)
            kept_k[layer] = np.concatenate([kept_k[layer], k])
            kept_v[layer] = np.concatenate([kept_v[layer], v])
        length = len(kept_k[0])
        assert cache.length == length, f"after step {step}: expected length {length}, got {cache.length!r}"
        for layer in range(n_layers):
            for name, got, want in (("keys", cache.keys(layer), kept_k[layer]),
                                    ("values", cache.values(layer), kept_v[layer])):
                got = as_array(got, f"{name}({layer}) after {length} positions", shape=want.shape)
                assert np.array_equal(got, want), (
                    f"{name}({layer}) after {length} positions does not hold what was appended, "
                    f"in order")
        want_bytes = 2 * n_layers * length * n_kv_heads * head_dim * 4
        assert cache.nbytes == want_bytes, (
            f"{n_layers} layers x {length} positions x {n_kv_heads} KV heads x {head_dim} x 4 B, "
            f"for K and V: expected nbytes {want_bytes:,}, got {described(cache.nbytes)}")


@points(2)
def test_attention_matches_the_reference(sub, rng):
    """causal attention of a prefill and of a decode step, as kvlab.reference.attention"""
    for n_heads, n_kv_heads in ((1, 1), (4, 4), (8, 8)):
        head_dim, length = int(rng.choice([8, 16])), int(rng.integers(6, 20))
        keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
        for what, positions in (("a prefill of every position", np.arange(length)),
                                ("a decode step at the last position", np.array([length - 1])),
                                ("the last 3 positions", np.arange(length - 3, length))):
            q = normal(rng, len(positions), n_heads, head_dim)
            got = sub.attention(q, keys, values, positions)
            check_close(got, reference.attention(q, keys, values, positions),
                        f"{n_heads} head{'s' * (n_heads != 1)} of {head_dim}, {length} "
                        f"positions, {what} (position p sees 0..p)", atol=1e-5)


@points(2)
def test_forward_without_a_cache_matches_the_reference(sub, rng):
    """forward(model, tokens): every row of the logits, as the reference computes them"""
    model = ReferenceModel(checkpoint="mha")
    prompt = prompt_of(rng)
    got = sub.forward(model, prompt)
    check_close(got, oracle(tuple(prompt)), f"forward over {len(prompt)} tokens without a cache "
                                            f"(row t sees tokens 0..t)", atol=1e-4, rtol=1e-4)


@points(3)
def test_prefill_then_decode_matches_the_uncached_run(sub, rng):
    """the prompt into a cache, then one token at a time: each row as the uncached run's"""
    model = ReferenceModel(checkpoint="mha")
    prompt = prompt_of(rng)
    cache = sub.KVCache(mha_model().config.n_layers)
    got = sub.forward(model, prompt, cache)
    check_close(got, oracle(tuple(prompt)), f"the prefill of {len(prompt)} tokens into your cache",
                atol=1e-4, rtol=1e-4)
    tokens = list(prompt)
    for step in range(int(rng.integers(4, 9))):
        token = int(rng.integers(32, 127))
        tokens.append(token)
        got = as_array(sub.forward(model, [token], cache), f"decode step {step}")
        check_close(got[-1], oracle(tuple(tokens))[-1],
                    f"decode step {step} (token {token} at position {len(tokens) - 1}) against "
                    f"the last row of the uncached run over all {len(tokens)} tokens",
                    atol=1e-4, rtol=1e-4)
    assert cache.length == len(tokens), (
        f"after a prefill of {len(prompt)} and {len(tokens) - len(prompt)} decode steps the "
        f"cache holds {len(tokens)} positions; yours says {cache.length!r}")
    check_decoding_reads_the_cache(steps_seen(model.log, "the prefill and decode steps"),
                                   len(prompt), "forward(model, [token], cache)")


@points(3)
def test_greedy_tokens_are_the_same_with_and_without_the_cache(sub, rng):
    """generate with the cache and without it: the uncached reference's tokens, step by step"""
    model = ReferenceModel(checkpoint="mha")
    prompt, n_new = prompt_of(rng), int(rng.integers(12, 25))
    want_tokens, want_logits = greedy(prompt, n_new)
    for use_cache in (True, False):
        mode = "with your cache" if use_cache else "without a cache"
        seen = len(model.log)
        got = sub.generate(model, prompt, n_new, use_cache)
        assert isinstance(got, (tuple, list)) and len(got) == 2, (
            f"generate {mode}: expected (tokens, step_logits), got {described(got)}")
        tokens = [int(t) for t in got[0]]
        logits = as_array(got[1], f"{mode}: step logits", shape=want_logits.shape)
        step = first_wrong_step(logits, want_logits)
        if step is not None:
            check_close(logits[step], want_logits[step],
                        f"{mode}: step {step} (position {len(prompt) - 1 + step}), the first "
                        f"whose logits differ from the uncached reference's", atol=1e-4, rtol=1e-4)
        assert tokens == want_tokens, (f"{mode}: expected the tokens {want_tokens}, got {tokens}")
        steps = steps_seen(model.log[seen:], f"generate {mode}")
        rows = [step.rows for step in steps]
        if use_cache:
            check_decoding_reads_the_cache(steps, len(prompt), f"generate {mode}")
        else:
            assert rows == [len(prompt) + i for i in range(n_new)], (
                f"generate {mode}: every step runs the whole sequence so far (no cache); the "
                f"model was asked to run {rows} tokens")


@points(1)
def test_the_cache_holds_what_the_formula_says(sub, rng):
    """after a generation, the cache holds every position's K and V, 2 x n_layers x positions x n_kv_heads x head_dim x 4 bytes"""
    model = ReferenceModel(checkpoint="mha")
    c = mha_model().config
    prompt = prompt_of(rng)
    cache = sub.KVCache(c.n_layers)
    sub.forward(model, prompt, cache)
    decoded = rng.integers(32, 127, int(rng.integers(2, 6)))
    for token in decoded:
        sub.forward(model, [int(token)], cache)
    length = len(prompt) + len(decoded)
    want = kvlab.kv_cache_bytes(c, length, 1, "fp32")
    assert cache.nbytes == want, (
        f"{c.n_layers} layers x {length} positions x {c.n_kv_heads} KV heads x {c.head_dim} x 4 B "
        f"for K and V: expected {want:,} B, got {described(cache.nbytes)}")
    # the bytes counted are bytes held: the K and V of every position, as the reference's
    held = reference.ReferenceCache(c, max_seq_len=length)
    reference.forward(c, mha_model().weights, list(prompt) + [int(t) for t in decoded], held)
    for layer in range(c.n_layers):
        for name, kept in (("keys", held.key), ("values", held.value)):
            got = as_array(getattr(cache, name)(layer), f"{name}({layer})",
                           shape=(length, c.n_kv_heads, c.head_dim))
            check_close(got, kept[layer, :length], f"{name}({layer}) after a prefill of "
                        f"{len(prompt)} and {len(decoded)} decode steps: every position's, in "
                        f"order", atol=1e-4, rtol=1e-4)


def timing_shape(rng):
    """A model shape for the timing test, drawn now (the student cannot have timed it)."""
    n_heads = n_kv_heads = int(rng.choice([4, 8]))          # MHA, as the whole lab
    head_dim = int(rng.choice([32, 48]))
    return {"dim": n_heads * head_dim, "hidden_dim": 3 * n_heads * head_dim,
            "n_layers": int(rng.integers(2, 5)), "n_heads": n_heads, "n_kv_heads": n_kv_heads,
            "vocab_size": 256, "max_seq_len": 128}


def check_each_step_timed_alone(steps, times, call_started, call_ended, mode):
    """Each reported time is one step's own: it holds the step's forward pass (embed to
    logits) and fits in the step's slot, from the end of the forward pass before it to the
    start of the one after it. Both bounds hold however loaded the machine is: a clock read
    just before and just after a step cannot miss the step, and cannot see past its
    neighbours. A running total breaks the slot; an average or a made-up time misses a step.
    Most steps (not all: the machine may pause the student's process between its clock and
    the model) are also close to their forward pass, so a time spent mostly elsewhere fails."""
    slot_starts = [call_started] + [step.ended for step in steps[:-1]]
    slot_ends = [step.started for step in steps[1:]] + [call_ended]
    close = 0
    for i, (step, reported) in enumerate(zip(steps, times)):
        window = step.seconds
        assert reported >= 0.9 * window - 2e-4, (
            f"step_seconds {mode}, step {i}: you report {reported * 1e3:.3f} ms, but that "
            f"step's forward pass ran {window * 1e3:.3f} ms from model.embed to model.logits: "
            f"time each step itself (time.perf_counter before and after it)")
        slot = slot_ends[i] - slot_starts[i]
        assert reported <= slot + 5e-5, (
            f"step_seconds {mode}, step {i}: you report {reported * 1e3:.3f} ms, but only "
            f"{slot * 1e3:.3f} ms passed between the end of the forward pass before it and the "
            f"start of the one after it: time each step itself, not a running total")
        close += reported <= 1.5 * window + 3e-3
    assert close >= len(steps) / 2, (
        f"step_seconds {mode}: only {close} of your {len(steps)} step times are within 1.5x "
        f"+ 3 ms of their forward pass (model.embed to model.logits): time the forward pass "
        f"of each step, not the work around it")


@points(2)
def test_step_times_are_measured(sub, rng):
    """step_seconds on a model the grader picks: each step's own time, as the model saw the step run"""
    shape = timing_shape(rng)
    model = ReferenceModel(shape=shape, seed=int(rng.integers(1 << 30)))
    prompt, n_new = [int(t) for t in rng.integers(0, 256, int(rng.integers(2, 6)))], 24
    # No check that the uncached total is the larger: each time is tied to its own step
    # above, so the totals are the model's, and on this small model (most of a step is the
    # round trip of its calls between processes) a loaded machine could reverse them.
    for use_cache in (True, False):
        mode = "with your cache" if use_cache else "without a cache"
        seen = len(model.log)
        started = time.perf_counter()
        got = sub.step_seconds(model, prompt, n_new, use_cache)
        call = time.perf_counter() - started
        times = as_array(got, f"step_seconds {mode}", shape=(n_new,)).astype(np.float64)
        steps = steps_seen(model.log[seen:], f"step_seconds {mode}")
        assert len(steps) == n_new, (
            f"step_seconds {mode}: {n_new} steps run the model {n_new} times; it ran {len(steps)}")
        if use_cache:            # the cached run's times are a cached run's
            check_decoding_reads_the_cache(steps, len(prompt), f"step_seconds {mode}",
                                           shape["n_layers"])
        else:
            assert [step.rows for step in steps] == [len(prompt) + i for i in range(n_new)], (
                f"step_seconds {mode}: every step runs the whole sequence so far; the model "
                f"was asked to run {[step.rows for step in steps]} tokens")
        assert times.sum() <= call, (
            f"step_seconds {mode}: your steps add up to {times.sum():.4f} s, but the whole call "
            f"took {call:.4f} s as the grader saw it")
        check_each_step_timed_alone(steps, times, started, started + call, mode)


@points(1)
def test_fit_line(sub, rng):
    """the least-squares line through noisy points"""
    positions = np.arange(int(rng.integers(20, 60)))
    a, b = float(rng.uniform(1e-3, 1e-2)), float(rng.uniform(1e-5, 1e-3))
    seconds = a + b * positions + rng.normal(0, 1e-4, len(positions))
    got = sub.fit_line(positions.tolist(), seconds.tolist())
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"expected (a, b), got {described(got)}"
    want_b, want_a = np.polyfit(positions, seconds, 1)
    check_close(np.array([number(got[0], "a"), number(got[1], "b")]), np.array([want_a, want_b]),
                "the line (a, b) that minimizes the squared errors", atol=1e-9, rtol=1e-6)


@points(1)
def test_speedup_and_share_saved(sub, rng):
    """the 48-token speedup and the share of a step saved, from two lines"""
    cached = (float(rng.uniform(1e-3, 5e-3)), float(rng.uniform(0, 2e-6)))
    uncached = (float(rng.uniform(1e-3, 5e-3)), float(rng.uniform(1e-4, 5e-4)))
    prompt_len = int(rng.integers(1, 8))
    positions = prompt_len - 1 + np.arange(48)
    want = np.sum(uncached[0] + uncached[1] * positions) / np.sum(cached[0] + cached[1] * positions)
    got = number(sub.predicted_speedup(cached, uncached, prompt_len, 48), "predicted_speedup")
    check_close(np.array([got]), np.array([want]),
                f"cached {cached}, uncached {uncached}, a {prompt_len}-token prompt, 48 steps at "
                f"positions {prompt_len - 1}..{prompt_len + 46}", atol=0, rtol=1e-9)
    for position in (3, 9, int(rng.integers(10, 100))):
        want = 1 - (cached[0] + cached[1] * position) / (uncached[0] + uncached[1] * position)
        got = number(sub.share_saved(cached, uncached, position), "share_saved")
        check_close(np.array([got]), np.array([want]),
                    f"share saved at position {position}: 1 - cached(p) / uncached(p)", atol=1e-12)
