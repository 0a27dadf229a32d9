"""Self-checks for the "Your turn" exercise at the end of each course notebook.

Each notebook asks you to write one small function, then checks it in the next cell:

    from kvlab import your_turn
    your_turn.check("03_gqa", expand_kv_heads)

`check` runs your function on a few cases, fixed and random, compares each answer with
what kvlab's own machinery says (the NumPy reference, the C core, the paged pool, the
engine, kvlab.quant, ...), prints a verdict and returns True or False:

    not attempted yet       your function still raises NotImplementedError
    ✓ correct: ...          every case agrees; one line on what it shows
    not yet: ...            the first case that disagrees: what was expected, what your
                            function gave (or the error it raised), and a hint

Nothing your function does makes `check` raise: its errors are reported, not passed on.
EXERCISES lists the exercises: notebook -> (function to write, what it does).
"""
from __future__ import annotations

import math
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

import numpy as np

from . import cluster, load, quant, reference
from . import weight_quantization as wq
from .cache_policy import HeavyHitters, most_attended
from .config import ModelConfig
from .engine import Engine
from .errors import CacheFullError
from .generate import generate
from .measure import kv_cache_bytes, weights_bytes
from .questions import numbers as question_numbers
from .model import KVCache
from .scheduler import SamplingParams
from .speculative import PromptLookup


class Exercise(NamedTuple):
    function: str       # the name of the function the notebook asks you to write
    description: str    # what it does, in one line


EXERCISES = {
    "01_kv_cache": Exercise(
        "greedy_with_cache",
        "greedy generation over a KV cache (prefill once, then one decode per token) that "
        "gives the uncached run's tokens"),
    "02_cache_size": Exercise(
        "requests_that_fit",
        "how many requests of a given length fit in a memory budget next to the fp16 weights"),
    "03_gqa": Exercise(
        "expand_kv_heads",
        "repeat each K/V head for its group of query heads, so that plain MHA attention "
        "equals GQA attention"),
    "04_paged": Exercise(
        "pool_footprint",
        "the blocks a paged pool hands out for some sequence lengths, and the slots left "
        "empty in them"),
    "05_batching": Exercise(
        "batching_steps",
        "the steps static and continuous batching take to serve the same requests"),
    "06_quantization": Exercise(
        "int8_quantize_group",
        "symmetric int8 quantization of one group: codes and scale, bit for bit with kvlab's"),
    "07_gpu_kernels": Exercise(
        "merge_states",
        "merge two flash-decoding partial states (acc, m, l) into the state of both ranges"),
    "08_fewer_positions": Exercise(
        "h2o_keep",
        "the rows an H2O cache keeps for one layer and KV head: the newest, and the older "
        "rows that have received the most attention"),
    "09_speculative": Exercise(
        "speculative_step",
        "one greedy speculative step: verify the drafts in one pass over the cache, keep the "
        "agreed prefix and the model's own token, truncate the rest"),
    "10_weight_quantization": Exercise(
        "awq_error",
        "the output error of a layer whose matrix is stored in Q4_0 with AWQ's scales for "
        "one alpha"),
    "11_serving_at_scale": Exercise(
        "reused_tokens",
        "the tokens of each prompt that a prefix cache holding the earlier prompts reuses, "
        "in full blocks of block_size (block_size 1: a radix tree)"),
}


def check(exercise: str, answer: Callable, seed: Optional[int] = None) -> bool:
    """Check your function for one exercise ("03_gqa", ...: see EXERCISES). Prints the
    verdict and returns True when every case agrees. seed fixes the random cases."""
    if exercise not in EXERCISES:
        raise ValueError(f"no exercise {exercise!r}; the exercises are {', '.join(EXERCISES)}")
    name = EXERCISES[exercise].function
    if not callable(answer):
        print(f"not yet: `{name}` should be a function; got {_short(answer)}.")
        return False
    rng = np.random.default_rng(seed)
    try:
        takeaway = _CHECKS[exercise](answer, rng)
    except _NotAttempted:
        print(f"{name}: not attempted yet. Replace `raise NotImplementedError` in the cell "
              f"above with your code, run that cell, then run this one again.")
        return False
    except _NotYet as verdict:
        print(f"not yet: {name}, {verdict}")
        return False
    except Exception as error:      # something in the answer our comparison did not expect
        print(f"not yet: {name}: its answer could not be checked "
              f"({type(error).__name__}: {error}). Check what your function returns.")
        return False
    print(f"✓ correct: {name}. {takeaway}")
    return True


def answer(chapter: str, question: int, value) -> bool:
    """Check your answer to a "Check yourself" question whose answer is a number:
    `answer("02_cache_size", 6, 40960)`. Prints the verdict and returns True when the
    answer is close enough (each question sets how close: most within 1 %). The kit works
    the expected answer out itself, from its own functions or the chapter's measurements."""
    table = question_numbers(chapter)
    if question not in table:
        asked = ", ".join(str(n) for n in sorted(table)) or "none"
        raise ValueError(f"chapter {chapter} has no number question {question!r}; "
                         f"its number questions are: {asked}")
    wanted = table[question]
    try:
        if isinstance(value, bool):
            raise TypeError("a truth value is not a number")
        got = float(value)
    except (TypeError, ValueError):
        print(f"not yet: question {question} of {chapter} wants a number "
              f"({wanted.unit}); got {_short(value)}.")
        return False
    if wanted.whole and not (math.isfinite(got) and got.is_integer()):
        print(f"not yet: question {question} of {chapter} counts {wanted.unit}: a whole "
              f"number; got {_number(got)}.")
        return False
    expected = float(wanted.expected())
    if math.isfinite(got) and math.isclose(got, expected, rel_tol=wanted.rel_tol):
        print(f"✓ correct: question {question} of {chapter}: your {_number(got)} "
              f"({wanted.unit}); the kit works out {_number(expected)}.")
        return True
    hint = f" Hint: {wanted.hint}" if wanted.hint else ""
    how_far = (f"is more than {wanted.rel_tol * 100:g}% away from the answer" if wanted.rel_tol > 0
               else "is not the answer")
    print(f"not yet: question {question} of {chapter}: {_number(got)} ({wanted.unit}) "
          f"{how_far}.{hint}")
    return False


def _number(x: float) -> str:
    """A whole number in full (1,073,741,824), any other to six significant digits."""
    return f"{int(x):,}" if math.isfinite(x) and x == int(x) and abs(x) < 1e18 else f"{x:,.6g}"


# ---- the machinery every check shares ---------------------------------------------------

class _NotAttempted(Exception):
    """The function still raises NotImplementedError."""


class _NotYet(Exception):
    """A case the function got wrong: what was expected, what it gave, a hint."""

    def __init__(self, case: str, expected: Optional[str], got: str, hint: str):
        lines = [case] + ([f"  expected: {expected}"] if expected is not None else [])
        super().__init__("\n".join(lines + [f"  got:      {got}", f"  hint:     {hint}"]))


