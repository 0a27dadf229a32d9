"""Keeping fewer positions: what the cache policies (kvlab.cache_policy) save in memory and
time, and what they cost in accuracy, measured side by side with the full cache.

1. Memory against generated length. Greedy generation of N tokens (256 .. 16,384, far
   past the bundled model's context of 512) with SlidingWindow(64) and
   AttentionSinks(4, 60), and with a full cache sized for the sequence (up to
   --full-max tokens: a full cache decodes ever more slowly, 5 ms a token at 16K here).
   For each: cache.nbytes, the formula (kvlab.kv_cache_bytes of the rows held), and the
   measured growth of the process's resident memory (VmRSS) from before the cache was
   made to after the N-th token, with the cache alive.
2. Accuracy against the budget (kvlab.accuracy.evaluate_budgets): perplexity change,
   KL and top-1 agreement against the full cache for window, sinks, h2o and snapkv, on
   the bundled model's held-out Tiny Shakespeare split and on stories260K's own text
   (where ../shared/models is present), and the rows each scored position read.
3. Past the trained context. One long stretch of held-out text, teacher-forced: the
   perplexity in ranges of positions (0-256, ..., past 512) for the full cache, the
   policies (positions as stored, the kit's choice for RoPE), and StreamingLLM's choice
   (the sinks rotated by their place in the cache), computed in NumPy
   (sinks_reference, checked against the kit's AttentionSinks first).
4. Decode time per token at a long context: one more token with the full cache against
   each policy's cache of 64 rows, on the bundled model (512 and 16,384 positions) and a
   random-weight 4-layer GQA shape (16,384 positions); caches filled with random rows by
   cache.append (timing only), every cache timed in turn, round-robin, best of N.
5. What a sliding window costs over the rows it reads: a decode step of SlidingWindow(W)
   (a full window: drop the oldest row, add one) against a step of a full cache holding
   the same W rows, on llama2.c's stories110M shape (random weights, W = 2,048: 151 MB of
   fp32 K and V), in CPU seconds on one thread, alternating, the median of each and the
   median of the rounds' ratios (issue 37's target: window / full <= 1.1); the same in a CPU
   paged pool, whose keep moves the sequence's start past the dropped row (no row moves).

    python benchmarks/bench_policies.py [--quick] [--full-max 4096] [--json out.json]
    python benchmarks/bench_policies.py --sections 5      # only the window's cost (about 1 min)

About 100 s on the 2-core development machine (1 thread); --quick takes a few seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab import accuracy, reference
from kvlab.measure import kv_cache_bytes, release_freed_memory, resident_bytes
from kvlab.next_token_metrics import log_softmax

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVLAB_SHARED", REPO.parent / "shared"))
DATA = SHARED / "data" / "tinyshakespeare.txt"
STORIES = SHARED / "models" / "stories260K"
POLICIES = ("window", "sinks", "h2o", "snapkv")
BUDGET = 64
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def load_stories():
    """stories260K, or None where the course's model folder is absent."""
    if not (STORIES / "stories260K.bin").is_file():
        return None
    return kvlab.load(STORIES / "stories260K.bin", tokenizer=STORIES / "tok512.bin")


def policy_cache(model, policy, capacity: int):
    """A cache for the policy: its budget of rows, or for SnapKV (which grows after the
    prompt) room for `capacity` positions."""
    return policy.new_cache(model) if policy.bounded else policy.new_cache(model, max_seq_len=capacity)


# ---- 1. memory against generated length -----------------------------------------------------

def _row(name, n, cache, growth, model):
    return {"policy": name, "generated": n, "rows": cache.length, "cache_nbytes": cache.nbytes,
            "formula_bytes": kv_cache_bytes(model.config, cache.length, dtype="fp32"),
            "resident_growth": growth}