def _call(answer: Callable, case: str, *args, hints: Optional[dict] = None):
    """answer(*args); its exceptions become a "not yet" that says where they happened."""
    try:
        return answer(*args)
    except NotImplementedError:
        raise _NotAttempted() from None
    except Exception as error:
        where = _where(answer, error)
        hint = "your function raised an error: fix that first" + (
            " (the line it came from is shown above)" if where else "")
        for kind, text in (hints or {}).items():
            if isinstance(error, kind):
                hint = text
        raise _NotYet(case, None, f"{type(error).__name__}: {error}{where}", hint) from None


def _where(answer: Callable, error: Exception) -> str:
    """' (line 3 of f: x = ...)': the last line of your code the error passed through
    (not kvlab's, not NumPy's)."""
    library = (str(Path(__file__).parent), str(Path(np.__file__).parent))
    frames = [f for f in traceback.extract_tb(error.__traceback__)[1:]    # [0] is _call
              if not f.filename.startswith(library)]
    if not frames:
        return ""
    frame, code = frames[-1], getattr(answer, "__code__", None)
    if code is not None and (frame.filename, frame.name) == (code.co_filename, code.co_name):
        return f" (line {frame.lineno - code.co_firstlineno + 1} of {frame.name}: {frame.line})"
    return f" (in {frame.name}: {frame.line})"


def _short(value, limit: int = 70) -> str:
    """A value in at most `limit` characters (arrays by shape and a few numbers)."""
    if isinstance(value, np.ndarray):
        text = f"array of shape {value.shape}, dtype {value.dtype}"
        if value.size:
            shown = np.array2string(value.ravel()[:6], precision=4, separator=", ")
            text += f": {shown[:-1]}{', ...' if value.size > 6 else ''}]"
        return text
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


@lru_cache(maxsize=1)
def _model():
    """The bundled model (loaded once)."""
    return load()


# ---- 01: the KV cache ---------------------------------------------------------------------

def _check_kv_cache(answer, rng) -> str:
    model = _model()
    cases = [("'ROMEO:\\n' and 16 new tokens", model.encode("ROMEO:\n"), 16),
             ("'JULIET:' and 1 new token (only the prompt's logits are needed)",
              model.encode("JULIET:"), 1)]
    for _ in range(3):
        ids = rng.integers(0, model.config.vocab_size, int(rng.integers(1, 40))).tolist()
        cases.append((f"a random prompt of {len(ids)} token ids", ids, int(rng.integers(2, 40))))
    ran = []                      # tokens each case's loop ran through the model
    for number, (what, prompt, n_new) in enumerate(cases, 1):
        case = f"case {number} of {len(cases)}: {what}, n_new={n_new}"
        expected = _uncached(model, prompt, n_new).tokens
        with model.counting() as counts:
            got = _call(answer, case, model, list(prompt), n_new, hints={
                CacheFullError: "the cache needs room for the prompt and every token "
                                     "you decode: model.new_cache(len(prompt_ids) + n_new)"})
        try:
            got = [int(t) for t in got]
        except Exception:
            raise _NotYet(case, f"a list of {n_new} token ids", _short(got),
                          "return the new token ids as a list of ints") from None
        if got[:len(prompt)] == list(prompt) and len(got) == len(prompt) + n_new:
            raise _NotYet(case, f"{n_new} new token ids", f"{len(got)} ids, the prompt's first",
                          "return only the generated tokens, without the prompt")
        if len(got) != n_new:
            raise _NotYet(case, f"{n_new} token ids", f"{len(got)} token ids: {_short(got)}",
                          "one token per step, n_new steps")
        if got != expected:
            first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            hint = ("the first token is the arg-max of the prompt's logits (from prefill)"
                    if first == 0 else
                    "each step must feed the token it just chose: logits = model.decode(token, "
                    "cache), and the prompt goes in once, with prefill")
            raise _NotYet(case, f"kvlab.generate(model, prompt, {n_new}, use_cache=False).tokens",
                          f"token {first} differs ({got[first]} where the uncached run chose "
                          f"{expected[first]})", hint)
        # the least is len(prompt) + n_new - 1 (the last token chosen is never fed back);
        # a loop that also feeds it, one decode per new token, is still a cached loop
        most = len(prompt) + n_new
        ran.append(counts.tokens)
        if counts.tokens > most:
            raise _NotYet(case, f"each token through the model once: at most {most} tokens run",
                          f"{counts.tokens} tokens run through the model (the right tokens, "
                          f"but recomputed)",
                          "run the prompt once with model.prefill(prompt_ids, cache), then "
                          "model.decode(token, cache) for one new token per step: no "
                          "model.forward over the whole sequence")
    prompt, n_new = cases[0][1], cases[0][2]
    least = len(prompt) + n_new - 1
    extra = ("" if ran[0] == least else
             f" (the least is {least}: the last token chosen never needs to run through the "
             f"model, as nothing comes after it)")
    return (f"Your cached loop gives the uncached run's tokens exactly, and for {n_new} tokens "
            f"after 'ROMEO:\\n' it runs {ran[0]} tokens through the model{extra} where "
            f"the uncached loop runs {_uncached(model, prompt, n_new).counts.tokens}: the cache "
            f"keeps what the uncached loop computes again at every step.")


def _uncached(model, prompt, n_new):
    """kvlab.generate without a cache (greedy, never stopping early)."""
    return generate(model, list(prompt), n_new, use_cache=False, stop_at_eos=False)


# ---- 02: how big is the cache -------------------------------------------------------------