def memory_growth(model, name: str, lengths, budget: int = BUDGET, prompt: str = PROMPT) -> list:
    """Resident growth while generating, greedy, with the cache alive. A policy: one run,
    read after each length in `lengths`. "full": one run per length, each with a cache of
    prompt + N positions (decoded in C, model.decode_steps)."""
    ids = model.encode(prompt)
    rows = []
    if name == "full":
        warm = model.new_cache(len(ids) + 8)           # one-time allocations, not counted
        model.decode_steps(int(np.argmax(model.forward(ids, warm))), warm, 8)
        del warm
        for n in sorted(lengths):
            release_freed_memory()
            before = resident_bytes()
            cache = model.new_cache(len(ids) + n)
            logits = model.forward(ids, cache)
            model.decode_steps(int(np.argmax(logits)), cache, n)   # n tokens into the cache
            release_freed_memory()
            rows.append(_row(name, n, cache, resident_bytes() - before, model))
            del cache, logits
        return rows
    policy = accuracy.make_policy(name, budget)
    warm = policy.new_cache(model)                     # one-time allocations, not counted
    logits = policy.forward(model, ids, warm)
    for _ in range(budget + 8):
        logits = policy.forward(model, [int(np.argmax(logits))], warm)
    del warm, logits
    release_freed_memory()
    before = resident_bytes()
    cache = policy.new_cache(model)
    logits = policy.forward(model, ids, cache)
    done = 0
    for n in sorted(lengths):
        while done < n:
            logits = policy.forward(model, [int(np.argmax(logits))], cache)
            done += 1
        release_freed_memory()
        rows.append(_row(name, n, cache, resident_bytes() - before, model))
    return rows


# ---- 2. accuracy against the budget ---------------------------------------------------------

def budget_reports(budgets, n_tokens: int, story_tokens: int, data: Path = DATA,
                   progress: bool = False) -> list:
    """evaluate_budgets on the bundled model's held-out text and stories260K's own text."""
    reports = []
    model = kvlab.load()
    if data.is_file():
        ids = accuracy.validation_tokens(model, str(data), n_tokens)
        report = accuracy.evaluate_budgets(model, ids, budgets, progress=progress)
        report.model += " (Tiny Shakespeare validation split)"
        reports.append(report)
    else:
        print(f"({data} not found: skipping the bundled model's held-out text)")
    stories = load_stories()
    if stories is not None and story_tokens:
        ids = accuracy.generated_tokens(stories, story_tokens, seed=0)
        report = accuracy.evaluate_budgets(stories, ids, budgets, progress=progress)
        report.model += " (text it generated)"
        reports.append(report)
    return reports


# ---- 3. past the trained context ------------------------------------------------------------