def _fit(config, memory_bytes, seq_len, cache_dtype):
    """kvlab's answer: what the weights leave, in whole requests (never below 0)."""
    left = memory_bytes - weights_bytes(config, "fp16")
    return max(0, left // kv_cache_bytes(config, seq_len, dtype=cache_dtype))


def _check_cache_size(answer, rng) -> str:
    C = ModelConfig
    GB = 10 ** 9
    cases = [(C.llama2_7b(), 80 * GB, 4096, "fp16"),
             (C.llama2_7b(), 80 * GB, 4096, "int8"),
             (C.llama3_8b(), 80 * GB, 8192, "fp16"),
             (C.llama2_70b(), 80 * GB, 4096, "fp16"),            # the weights alone are 138 GB
             (C.tinyllama_1b(), 24 * 2 ** 30, 2048, "fp16"),
             (_model().config, 8 * 2 ** 20, 512, "fp32")]
    presets = list(C.presets().values())
    for _ in range(3):
        config = presets[int(rng.integers(len(presets)))]
        seq_len = int(rng.integers(1, config.max_seq_len + 1))
        dtype = ["fp16", "bf16", "int8", "fp32"][int(rng.integers(4))]
        per_request = kv_cache_bytes(config, seq_len, dtype=dtype)
        whole = int(rng.integers(0, 40))            # exactly `whole` requests fit, plus a bit
        memory = weights_bytes(config, "fp16") + whole * per_request + int(rng.integers(per_request))
        cases.append((config, memory, seq_len, dtype))
    for number, (config, memory, seq_len, dtype) in enumerate(cases, 1):
        case = (f"case {number} of {len(cases)}: {config.name}, {memory:,} bytes of memory, "
                f"requests of {seq_len:,} tokens, {dtype} cache")
        expected = _fit(config, memory, seq_len, dtype)
        got = _call(answer, case, config, memory, seq_len, dtype)
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer, float, np.floating)):
            raise _NotYet(case, f"a whole number of requests ({expected})", _short(got),
                          "return a number: how many requests fit")
        if got == expected and not isinstance(got, (int, np.integer)):
            raise _NotYet(case, f"the whole number {expected}", _short(got),
                          "return an int: a request fits whole or not at all (// of floats "
                          "is still a float; int(...) makes it a whole number)")
        if got == expected:
            continue
        left = memory - weights_bytes(config, "fp16")
        per_request = kv_cache_bytes(config, seq_len, dtype=dtype)
        mha = kv_cache_bytes(config.replace(n_kv_heads=config.n_heads), seq_len, dtype=dtype)
        no_scales = 2 * config.n_layers * config.n_kv_heads * config.head_dim * seq_len
        if left < 0 and got < 0:
            hint = "when the weights alone do not fit, no request does: return 0, not a negative number"
        elif dtype == "int8" and got == max(0, left // no_scales):
            hint = ("an int8 cache is 1 byte per value plus a float32 scale per group of values "
                    "(per head, by default): kvlab.kv_cache_bytes(config, seq_len, "
                    "dtype='int8') counts them")
        elif got == memory // per_request:
            hint = ("the weights are in memory too: subtract them first (fp16: 2 bytes x "
                    "config.n_params())")
        elif got == expected + 1 or math.isclose(got, left / per_request):
            hint = "round down: a request that does not fit whole does not fit"
        elif config.n_kv_heads != config.n_heads and got == max(0, left // mha):
            hint = "the cache holds K and V for the KV heads (n_kv_heads), not the query heads"
        elif got in {max(0, left // kv_cache_bytes(config, seq_len, dtype=forgot))
                     for forgot in ("fp16", "fp32") if forgot != dtype}:   # not passed on
            hint = ("the cache's format changes its bytes: pass it on, "
                    "kvlab.kv_cache_bytes(config, seq_len, dtype=cache_dtype)")
        else:
            hint = ("requests = (memory - fp16 weights) // (bytes of one request's cache); "
                    "kvlab.kv_cache_bytes(config, seq_len, dtype=cache_dtype) is the latter")
        raise _NotYet(case, f"{expected:,} requests", _short(got), hint)
    c7 = C.llama2_7b()
    return (f"On an 80 GB GPU the fp16 Llama 2 7B weights leave room for "
            f"{_fit(c7, 80 * GB, 4096, 'fp16')} requests of 4,096 tokens with an fp16 cache, "
            f"{_fit(c7, 80 * GB, 4096, 'int8')} with int8; Llama 3 8B, with 8 KV heads instead "
            f"of 32, fits {_fit(C.llama3_8b(), 80 * GB, 4096, 'fp16')}. The cache, not the "
            f"model, sets how many requests a server can hold.")


# ---- 03: GQA ------------------------------------------------------------------------------

def _check_gqa(answer, rng) -> str:
    shapes = [(5, 2, 8, 4), (6, 8, 8, 4), (7, 1, 8, 4)]     # positions, KV heads, query heads, head_dim
    for _ in range(3):
        n_kv = int(rng.choice([1, 2, 4, 8]))
        shapes.append((int(rng.integers(1, 40)), n_kv, n_kv * int(rng.choice([1, 2, 4, 8])),
                       int(rng.choice([4, 8, 16, 64]))))
    for number, (n_pos, n_kv, n_heads, d) in enumerate(shapes, 1):
        kind = "MHA" if n_kv == n_heads else "MQA" if n_kv == 1 else "GQA"
        case = (f"case {number} of {len(shapes)} ({kind}): keys of shape {(n_pos, n_kv, d)}, "
                f"n_heads={n_heads}")
        kv_mul = n_heads // n_kv
        expected_map = [h // kv_mul for h in range(n_heads)]
        # K/V head j is filled with the number j (plus a little noise on every value):
        # which K/V head a slot of the answer copies can be read off it
        labels = np.arange(n_kv, dtype=np.float32)[None, :, None]
        keys = (labels + 0.01 * rng.standard_normal((n_pos, n_kv, d))).astype(np.float32)
        values = rng.standard_normal((n_pos, n_kv, d)).astype(np.float32)
        keys_before = keys.copy()
        got = np.asarray(_call(answer, case, keys, n_heads))
        if not np.array_equal(keys, keys_before):
            raise _NotYet(case, "keys left as they were", "your function changed its input",
                          "build a new array instead of writing into keys")
        if got.shape != (n_pos, n_heads, d):
            hint = "one slot per query head on axis 1: (n_positions, n_heads, head_dim)"
            if got.shape == (n_pos, n_kv, d * kv_mul):
                hint = "repeat along axis 1, the head axis, not the last one"
            raise _NotYet(case, f"shape {(n_pos, n_heads, d)}", f"shape {got.shape}", hint)
        read = [int(np.rint(got[:, h].mean())) for h in range(n_heads)]
        if read != expected_map or not np.array_equal(got, np.repeat(keys, kv_mul, axis=1)):
            hint = "query head h reads K/V head h // kv_mul (kv_mul = n_heads // n_kv_heads)"
            if read == [h % n_kv for h in range(n_heads)]:
                hint = ("that interleaves the groups (np.tile, h % n_kv_heads); GQA groups "
                        "consecutive query heads: h // kv_mul, as np.repeat does")
            raise _NotYet(case, f"query head h -> K/V head {expected_map}",
                          f"query head h -> K/V head {read}" if read != expected_map else
                          "the right heads, but values that differ from the K/V rows",
                          hint)
        # MHA over the expansion must be GQA over the original, in NumPy and in the C core
        q = rng.standard_normal((1, n_heads, d)).astype(np.float32)
        last = np.array([n_pos - 1])
        v_wide = np.asarray(_call(answer, case, values, n_heads))
        mha = reference.attention(q, got, v_wide, last)
        gqa = reference.attention(q, keys, values, last)
        if not np.allclose(mha, gqa, atol=1e-5):
            raise _NotYet(case, "MHA attention over your K and V = GQA attention over the originals",
                          f"outputs differ by {np.abs(mha - gqa).max():.2e}",
                          "expanding the values must follow the same rule as the keys")
        c_mha = KVCache(1, n_heads, d, n_pos)
        # (any layout of a right answer: fancy indexing and broadcast views are strided)
        c_mha.append(np.ascontiguousarray(got[:, None], dtype=np.float32),
                     np.ascontiguousarray(v_wide[:, None], dtype=np.float32))
        c_gqa = KVCache(1, n_kv, d, n_pos)
        c_gqa.append(keys[:, None], values[:, None])
        if not np.allclose(c_mha.attend(q[0]), c_gqa.attend(q[0]), atol=1e-5):
            raise _NotYet(case, "the C core's MHA attention over your K and V = its GQA attention",
                          "they differ", "query head h reads K/V head h // kv_mul")
    return ("Plain MHA attention over the expanded K and V equals GQA attention, in the NumPy "
            "reference and in the C core. The expanded copy is kv_mul times the cache (4x for "
            "the bundled model): GQA saves by never making it, and the C kernel reads each K/V "
            "row once for its whole group of query heads.")


# ---- 04: paged memory ---------------------------------------------------------------------

def _pool_says(lengths, block_size):
    """(blocks used, slots unused) of a real pool holding sequences of these lengths."""
    model, rng = _model(), np.random.default_rng(0)
    c = model.config
    blocks = sum(-(-n // block_size) for n in lengths)
    pool = model.new_paged_pool(num_blocks=max(blocks, 1), block_size=block_size,
                                max_seqs=max(len(lengths), 1))
    for i, n in enumerate(lengths):
        seq = pool.new_sequence()
        if n:
            # distinct tokens for each sequence, so that no two share a block by prefix
            tokens = np.concatenate([[i], rng.integers(0, 256, n - 1)]).astype(np.int32)
            rows = np.zeros((n, c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
            pool.append(seq, tokens, rows, rows)
    s = pool.stats()
    return s.blocks_used, s.slots_unused


def _check_paged(answer, rng) -> str:
    cases = [([18], 4), ([16, 32], 16), ([0, 1, 5], 4), ([100, 7, 64], 1)]
    for _ in range(3):
        cases.append((rng.integers(0, 200, int(rng.integers(1, 12))).tolist(),
                      int(rng.choice([2, 3, 4, 8, 16, 32, 64]))))
    chat = np.clip(rng.lognormal(4.6, 0.8, 64), 8, 512).astype(int).tolist()   # as in the notebook
    cases.append((chat, 16))
    for number, (lengths, block_size) in enumerate(cases, 1):
        shown = _short(lengths, 50)
        case = f"case {number} of {len(cases)}: lengths {shown}, block_size={block_size}"
        expected = _pool_says(lengths, block_size)
        got = _call(answer, case, list(lengths), block_size)
        try:
            blocks, unused = (int(v) for v in got)
        except Exception:
            raise _NotYet(case, "a pair (blocks, unused_slots)", _short(got),
                          "return two whole numbers: return blocks, unused") from None
        if (blocks, unused) == expected:
            continue
        full = [n for n in lengths if n and n % block_size == 0]
        wrong_last = sum(n // block_size + 1 for n in lengths)
        if blocks != expected[0] and full and blocks == wrong_last:
            hint = ("a length that is a multiple of block_size fills its last block exactly: "
                    "ceil(n / block_size) blocks, -(-n // block_size) in whole numbers")
        elif blocks != expected[0] and 0 in lengths and blocks == expected[0] + lengths.count(0):
            hint = "an empty sequence (length 0) takes no block"
        elif blocks != expected[0]:
            hint = "each sequence takes ceil(length / block_size) blocks of its own"
        elif full and unused == expected[1] + block_size * len(full):
            hint = "a full last block leaves 0 slots empty, not block_size"
        else:
            hint = "the empty slots are those of each sequence's last block past its length"
        raise _NotYet(case, f"{expected} (what pool.stats() says after filling a pool)",
                      f"{(blocks, unused)}", hint)
    blocks, unused = expected                       # the last case: the chat-like lengths
    contiguous_empty = 100 * (1 - sum(chat) / (512 * len(chat)))
    return (f"The paged pool agrees. Each sequence wastes less than one block: for 64 chat-like "
            f"requests in blocks of 16, {unused:,} of {blocks * 16:,} slots are empty "
            f"({100 * unused / (blocks * 16):.1f} %), where contiguous caches of 512 positions "
            f"would leave {contiguous_empty:.0f} % empty.")


# ---- 05: batching -------------------------------------------------------------------------

def _engine_steps(lengths, slots):
    """Forward calls kvlab.Engine makes for requests of 1-token prompts that generate
    `lengths` tokens, at most `slots` sequences per step, all added at once."""
    model = _model()
    block_size = 16
    blocks = sum(-(-(n + 1) // block_size) for n in lengths) + 1
    pool = model.new_paged_pool(num_blocks=blocks, block_size=block_size, max_seqs=len(lengths))
    engine = Engine(model, pool, max_batch_seqs=slots)
    for i, n in enumerate(lengths):
        engine.add_request([i % 256], SamplingParams(max_new_tokens=n, stop_at_eos=False))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps


def _check_batching(answer, rng) -> str:
    cases = [([3, 1, 2], 2), ([5, 5, 5, 5], 2), ([10] * 7 + [120], 8), ([1, 9, 1, 9, 1], 1),
             ([30, 2, 2, 2, 2, 2, 2], 2)]
    for _ in range(3):
        cases.append((rng.integers(1, 40, int(rng.integers(2, 12))).tolist(), int(rng.integers(1, 5))))
    workload = np.clip(rng.lognormal(3.0, 1.1, 24), 1, 150).astype(int).tolist()
    cases.append((workload, 8))
    for number, (lengths, slots) in enumerate(cases, 1):
        case = f"case {number} of {len(cases)}: output_lengths {_short(lengths, 50)}, slots={slots}"
        static = sum(_engine_steps(lengths[i:i + slots], slots) for i in range(0, len(lengths), slots))
        continuous = _engine_steps(lengths, slots)
        got = _call(answer, case, list(lengths), slots)
        try:
            got_static, got_continuous = (int(v) for v in got)
        except Exception:
            raise _NotYet(case, "a pair (static_steps, continuous_steps)", _short(got),
                          "return two whole numbers: return static, continuous") from None
        if got_static != static:
            raise _NotYet(case, f"static batching: {static} steps (kvlab.Engine, one group at a time)",
                          f"{got_static}",
                          "a static group runs until its longest request is done; the groups "
                          "are the requests in order, `slots` at a time")
        if got_continuous != continuous:
            if got_continuous == math.ceil(sum(lengths) / slots):
                hint = ("that is perfect packing; a request keeps its slot from its first step "
                        "to its last, and requests start in order: simulate the steps")
            elif got_continuous == static:
                hint = ("continuous batching does not wait for the group: a finished request's "
                        "slot goes to the next waiting request at the next step")
            else:
                hint = ("simulate it: each step, fill free slots with waiting requests in order, "
                        "run one token of every running request, remove the finished ones")
            raise _NotYet(case, f"continuous batching: {continuous} steps (kvlab.Engine, "
                          f"max_batch_seqs={slots})", f"{got_continuous}", hint)
    # static and continuous are the last case's: the chat-like workload
    return (f"kvlab's engine agrees. For 24 requests of chat-like lengths and 8 slots, static "
            f"batching takes {static} steps and continuous batching {continuous}: "
            f"{static / continuous:.1f}x fewer forward calls, and every call reads all the "
            f"weights once, whatever the batch.")


# ---- 06: quantization ---------------------------------------------------------------------

def _check_quantization(answer, rng) -> str:
    halves = np.array([127, 1.5, 2.5, -2.5, 0.5, -127, 3, 0], dtype=np.float32)  # scale exactly 1
    row = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    row[3] = 4.0                                        # the notebook's row: one large value
    groups = [("halves round to even: max |x| = 127, so the scale is 1", halves),
              ("the notebook's row of 16 with one large value", row)]
    for _ in range(4):
        d = int(rng.choice([8, 16, 32, 64, 128]))
        x = (rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
        groups.append((f"a random group of {d} values", x))
    groups.append(("an all-zero group", np.zeros(16, dtype=np.float32)))
    for number, (what, x) in enumerate(groups, 1):
        case = f"case {number} of {len(groups)}: {what}"
        q = quant.quantize(x, "int8")                   # one group: all of x
        want_codes, want_scale = q.codes, q.scales[0]
        cache = KVCache(1, 1, len(x), 1, key_format="int8", value_format="int8")
        cache.append(x[None, None, None], x[None, None, None])
        want_codes_c, want_scale_c = cache.key_codes[0, 0, 0], cache.key_scales[0, 0, 0, 0]
        zero_hint = "an all-zero group has scale 0: divide by 1 instead, so its codes are 0"
        # An all-zero group divided by its scale is 0 / 0: NaN, which astype(np.int8) turns
        # into whatever the machine makes of it (0 on x86, so the codes would look right).
        with np.errstate(all="raise" if not np.abs(x).max() else "ignore"):
            got = _call(answer, case, x.copy(), hints={
                FloatingPointError: zero_hint + " (here it divided 0 by 0)"})
        try:
            codes, scale = got
            codes, scale = np.asarray(codes), np.asarray(scale, dtype=np.float32)
        except Exception:
            raise _NotYet(case, "a pair (codes, scale)", _short(got),
                          "return codes, scale") from None
        if scale.size != 1:
            raise _NotYet(case, "one scale for the whole group", f"scale {_short(scale)}",
                          "the scale is a single number: max|x| / 127")
        scale = np.float32(scale.reshape(()))
        if scale != want_scale:
            top = np.abs(x).max()
            if top and math.isclose(scale, top / 128, rel_tol=1e-6):
                hint = "divide by 127, not 128: the largest value must become +-127 exactly"
            elif top and math.isclose(scale, (x.max() - x.min()) / 255, rel_tol=1e-6):
                hint = "symmetric int8 uses max|x| / 127, not the range / 255"
            elif not top:
                hint = "an all-zero group has scale 0"
            else:
                hint = "scale = max|x| / 127 over the group, in float32"
            raise _NotYet(case, f"scale {want_scale}", f"scale {scale}", hint)
        if codes.shape != want_codes.shape or not np.array_equal(codes, want_codes):
            if not np.isfinite(codes.astype(np.float64)).all() or (not np.abs(x).max()
                                                                  and codes.any()):
                hint = zero_hint
            elif codes.shape != want_codes.shape:
                hint = "one code per value of x"
            else:
                wrong = np.flatnonzero(codes.astype(np.int64) != want_codes.astype(np.int64))
                exact = (x / np.where(want_scale > 0, want_scale, 1))[wrong]
                if np.array_equal(codes.astype(np.int64)[wrong], np.trunc(exact)):
                    hint = "round to the nearest integer (np.rint) first: astype(np.int8) alone truncates"
                elif np.all(np.abs(exact - np.trunc(exact)) == 0.5):
                    hint = "round halves to even with np.rint (2.5 -> 2, 3.5 -> 4), as C's nearbyintf"
                else:
                    hint = ("codes = np.rint(x / scale) in float32 arithmetic: divide by the "
                            "scale (multiplying by 1 / scale rounds differently now and then)")
                i = wrong[0]
                raise _NotYet(case, f"codes[{i}] = {want_codes[i]} (x[{i}] / scale = {exact[0]})",
                              f"codes[{i}] = {codes[i]}", hint)
            raise _NotYet(case, f"codes {_short(want_codes)}", f"codes {_short(codes)}", hint)
        if not (np.array_equal(codes, want_codes_c) and scale == want_scale_c):
            raise _NotYet(case, "the codes and scale an int8 KVCache stores for x",
                          "different ones", "follow kvlab.quant's rule exactly (see above)")
        if codes.dtype != np.int8:
            raise _NotYet(case, "codes stored as int8 (1 byte each)", f"dtype {codes.dtype}",
                          "convert them: codes.astype(np.int8)")
        error = np.abs(codes.astype(np.float32) * scale - x)
        if not (error <= quant.round_trip_error_bound(x, "int8")).all():
            raise _NotYet(case, "every value back within half a step, max|x| / 254",
                          f"an error of {error.max():.3g}", "codes * scale should give x back")
    return ("Your codes and scales equal kvlab.quant's and the C int8 cache's, bit for bit, and "
            "every value comes back within half a step (max|x| / 254). For the bundled model's "
            "heads of 16 values that is 1.25 bytes per value instead of 4.")


# ---- 07: flash-decoding -------------------------------------------------------------------

def _state(scores, values):
    """(acc, m, l) of one query head over some positions: their scores (n,), values (n, d)."""
    m = scores.max()
    p = np.exp(scores - m)
    return p @ values, m, p.sum()


def _close(got, want, tolerance=1e-5) -> bool:
    """Equal to float32 rounding, relative to the largest magnitude in `want`."""
    return np.allclose(got, want, rtol=tolerance, atol=tolerance * max(1.0, np.abs(want).max()))


def _check_flash(answer, rng) -> str:
    cases = []
    for what, n, d, loud in [("positions 0-9 and 10-19, head_dim 4", 20, 4, 1.0),
                             ("a random split, head_dim 16", int(rng.integers(2, 200)), 16, 1.0),
                             ("a random split, head_dim 128", int(rng.integers(2, 300)), 128, 1.0),
                             ("scores in the hundreds (exp(m) alone overflows)", 64, 32, 80.0)]:
        split = 10 if n == 20 else int(rng.integers(1, n))
        cases.append((what, n, d, loud, [split]))
    cases.append(("three pieces, merged as merge(merge(a, b), c)", 90, 16, 1.0, [20, 70]))
    for number, (what, n, d, loud, cuts) in enumerate(cases, 1):
        case = f"case {number} of {len(cases)}: {what}, {n} positions"
        q = (rng.standard_normal(d) * loud).astype(np.float32)
        keys = rng.standard_normal((n, d)).astype(np.float32)
        values = rng.standard_normal((n, d)).astype(np.float32)
        if number == 1:
            keys[10:] += q         # the second piece has the larger max: the first is rescaled
        bounds = [0, *cuts, n]
        scores = keys @ q / np.float32(np.sqrt(d))
        pieces = [_state(scores[a:b], values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        merged = pieces[0]
        with np.errstate(all="ignore"):
            for piece in pieces[1:]:
                merged = _call(answer, case, merged, piece)
                try:
                    acc, m, l = merged
                    merged = (np.asarray(acc, dtype=np.float32), np.float32(m), np.float32(l))
                except Exception:
                    raise _NotYet(case, "a triple (acc, m, l)", _short(merged),
                                  "return acc, m, l (in that order, as the pieces are)") from None
        acc, m, l = merged
        want_acc, want_m, want_l = _state(scores, values)
        if not np.isfinite(acc).all() or not np.isfinite(l):
            raise _NotYet(case, "finite acc and l", f"acc {_short(acc)}, l {l}",
                          "exp of a large score overflows: rescale by exp(m_i - M) with "
                          "M = max(m1, m2), which is never more than 1")
        if m != want_m:
            raise _NotYet(case, f"m = {want_m}, the larger of the two maxima", f"m = {m}",
                          "the merged m is the largest score of both pieces: max(m1, m2)")
        if not _close(l, want_l):
            hint = ("each l was summed under its own max: multiply by exp(m_i - M) before "
                    "adding")
            if _close(acc, want_acc / want_l):
                hint = ("keep acc and l as sums: the output acc / l is taken once, after the "
                        "last merge (a normalized piece cannot be merged again)")
            raise _NotYet(case, f"l = {want_l} (one pass over all the positions)", f"l = {l}",
                          hint)
        if acc.shape != want_acc.shape or not _close(acc, want_acc):
            raise _NotYet(case, f"acc {_short(want_acc)} (one pass over all the positions)",
                          f"acc {_short(acc)}",
                          "acc needs the same rescaling as l: exp(m1 - M) * acc1 + "
                          "exp(m2 - M) * acc2; do not divide by l yet")
        ref = reference.attention(q[None, None], keys[:, None], values[:, None], np.array([n - 1]))
        cache = KVCache(1, 1, d, n)
        cache.append(keys[:, None, None], values[:, None, None])
        for name, out in (("kvlab.reference.attention", ref[0, 0]), ("cache.attend", cache.attend(q[None])[0])):
            if not _close(acc / l, out, 1e-5 * loud):     # large scores: rounding grows with them
                raise _NotYet(case, f"acc / l = {name}'s output", f"a difference of "
                              f"{np.abs(acc / l - out).max():.2e}", "rescale acc and l alike")
    return ("Merged pieces give the state of one pass over all the positions, and acc / l "
            "equals the attention of kvlab.reference and of the C core: a GPU can give each "
            "chunk of a long sequence its own thread block and merge exactly (flash-decoding).")


# ---- 08: keeping fewer positions ----------------------------------------------------------

def _h2o_rows(weights, n_keep, recent, ties_to_later=False, smallest=False, among_all=False):
    """HeavyHitters.keep for one layer and KV head (the options: plausible mistakes)."""
    weights = np.asarray(weights, dtype=np.float32)
    recent = min(recent, n_keep)
    older = len(weights) if among_all else len(weights) - recent
    scores = -weights[:older] if smallest else weights[:older]
    if ties_to_later:
        heavy = np.sort(np.argsort(scores, kind="stable")[::-1][:n_keep - recent])
    else:
        heavy = most_attended(scores[None, :, None], n_keep - recent)[0, :, 0]
    return np.concatenate([heavy, np.arange(len(weights) - recent, len(weights))]).astype(np.int64)


class _YourHeavyHitters(HeavyHitters):
    """HeavyHitters whose rows come from the answer, one layer and KV head at a time."""

    def __init__(self, answer, budget, recent):
        super().__init__(budget, recent)
        self.answer = answer

    def keep(self, cache, n_keep):
        weights = cache.attention_weights
        rows = np.empty((weights.shape[0], n_keep, weights.shape[2]), dtype=np.int32)
        for layer in range(weights.shape[0]):
            for head in range(weights.shape[2]):
                # the token on its way will be the newest: keep recent - 1 of the others
                rows[layer, :, head] = self.answer(weights[layer, :, head].copy(), n_keep,
                                                   self.recent - 1)
        return rows


def _check_h2o(answer, rng) -> str:
    model = _model()
    text = model.encode("First Citizen: Before we proceed any further, hear me speak. All: Speak, "
                        "speak. First Citizen: You are all resolved rather to die than to famish?")
    cases = [("the newest rows have received little attention yet",
              [5.0, 0.1, 3.0, 0.2, 0.3, 4.0, 0.05, 0.01], 5, 2),
             ("the newest rows have the largest weights", [0.2, 3.0, 0.1, 0.4, 9.0, 8.0], 4, 2),
             ("equal weights", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 4, 1),
             ("recent = n_keep: no room for heavy hitters", [3.0, 2.0, 1.0, 0.5, 0.2, 0.1], 5, 5),
             ("recent = 0: heavy hitters only (HeavyHitters(budget, recent=1) asks for this)",
              [0.5, 2.0, 1.0, 3.0, 0.2], 3, 0)]
    for number, (what, weights, n_keep, recent) in enumerate(cases, 1):
        case = (f"case {number} of {len(cases) + 2}: {what}: weights={weights}, n_keep={n_keep}, "
                f"recent={recent}")
        expected = _h2o_rows(weights, n_keep, recent)
        got = _call(answer, case, np.asarray(weights, dtype=np.float32), n_keep, recent)
        try:
            got = np.asarray(got).astype(np.int64).ravel()
        except Exception:
            raise _NotYet(case, f"{n_keep} row indices", _short(got),
                          "return the row indices to keep, as an array of ints") from None
        if np.array_equal(got, expected):
            continue
        if len(got) == n_keep and np.array_equal(np.sort(got), expected):
            hint = "the rows must come in increasing order (np.sort): the cache keeps them in order"
        elif len(np.unique(got)) < len(got):
            hint = ("each row once: choose the heavy hitters among the older rows only, "
                    "weights[:len(weights) - recent]; the newest are kept anyway")
        elif len(got) != n_keep:
            hint = f"keep exactly n_keep rows: {n_keep} here"
        elif np.array_equal(got, np.sort(np.argsort(-np.asarray(weights), kind="stable")[:n_keep])):
            hint = ("the newest `recent` rows are always kept, whatever their weight: few "
                    "queries have seen them yet")
        elif np.array_equal(got, _h2o_rows(weights, n_keep, recent, ties_to_later=True)):
            hint = ("ties go to the earlier row: np.argsort(-weights, kind=\"stable\") keeps "
                    "equal weights in row order")
        elif np.array_equal(got, _h2o_rows(weights, n_keep, recent, smallest=True)):
            hint = "the heavy hitters are the rows with the largest weights, not the smallest"
        else:
            hint = ("the newest min(recent, n_keep) rows, and the n_keep - min(recent, n_keep) "
                    "older rows with the largest weights, all in increasing order")
        raise _NotYet(case, f"rows {expected.tolist()}", f"rows {got.tolist()}", hint)
    # a real cache: every layer and KV head, against HeavyHitters.keep
    for number in (len(cases) + 1, len(cases) + 2):
        budget = int(rng.integers(8, 40))
        recent = int(rng.integers(1, budget))
        start = int(rng.integers(0, len(text) - budget))
        case = (f"case {number} of {len(cases) + 2}: the bundled model's cache after "
                f"HeavyHitters({budget}, recent={recent}) ran {budget} tokens, making room for "
                f"one more: h2o_keep(weights, {budget - 1}, recent={recent - 1}), since the "
                f"token on its way is the newest of the {recent}")
        policy = HeavyHitters(budget, recent)
        cache = policy.new_cache(model)
        policy.forward(model, text[start:start + budget], cache)
        expected = policy.keep(cache, budget - 1)
        weights = cache.attention_weights
        for layer in range(weights.shape[0]):
            for head in range(weights.shape[2]):
                got = _call(answer, case, weights[layer, :, head].copy(), budget - 1, recent - 1)
                got = np.asarray(got).astype(np.int64).ravel()
                if not np.array_equal(got, expected[layer, :, head]):
                    raise _NotYet(f"{case}, layer {layer}, KV head {head}",
                                  f"rows {expected[layer, :, head].tolist()}",
                                  f"rows {got.tolist()}",
                                  "compare with the small cases above: the newest rows, then "
                                  "the heaviest older ones, in increasing order")
    # the whole policy on your rows: the kit's logits, bit for bit
    theirs, yours = HeavyHitters(16, 6), _YourHeavyHitters(answer, 16, 6)
    want = theirs.forward(model, text, theirs.new_cache(model), all_logits=True)
    got = yours.forward(model, text, yours.new_cache(model), all_logits=True)
    if not np.array_equal(got, want):
        raise _NotYet(f"a HeavyHitters(16, recent=6) policy built on your function, "
                      f"{len(text)} tokens", "HeavyHitters' logits", "different logits",
                      "the rows differ somewhere: check the cases above")
    return (f"Your rows are HeavyHitters.keep's for every layer and KV head, and a policy built "
            f"on them gives the kit's logits bit for bit over {len(text)} tokens: H2O keeps the "
            f"newest rows and the older ones attention has used most, summed over every query "
            f"since they came, which favours the oldest positions.")

# ---- 09: speculative decoding -------------------------------------------------------------

def _greedy_after(model, tokens, n):
    """The n tokens plain greedy decoding chooses after `tokens`."""
    return generate(model, list(tokens), n, stop_at_eos=False).tokens


def _check_speculative(answer, rng) -> str:
    """The exercise: one speculative pass, answer(model, cache, tokens, drafts) -> the kept
    drafts and the model's own token after them, checked case by case, then in a loop."""
    model = _model()
    texts = ["ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft",
             "KING HENRY:\nNow, lords, the field is ours, and yet the day\n", "First Citizen:\n"]
    cases = _speculative_cases(model, texts, rng)
    for number, (tokens, drafts, what) in enumerate(cases, 1):
        case = f"case {number} of {len(cases) + 1}: {what}, after {_short(model.decode_text(tokens), 40)}"
        _check_one_speculative_pass(answer, model, case, tokens, drafts)
    # the last case: the step, over and over, drafted by prompt lookup, is greedy decoding
    case = (f"case {len(cases) + 1} of {len(cases) + 1}: 60 tokens after {_short(texts[0], 40)}, "
            f"your step in a loop with prompt lookup drafts (k = 4)")
    return _check_speculative_loop(answer, model, case, texts[0], n_new=60)


def _speculative_cases(model, texts: List[str], rng) -> list:
    """(context, drafts, what the case is) for each case of one pass: right, wrong and mixed
    drafts after each text and what greedy adds to it."""
    cases = []
    for text in texts:                       # the context: the text and what greedy adds to it
        tokens = model.encode(text)
        tokens += _greedy_after(model, tokens, int(rng.integers(1, 12)))
        truth = _greedy_after(model, tokens, 9)
        wrong = [(t + 1 + int(rng.integers(200))) % model.config.vocab_size for t in truth]
        # after a refused draft, a draft that is what the model would choose there: kept
        # by nobody who stops at the first refusal
        after_wrong = _greedy_after(model, tokens + [truth[0], wrong[1]], 1)
        cases += [(tokens, truth[:2] + wrong[2:5], "5 drafts, the first 2 right"),
                  (tokens, wrong[:4], "4 drafts, all refused"),
                  (tokens, [truth[0], wrong[1]] + after_wrong,
                   "3 drafts, the second refused, the third what the model would choose after it"),
                  (tokens, truth[:4], "4 drafts the model agrees with"),
                  (tokens, [], "no drafts (a plain decode step)")]
    tokens = model.encode(texts[0])
    truth = _greedy_after(model, tokens, 9)
    cases.append((tokens, truth[:1] + [truth[1] if rng.random() < 0.5 else 0] + truth[2:8],
                  "8 drafts"))
    return cases


def _check_one_speculative_pass(answer, model, case: str, tokens: List[int],
                                drafts: List[int]) -> None:
    """One pass of the answer: the right tokens, in one forward pass, leaving the cache
    holding the context and the kept drafts, with the K and V a prefill of them writes."""
    truth = _greedy_after(model, tokens, len(drafts) + 1)
    kept = 0
    while kept < len(drafts) and drafts[kept] == truth[kept]:
        kept += 1
    expected = truth[:kept + 1]
    cache = model.new_cache(len(tokens) + len(drafts) + 1)
    model.prefill(tokens[:-1], cache)
    with model.counting() as counts:
        got = _call(answer, case, model, cache, list(tokens), list(drafts), hints={
            ValueError: "cache.truncate(n) only shortens the cache: after the pass it holds "
                        "len(tokens) + len(drafts) positions, and you keep len(tokens) + "
                        "kept of them",
            CacheFullError: "run the newest token and the drafts once, over the cache as "
                            "it is: model.forward([tokens[-1]] + drafts, cache, "
                            "all_logits=True)"})
    try:
        got = [int(t) for t in got]
    except Exception:
        raise _NotYet(case, f"a list of token ids: {expected}", _short(got),
                      "return the kept drafts and the model's own token, as a list") from None
    if got != expected:
        raise _NotYet(case, f"{expected} (kept {kept} of {len(drafts)} drafts, then the "
                      f"model's own token)", f"{got}", _wrong_pass_hint(got, drafts, kept))
    if counts.calls != 1:
        raise _NotYet(case, "one forward pass of the model", f"{counts.calls} passes "
                      f"(the right tokens)", "the point is one pass: model.forward("
                      "[tokens[-1]] + drafts, cache, all_logits=True) checks every draft "
                      "at once")
    want = len(tokens) + kept
    if cache.length != want:
        raise _NotYet(case, f"cache.length == {want} (the context and {kept} kept drafts)",
                      f"cache.length == {cache.length}",
                      _wrong_length_hint(cache.length, want, len(tokens) + len(drafts)))
    fresh = model.new_cache(want)
    model.prefill(list(tokens) + list(drafts[:kept]), fresh)
    if not (np.array_equal(cache.keys, fresh.keys) and np.array_equal(cache.values, fresh.values)):
        raise _NotYet(case, "the K and V a prefill of the context and the kept drafts writes",
                      "other K and V in the cache",
                      "feed the newest token first: model.forward([tokens[-1]] + drafts, "
                      "cache, all_logits=True)")


def _wrong_pass_hint(got: List[int], drafts: List[int], kept: int) -> str:
    if got == drafts[:kept]:
        return ("after the kept drafts comes one token of the model's own: the arg-max "
                "of the row after the last kept draft, rows[kept]")
    if got[:-1] == drafts[:len(got) - 1] and len(got) - 1 > kept:
        return ("stop at the first draft the model refuses: every draft after it was "
                "checked against a context that is not the text")
    return ("rows[i] is the model's choice for the position of drafts[i] (row 0 "
            "comes from the newest token, tokens[-1]); keep drafts while "
            "np.argmax(rows[i]) == drafts[i]")


def _wrong_length_hint(length: int, want: int, everything: int) -> str:
    """Why a cache holds `length` rows after the pass, not the `want` of the context and the
    kept drafts (`everything`: the context and every draft)."""
    if length == everything:
        return ("the refused drafts' K and V are still in the cache: "
                "cache.truncate(len(tokens) + kept)")
    if length == want + 1:
        return ("the cache keeps the first refused draft: its K and V belong to a "
                "token that is not in the text; truncate to len(tokens) + kept")
    return ("the cache should hold the context and the kept drafts, not the "
            "model's own token (it is fed next step): truncate to "
            "len(tokens) + kept")


def _check_speculative_loop(answer, model, case: str, text: str, n_new: int) -> str:
    """The answer as the step of a loop with prompt lookup drafts must give greedy decoding's
    tokens, kvlab.generate's."""
    tokens = model.encode(text)
    prompt_len = len(tokens)
    cache = model.new_cache(prompt_len + n_new + 4)
    tokens.append(int(np.argmax(model.prefill(tokens, cache))))
    drafter, passes = PromptLookup(), 0
    while len(tokens) - prompt_len < n_new:
        drafts = drafter.propose(tokens, 4)
        got = _call(answer, case, model, cache, list(tokens), drafts)
        tokens += [int(t) for t in got]
        passes += 1
    expected = generate(model, text, n_new).tokens
    got = tokens[prompt_len:prompt_len + n_new]
    if got != expected:
        raise _NotYet(case, f"kvlab.generate's {n_new} tokens", _short(got),
                      "each step must leave the cache holding exactly the text so far, less "
                      "its newest token")
    return (f"Stepped through {n_new} tokens with prompt lookup, your step gives kvlab.generate's "
            f"tokens in {passes + 1} forward passes of the model instead of {n_new}: the "
            f"drafts it keeps cost no pass of their own.")


# ---- 10: weight quantization ------------------------------------------------------------

def _awq_error(x, w, alpha) -> float:
    s = wq.awq_scales(np.abs(x).mean(axis=0), alpha)
    return wq.output_error(x, w, wq.rounded(w * s, "q4_0") / s)


def _check_awq(answer, rng) -> str:
    x = rng.standard_normal((24, 64)).astype(np.float32)
    x[:, 7] *= 25                                   # one loud channel
    w = (0.1 * rng.standard_normal((16, 64))).astype(np.float32)
    errors = []
    for alpha in (0.0, 0.5, 0.25):
        case = f"alpha {alpha}: x (24, 64) with channel 7 25x louder, w (16, 64)"
        expected = _awq_error(x, w, alpha)
        got = _call(answer, case, x, w, alpha)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise _NotYet(case, f"a number, {expected:.6g}", _short(got),
                          "return the summed squared error, a float") from None
        if math.isclose(got, expected, rel_tol=1e-4):
            errors.append(got)
            continue
        s = wq.awq_scales(np.abs(x).mean(axis=0), alpha)
        if math.isclose(got, wq.output_error(x, w, wq.rounded(w * s, "q4_0")), rel_tol=1e-4):
            hint = "the stored matrix is rounded(w * s) / s: divide by the scales again"
        elif math.isclose(got, wq.output_error(x, w * s, wq.rounded(w * s, "q4_0")), rel_tol=1e-4):
            hint = ("compare with the original w's outputs: the scaled matrix reads x / s, so "
                    "its outputs are x @ (rounded(w * s) / s).T")
        else:
            hint = ("s = wq.awq_scales(mean |x| of each column of x, alpha); the error is "
                    "wq.output_error(x, w, wq.rounded(w * s, 'q4_0') / s)")
        raise _NotYet(case, f"{expected:.6g}", _short(got), hint)
    return (f"With channel 7 25x louder, alpha 0.5 stores this layer with {errors[1]:.4g} of "
            f"output error against round to nearest's {errors[0]:.4g}: the loud channel's "
            f"weights keep finer steps.")


# ---- 11: serving at scale ------------------------------------------------------------------

def _sharing_cases(rng) -> list:
    """(prompts, block_size): fixed ones, then drawn prompts that copy a stretch of an
    earlier one and go on their own way (as a chat's turns do)."""
    cases = [([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9], [7]], 1),
             ([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 0]], 4),
             ([[5] * 10, [5] * 10, [5] * 3], 2)]
    for _ in range(4):
        prompts = []
        for _ in range(int(rng.integers(3, 12))):
            tail = rng.integers(0, 6, int(rng.integers(1, 10))).tolist()
            if prompts and rng.random() < 0.7:
                earlier = prompts[int(rng.integers(len(prompts)))]
                tail = earlier[:int(rng.integers(0, len(earlier) + 1))] + tail
            prompts.append(tail)
        cases.append((prompts, int(rng.choice([1, 2, 3, 4, 8]))))
    return cases


def _check_sharing(answer, rng) -> str:
    cases = _sharing_cases(rng)
    for number, (prompts, block_size) in enumerate(cases, 1):
        case = (f"case {number} of {len(cases)}: prompts {_short(prompts, 60)}, "
                f"block_size={block_size}")
        radix = cluster.radix_hits(prompts)
        expected = [h - cluster.block_loss(h, block_size) for h in radix]
        got = _call(answer, case, [list(p) for p in prompts], block_size)
        try:
            got = [int(v) for v in got]
        except Exception:
            raise _NotYet(case, "a list of whole numbers, one per prompt", _short(got),
                          "return one count per prompt, in order") from None
        if got == expected:
            continue
        if len(got) != len(expected):
            hint = "one count per prompt, the first one's too (it finds nothing: 0)"
        elif got == [h - cluster.block_loss(h, block_size) for h in
                     cluster.radix_hits([list(p) + [-1] for p in prompts])]:
            hint = ("the last token of a prompt is always computed (its logits choose the "
                    "next token): match prompt[:-1]")
        elif got == radix and block_size > 1:
            hint = "a block cache reuses only full blocks: round down to a multiple of block_size"
        else:
            hint = ("the longest prefix of prompt[:-1] shared with any earlier prompt (the "
                    "whole of each earlier one is cached), cut down to full blocks")
        raise _NotYet(case, f"{expected} (kvlab.cluster's radix tree, cut to blocks)",
                      _short(got), hint)
    return ("Your counts are what the pool's block hashes find (tests/test_cluster.py checks "
            "that against kvlab.PagedPool): a radix tree is the same cache with blocks of one "
            "token, and every larger block loses the part of a shared prefix past its last "
            "full block.")


_CHECKS = {
    "01_kv_cache": _check_kv_cache,
    "02_cache_size": _check_cache_size,
    "03_gqa": _check_gqa,
    "04_paged": _check_paged,
    "05_batching": _check_batching,
    "06_quantization": _check_quantization,
    "07_gpu_kernels": _check_flash,
    "08_fewer_positions": _check_h2o,
    "09_speculative": _check_speculative,
    "10_weight_quantization": _check_awq,
    "11_serving_at_scale": _check_sharing,
}