def sinks_reference(model, ids, sinks: int, window: int, rerotate: bool,
                    chunk: int = 256) -> np.ndarray:
    """Every position's logits, in NumPy, when each query sees the first `sinks` positions
    and the newest `window` (itself included), as AttentionSinks(sinks, window) keeps them.

    rerotate=False: every key rotated at its own position (the kit's choice); this is what
    kvlab's AttentionSinks computes. rerotate=True: StreamingLLM's choice, positions by
    place in the cache: once the cache is full, the query sits at slot sinks + window - 1
    and the sinks at slots 0 .. sinks - 1, so the sinks' rotations are those of their
    slots, not of their distance to the query. The window's distances are the same either
    way (a window row's slot and the query's slot differ by their true distance)."""
    c, w = model.config, model.weights
    ids = np.asarray(ids)
    n, H, KVH, hd = len(ids), c.n_heads, c.n_kv_heads, c.head_dim
    budget = sinks + window
    pos = np.arange(n)
    inv_freq = c.rope_inv_freq()
    x = w.token_embedding[ids].astype(np.float32)
    for layer in range(c.n_layers):
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q_raw = (h @ w.wq[layer].T).reshape(n, H, hd)
        q = reference.rope(q_raw, pos, inv_freq, c.rope_interleaved)
        k = reference.rope((h @ w.wk[layer].T).reshape(n, KVH, hd), pos, inv_freq, c.rope_interleaved)
        v = (h @ w.wv[layer].T).reshape(n, KVH, hd)
        k, v = np.repeat(k, H // KVH, axis=1), np.repeat(v, H // KVH, axis=1)
        # the query at the cache's last slot: its score with a sink at slot i (= its position)
        q_slot = reference.rope(q_raw, np.full(n, budget - 1), inv_freq, c.rope_interleaved)
        out = np.empty_like(q)
        for start in range(0, n, chunk):
            p = pos[start:start + chunk]
            # the keys these queries may see: the sinks, and the band of the newest `window`
            band = np.arange(max(sinks, start - window + 1), p[-1] + 1)
            j = np.concatenate([np.arange(min(sinks, n)), band])
            scores = np.einsum("phd,jhd->hpj", q[p], k[j]) / np.float32(math.sqrt(hd))
            if rerotate:
                late = p >= budget                      # the cache has dropped rows
                sink_scores = np.einsum("phd,jhd->hpj", q_slot[p], k[:sinks]) / np.float32(math.sqrt(hd))
                scores[:, late, :sinks] = sink_scores[:, late, :]
            visible = (j[None, :] <= p[:, None]) & ((j[None, :] > p[:, None] - window) | (j[None, :] < sinks))
            weights = reference.softmax(np.where(visible[None], scores, -np.inf))
            out[p] = np.einsum("hpj,jhd->phd", weights, v[j])
        x = x + out.reshape(n, H * hd) @ w.wo[layer].T
        h = reference.rmsnorm(x, w.ffn_norm[layer], c.norm_eps)
        x = x + (reference.silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T
    return reference.rmsnorm(x, w.final_norm, c.norm_eps) @ w.classifier.T


def past_context(model, ids, edges, budget: int = BUDGET, sinks: int = 4) -> dict:
    """Perplexity per range of positions (edges), teacher-forced over ids, one run each."""
    ids = np.asarray(ids)
    n = len(ids)
    targets = ids[1:]

    def nll(logits):
        return -log_softmax(logits)[:-1][np.arange(n - 1), targets]

    runs, seconds = {}, {}
    start = time.perf_counter()
    runs["full"] = nll(model.forward(ids, model.new_cache(n), all_logits=True))
    seconds["full"] = time.perf_counter() - start
    kit_sinks = None
    for name in ("window", "sinks", "h2o"):
        policy = accuracy.make_policy(name, budget)
        start = time.perf_counter()
        logits = policy.forward(model, ids, policy.new_cache(model), all_logits=True)
        seconds[name] = time.perf_counter() - start
        runs[name] = nll(logits)
        if name == "sinks":
            kit_sinks = logits
    # StreamingLLM's rotation, in NumPy; the same code with the kit's rotation first, as a check
    as_stored = sinks_reference(model, ids, sinks, budget - sinks, rerotate=False)
    check = float(np.abs(as_stored - kit_sinks).max())
    start = time.perf_counter()
    runs["sinks, re-rotated (StreamingLLM)"] = nll(sinks_reference(model, ids, sinks, budget - sinks,
                                                                   rerotate=True))
    seconds["sinks, re-rotated (StreamingLLM)"] = time.perf_counter() - start
    ranges = [[a, b] for a, b in zip(edges[:-1], edges[1:]) if a < n - 1]
    ranges[-1][1] = min(ranges[-1][1], n - 1)
    table = {name: [float(np.exp(values[a:b].mean())) for a, b in ranges]
             for name, values in runs.items()}
    return {"model": model.config.name, "tokens": n, "trained_context": model.config.max_seq_len,
            "budget": budget, "sinks": sinks, "ranges": ranges,
            "perplexity": table, "seconds": seconds,
            "numpy_sinks_vs_kit_max_abs_logit_difference": check}


# ---- 4. decode time per token ---------------------------------------------------------------

def random_gqa(context: int) -> kvlab.Model:
    """A random-weight 4-layer GQA shape (16 query heads, 4 KV heads of 64): 8 KiB of fp32
    cache per token, weights small enough that attention over a long cache dominates."""
    config = kvlab.ModelConfig(dim=512, hidden_dim=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                               head_dim=64, vocab_size=256, max_seq_len=max(context + 1, 512),
                               name="random 4-layer GQA")
    return kvlab.Model(config, kvlab.Weights.random(config, seed=0))


def decode_times(model, context: int, budget: int = BUDGET, repeats: int = 25, seed: int = 0) -> list:
    """One decode step with a full cache of `context` positions against one step with each
    policy's cache of `budget` rows (its steady state: a bounded policy drops a row and adds
    one; SnapKV's compressed cache takes one more row), round-robin, best of `repeats`
    (each timed step right after an untimed one on the same cache); the median, and every
    round's time in order (seconds_by_round), so that a caller can take each round's ratios."""
    c = model.config
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((context, c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
    full = model.new_cache(context + 1)
    full.append(rows, rows)
    caches = {"full": (None, full)}
    for name in POLICIES:
        policy = accuracy.make_policy(name, budget)
        cache = policy_cache(model, policy, budget + 1)
        cache.append(rows[-budget:], rows[-budget:])
        caches[name] = (policy, cache)
    del rows
    token = 1
    best = {name: float("inf") for name in caches}
    samples = {name: [] for name in caches}
    def step(policy, cache) -> float:
        length = cache.length
        start = time.perf_counter()
        if policy is None:
            model.forward([token], cache)
        else:
            policy.forward(model, [token], cache)
        seconds = time.perf_counter() - start
        if policy is None or not policy.bounded:
            cache.truncate(length)                     # back to the same length
        return seconds

    for _ in range(repeats):
        for name, (policy, cache) in caches.items():
            # one untimed step first: a cache timed right after the full cache's long walk
            # would otherwise start cold (its rows and the weights evicted from the CPU's
            # caches), which a real decode loop over one cache never is
            step(policy, cache)
            seconds = step(policy, cache)
            best[name] = min(best[name], seconds)
            samples[name].append(seconds)
    out = []
    for name, (policy, cache) in caches.items():
        out.append({"model": c.name, "context": context, "policy": name,
                    "rows": cache.length if policy is None or policy.bounded else budget,
                    "cache_nbytes": cache.nbytes, "seconds": best[name],
                    "median_seconds": float(np.median(samples[name])),
                    "full_over_this": best["full"] / best[name],
                    "seconds_by_round": samples[name]})
    return out


# ---- 5. what a sliding window costs over the rows it reads -----------------------------------

# llama2.c's stories110M shape, as benchmarks/api_timing.py and bench_cpu.py have it
SHAPE_110M = dict(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12,
                  vocab_size=32000)


def window_steps(model, rows: np.ndarray, window: int, paged: bool):
    """One decode step with a full cache of `window` rows (then truncated back to them) and
    one with SlidingWindow(window) on a full window, in a KVCache each, or in two sequences
    of one CPU paged pool (blocks of 16)."""
    from kvlab.cache_policy import SlidingWindow
    policy, n = SlidingWindow(window), len(rows)
    if not paged:
        full, ring = model.new_cache(window + 1), policy.new_cache(model)
        full.append(rows, rows)
        ring.append(rows, rows)

        def truncate():
            full.truncate(window)
    else:
        pool = model.new_paged_pool(num_blocks=2 * (window // 16 + 2), block_size=16,
                                    prefix_cache=False)
        full, ring = pool.new_sequence(), pool.new_sequence()
        tokens = np.arange(n, dtype=np.int32) % model.config.vocab_size
        pool.append(full, tokens, rows, rows)
        pool.append(ring, tokens, rows, rows)

        def truncate():
            pool.truncate(full, window)

    def full_step():
        model.forward([1], full)
        truncate()

    def window_step():
        policy.forward(model, [1], ring)
    return full_step, window_step


def window_cost(config: kvlab.ModelConfig, window: int, rounds: int = 15, seed: int = 0) -> dict:
    """A decode step of SlidingWindow(window) on a full window (it drops its oldest row and
    adds the new one) against a step of a full cache holding the same `window` rows, both
    filled with the same random rows by append, in KVCaches and in a CPU paged pool. CPU
    seconds (time.process_time) on one thread, each step right after an untimed one on the
    same cache, the caches taking turns to go first; the medians, and the median of the
    rounds' ratios, window / full."""
    model = kvlab.Model(config, kvlab.Weights.random(config, seed=seed))
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((window, config.n_layers, config.n_kv_heads, config.head_dim),
                               dtype=np.float32)
    steps = {}
    for kind in ("cache", "paged"):
        full_step, window_step = window_steps(model, rows, window, paged=kind == "paged")
        steps[f"{kind} full"], steps[f"{kind} window"] = full_step, window_step
    del rows

    def timed(step) -> float:
        step()                                   # untimed: the cache's rows back in reach
        start = time.process_time()
        step()
        return time.process_time() - start

    threads = kvlab.get_num_threads()
    kvlab.set_num_threads(1)
    try:
        times = {name: [] for name in steps}
        names = list(steps)
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(timed(steps[name]))
    finally:
        kvlab.set_num_threads(threads)
    out = {"model": config.name, "window": window, "rounds": rounds, "threads": 1,
           "clock": "process_time",
           "moved_bytes_per_step_if_rows_move": window * 2 * config.n_layers *
           config.n_kv_heads * config.head_dim * 4,
           "seconds_by_round": times}
    for kind in ("cache", "paged"):
        ratios = [w / f for w, f in zip(times[f"{kind} window"], times[f"{kind} full"])]
        out[kind] = {"full_median_seconds": float(np.median(times[f"{kind} full"])),
                     "window_median_seconds": float(np.median(times[f"{kind} window"])),
                     "window_over_full": float(np.median(ratios)),
                     "window_over_full_range": [float(min(ratios)), float(max(ratios))]}
    return out


# ---- the run --------------------------------------------------------------------------------

def print_memory(memory: list, model) -> None:
    print(f"1. Memory against generated length, {model.config.name} (context "
          f"{model.config.max_seq_len}), budget {BUDGET} rows, fp32")
    print(f"{'cache':<8}{'generated':>10}{'rows':>7}{'nbytes':>12}{'resident growth':>17}")
    for r in memory:
        print(f"{r['policy']:<8}{r['generated']:>10,}{r['rows']:>7,}{r['cache_nbytes']:>12,}"
              f"{r['resident_growth']:>17,}")


def print_past_context(long: dict) -> None:
    print(f"\n3. Past the trained context ({long['trained_context']}): perplexity by "
          f"position, {long['tokens']:,} held-out tokens, budget {long['budget']}")
    print(f"{'':<34}" + "".join(f"{f'{a}-{b}':>11}" for a, b in long["ranges"]))
    for name, values in long["perplexity"].items():
        print(f"{name:<34}" + "".join(f"{v:>11.3f}" for v in values))
    print(f"(NumPy sinks vs the kit's AttentionSinks: max |logit difference| "
          f"{long['numpy_sinks_vs_kit_max_abs_logit_difference']:.1e})")


def print_decode_times(times: list, repeats: int) -> None:
    print(f"\n4. Decode time per token, budget {BUDGET} rows against the full cache "
          f"(best of {repeats}, round-robin)")
    print(f"{'model':<20}{'context':>8} {'cache':<8}{'rows':>7}{'us':>10}{'full / this':>13}")
    for r in times:
        print(f"{r['model']:<20}{r['context']:>8,} {r['policy']:<8}{r['rows']:>7,}"
              f"{1e6 * r['seconds']:>10.0f}{r['full_over_this']:>12.2f}x")


def print_window_cost(cost: dict) -> None:
    print(f"\n5. A sliding window's decode step against a full cache of the same "
          f"{cost['window']:,} rows, {cost['model']} (CPU time, 1 thread, medians of "
          f"{cost['rounds']} rounds, the caches taking turns)")
    for kind, name in (("cache", "KVCache"), ("paged", "paged pool")):
        r = cost[kind]
        low, high = r["window_over_full_range"]
        print(f"{name:<11} full {1e3 * r['full_median_seconds']:6.1f} ms, window "
              f"{1e3 * r['window_median_seconds']:6.1f} ms: window / full "
              f"{r['window_over_full']:.3f} (rounds {low:.3f} .. {high:.3f})")
    print("(issue 37's target: window / full <= 1.1)")


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a few seconds), for tests")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="256,1024,4096,16384")
    parser.add_argument("--full-max", type=int, default=4096,
                        help="longest generation with a full cache (16384: about 45 s more)")
    parser.add_argument("--budgets", default="8,16,32,64,96")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens for section 2")
    parser.add_argument("--story-tokens", type=int, default=2048)
    parser.add_argument("--long", type=int, default=4096, help="tokens teacher-forced in section 3")
    parser.add_argument("--contexts", default="512,16384")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--sections", default="1,2,3,4,5",
                        help="which sections to run (the others are null in the JSON)")
    parser.add_argument("--window", type=int, default=2048, help="section 5's window")
    parser.add_argument("--window-rounds", type=int, default=15, help="section 5's rounds")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_policies.json"))
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.full_max, args.budgets = "64,256", 256, "16,32"
        args.tokens, args.story_tokens, args.long = 512, 0, 640
        args.contexts, args.repeats = "512", 3
        args.window, args.window_rounds = 64, 3
    args.sections = {int(n) for n in args.sections.split(",")}
    return args


def main() -> None:
    args = parse_arguments()
    lengths = [int(n) for n in args.lengths.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    contexts = [int(n) for n in args.contexts.split(",")]
    kvlab.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"kvlab {kvlab.__version__}, {kvlab.get_num_threads()} thread(s)\n")
    model = kvlab.load()
    memory = reports = times = long = cost = None

    if 1 in args.sections:
        memory = []
        for name in ("window", "sinks"):
            memory += memory_growth(model, name, lengths)
        memory += memory_growth(model, "full", [n for n in lengths if n <= args.full_max])
        print_memory(memory, model)
    if 2 in args.sections:
        reports = budget_reports(budgets, args.tokens, args.story_tokens, Path(args.data))
        for i, report in enumerate(reports):
            print(f"\n2.{i + 1} Accuracy against the budget")
            print(report.table())
    if 3 in args.sections and Path(args.data).is_file():
        ids = accuracy.validation_tokens(model, args.data, args.long)
        long = past_context(model, ids, [0, 256, 512, 1024, 2048, 4096, 8192, 16384])
        print_past_context(long)
    if 4 in args.sections:
        times = []
        for context in contexts:
            times += decode_times(model, context, repeats=args.repeats)
        if not args.quick:
            times += decode_times(random_gqa(max(contexts)), max(contexts), repeats=args.repeats)
        print_decode_times(times, args.repeats)
    if 5 in args.sections:
        # --quick: the 15M shape's layers, a small window, a few rounds
        shape = dict(SHAPE_110M, dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6) \
            if args.quick else SHAPE_110M
        name = "random stories15M shape" if args.quick else "random stories110M shape"
        config = kvlab.ModelConfig(max_seq_len=args.window + 1, name=name, **shape)
        cost = window_cost(config, args.window, rounds=args.window_rounds)
        print_window_cost(cost)

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"setup": {"kvlab": kvlab.__version__, "threads": kvlab.get_num_threads(),
                        "cpu_count": os.cpu_count(), "quick": args.quick, "budget": BUDGET,
                        "prompt": PROMPT, "sections": sorted(args.sections),
                        "seconds": round(time.perf_counter() - started, 1)},
              "memory": memory, "accuracy": None if reports is None else [r.as_dict() for r in reports],
              "past_context": long, "decode_times": times, "window_cost": cost}
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} in {result['setup']['seconds']} s")


if __name__ == "__main__":
    main()
