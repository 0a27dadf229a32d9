"""Figures and numbers for chapter 1, "Autoregressive decoding and the KV cache".

    python chapters/figures/ch01.py [--out DIR]

Writes ch01_step_time.png, ch01_flops.png, ch01_working_memory.png and ch01.json (every
number the chapter quotes, with the setup) into DIR (default: this script's folder).
Runs in about 3 minutes on a quiet 2-core machine (most of it SmolLM2's uncached runs);
--quick runs the same code with fewer rounds and tokens, in well under a minute.

1. Exactness: greedy generation with and without the cache gives the same tokens; the
   logits of every decode step equal, bit for bit, the rows of one uncached pass over
   the whole sequence; the first position's cached keys do not change as the text grows.
2. Arithmetic from the shapes alone (kvlab.measure): FLOPs per step with and without the
   cache on the Llama 2 7B shape, the whole-run ratio for 2,048 tokens (arithmetic_ratio),
   where it crosses 1,000x, and per_token_saving by position.
3. Timing on this machine, one thread of the C core, cached and uncached in turn (A, B,
   A, B: each pair meets the same load; the ratio quoted is the median of the pairs'
   ratios): 48 new tokens on SmolLM2-135M-Instruct after a chat prompt (a system and a
   user message, kvlab.chat.prompt), the course's experiment on a trained model; the same
   on the bundled model (the instant first demo); and every step of a 256-token run of
   the bundled model.
4. Working memory (kvlab.measure.working_memory) for 256 new tokens, the uncached run
   holding every layer's K and V or one layer's at a time; the same accountings from the
   shapes (kvlab.measure.scratch_bytes) for larger shapes, SmolLM2's among them; and the accounting of a program
   that also keeps whole score matrices and every position's logits.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
import kvlab.chat  # noqa: E402
from common import machine, smollm2, spread  # noqa: E402  (chapters/figures/common.py)
from kvlab import measure  # noqa: E402

THREADS = 1            # the timed runs: see the note in setup()
FLOAT = 4              # bytes of a float32
PROMPT = "ROMEO:\n"
STORIES_PROMPT = "Once upon a time"
# SmolLM2's chat prompt: its own default system message and a question whose answer runs
# past 48 tokens (the runs do not stop at the end of the answer, so both ways run 48 steps)
CHAT = [{"role": "system",
         "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": "Explain in a few sentences why a language model "
                                    "writes its answer one token at a time."}]
COURSE = {"new_tokens": 48, "cached_seconds": 8.85, "uncached_seconds": 78.95,
          "time_ratio": 78.95 / 8.85, "cached_seconds_per_token": 8.85 / 48,
          "working_memory_ratio_256": 8.3, "per_token_saving": "75-90 %",
          "arithmetic_2048": "over 1,000x",
          "source": "the course's chapter on the KV cache (shared/seeds)"}
# Reruns of an earlier version of this script on another machine, reported in issue 22:
# the 256-token run's time ratio, above its FLOP ratio there.
RERUNS_ELSEWHERE = {"speedup_256": [124.7, 143.4],
                    "source": "issue 22: two reruns of ch01.py on another machine"}


def load_stories():
    # KVLAB_SHARED: the course's shared folder (holding models/) or its models folder itself
    shared = Path(os.environ.get("KVLAB_SHARED", Path(__file__).resolve().parents[3] / "shared"))
    folder = (shared / "models" if (shared / "models").is_dir() else shared) / "stories260K"
    if not (folder / "stories260K.bin").exists():
        return None
    return kvlab.load(folder / "stories260K.bin", tokenizer=folder / "tok512.bin")


# ---- 1. the cache is exact ------------------------------------------------------------------

def exactness(model) -> dict:
    cached = kvlab.generate(model, PROMPT, 48, use_cache=True)
    uncached = kvlab.generate(model, PROMPT, 48, use_cache=False)
    # every decode step's logits against the rows of one pass over the whole sequence
    ids = model.encode(PROMPT)
    cache = model.new_cache(len(ids) + 48 + 8)
    step_logits = [model.prefill(ids, cache)]
    for token in cached.tokens[:-1]:
        step_logits.append(model.decode(token, cache))
    first_keys = cache.keys[:, 0].copy()
    whole = model.forward(ids + cached.tokens[:-1], all_logits=True)[len(ids) - 1:]
    for token in cached.tokens[-8:]:          # more tokens: position 0's keys stay as they were
        model.decode(token, cache)
    return {"model": model.config.name, "prompt": PROMPT, "new_tokens": 48,
            "same_tokens": cached.tokens == uncached.tokens,
            "completion": cached.completion,
            "logits_bit_identical": bool(np.array_equal(np.stack(step_logits), whole)),
            "first_position_keys_unchanged": bool(np.array_equal(cache.keys[:, 0], first_keys)),
            "cache_length_after": cache.length}


# ---- 2. arithmetic from the shapes ----------------------------------------------------------

def arithmetic() -> dict:
    c = kvlab.ModelConfig.llama2_7b()
    n = 4096                                          # steps counted (context of the 7B model)
    # step s generates the token at position s after a one-token prompt: uncached, it runs
    # all s + 1 tokens; cached, step 0 is the prefill of the prompt and the rest decodes
    cached = np.array([measure.forward_counts(c, 1, s).flops for s in range(n)], dtype=np.float64)
    uncached = np.array([measure.forward_counts(c, s + 1, 0).flops for s in range(n)],
                        dtype=np.float64)
    ratio_by_length = np.cumsum(uncached) / np.cumsum(cached)
    ratio_2048 = measure.arithmetic_ratio(c, 1, 2048)
    assert abs(ratio_by_length[2047] - ratio_2048) < 1e-9 * ratio_2048
    over_1000 = int(np.argmax(ratio_by_length > 1000)) + 1
    u = measure.generation_counts(c, 1, 2048, use_cache=False)
    k = measure.generation_counts(c, 1, 2048, use_cache=True)
    parts = {}
    for field in ("flops_projections", "flops_mlp", "flops_attention", "flops_logits"):
        parts[field] = {"uncached": getattr(u, field), "cached": getattr(k, field),
                        "ratio": getattr(u, field) / getattr(k, field)}
    saving = {str(p): measure.per_token_saving(c, p) for p in (*range(16), 99, 2047)}
    step = {str(p): {"cached_flops": int(cached[p]), "uncached_flops": int(uncached[p])}
            for p in (0, 1, 3, 9, 99, 1023, 2047)}
    return {"config": c.name, "prompt_len": 1, "new_tokens": 2048,
            "weights_bytes_fp16": measure.weights_bytes(c, "fp16"),
            "arithmetic_ratio_2048": ratio_2048,
            "tokens_through_model": {"uncached": u.tokens, "cached": k.tokens,
                                     "ratio": u.tokens / k.tokens},
            "parts_2048": parts,
            "first_length_over_1000x": over_1000,
            "ratio_at": {str(m): float(ratio_by_length[m - 1]) for m in (48, 256, 1024, 2048, 4096)},
            "per_token_saving": saving,
            "per_token_saving_default_model": {
                str(p): measure.per_token_saving(kvlab.ModelConfig.shakespeare_1m(), p)
                for p in (3, 9)},
            "flops_per_step": step,
            "_curves": (cached, uncached, ratio_by_length)}


# ---- 3. timing ----------------------------------------------------------------------------

def timing_48(model, prompt, runs: int = 15, new_tokens: int = 48) -> dict:
    """new_tokens after `prompt` (text or token ids), cached and uncached, `runs` rounds of
    one run each way in turn (so each pair meets the same load). Other processes interrupt
    some runs on a shared machine, so the chapter quotes the median run and the spread over
    the runs (common.spread): the whole run's seconds each way, and the ratio of each pair."""
    kvlab.generate(model, prompt, 4, use_cache=True)            # warm up
    steps = {True: [], False: []}
    same = True
    for round in range(runs):
        # each round starts with the other way (appendix_measuring.md#measuring-side-by-side)
        for use_cache in ((True, False) if round % 2 == 0 else (False, True)):
            out = kvlab.generate(model, prompt, new_tokens, use_cache=use_cache,
                                 stop_at_eos=False)
            if use_cache:
                a = out
            else:
                b = out
        steps[True].append(a.step_seconds)
        steps[False].append(b.step_seconds)
        same = same and a.tokens == b.tokens
    cached = [float(s.sum()) for s in steps[True]]
    uncached = [float(s.sum()) for s in steps[False]]
    median_c, median_u = float(np.median(cached)), float(np.median(uncached))
    return {"model": model.config.name, "params": model.n_params,
            "weights_bytes": model.weights_nbytes,
            "prompt": prompt if isinstance(prompt, str) else None,
            "prompt_tokens": len(a.prompt_tokens), "new_tokens": new_tokens, "runs": runs,
            "same_tokens": same, "completion": a.completion,
            "cached_seconds": spread(cached), "uncached_seconds": spread(uncached),
            "speedup": spread([u / c for u, c in zip(uncached, cached)]),
            "cached_flops": a.flops, "uncached_flops": b.flops,
            "flop_ratio": b.flops / a.flops,
            "cached_gflops_per_s": a.flops / median_c / 1e9,
            "uncached_gflops_per_s": b.flops / median_u / 1e9,
            "cached_decode_ms": spread([1e3 * float(np.median(s[1:])) for s in steps[True]]),
            # the whole run's time per generated token, each way
            "cached_ms_per_token": 1e3 * median_c / new_tokens,
            "uncached_ms_per_token": 1e3 * median_u / new_tokens,
            "cached_gflop_per_token": a.flops / new_tokens / 1e9,
            "uncached_gflop_per_token": b.flops / new_tokens / 1e9,
            "tokens_through_model": {"cached": len(a.prompt_tokens) + new_tokens - 1,
                                     "uncached": sum(len(a.prompt_tokens) + i
                                                     for i in range(new_tokens))}}


def smollm2_timing(runs: int, new_tokens: int) -> dict:
    """The course's experiment on a trained chat model: SmolLM2-135M-Instruct (its Q4_1
    weights, as fetched; int8 activations, the kit's default for them), a ChatML prompt of
    a system and a user message, greedy, cached against uncached in turn."""
    model = smollm2()
    text, ids = kvlab.chat.prompt(model, CHAT)
    row = timing_48(model, ids, runs=runs, new_tokens=new_tokens)
    answer = kvlab.generate(model, messages=CHAT, max_new_tokens=new_tokens)
    c = model.config
    row.update({"messages": CHAT, "prompt_text": text, "weights": "q4_1",
                "answer_tokens_before_end_of_turn": len(answer.tokens),
                "answer_ended_within": answer.finish_reason != "length",
                "arithmetic_ratio_2048": measure.arithmetic_ratio(c, len(ids), 2048),
                "per_token_saving": {str(p): measure.per_token_saving(c, p)
                                     for p in (len(ids) - 1, len(ids) + new_tokens - 2)},
                "config": c.to_dict()})
    return row


def step_times(model, new_tokens: int = 256, runs: int = 5) -> dict:
    """Per-step wall times of `runs` runs each way, in turn: the whole runs' ratio over the
    runs (common.spread), and each step's median for the figure."""
    times = {True: [], False: []}
    for round in range(runs):
        for use_cache in ((True, False) if round % 2 == 0 else (False, True)):
            times[use_cache].append(kvlab.generate(model, PROMPT, new_tokens, use_cache=use_cache,
                                                   stop_at_eos=False).step_seconds)
    median = {k: np.median(np.stack(v), axis=0) for k, v in times.items()}
    prompt_len = len(model.encode(PROMPT))
    positions = prompt_len - 1 + np.arange(new_tokens)   # position of the step's last input
    tokens_in = positions + 1                            # tokens an uncached step runs
    cached = [float(s.sum()) for s in times[True]]
    uncached = [float(s.sum()) for s in times[False]]
    return {"model": model.config.name, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "runs": runs,
            "cached_seconds": spread(cached), "uncached_seconds": spread(uncached),
            "speedup": spread([u / c for u, c in zip(uncached, cached)]),
            "flop_ratio": measure.arithmetic_ratio(model.config, prompt_len, new_tokens),
            "cached_decode_ms_median": 1e3 * float(np.median(median[True][1:])),
            "uncached_ms_at": {str(int(t)): 1e3 * float(median[False][i])
                               for i, t in enumerate(tokens_in) if int(t) in (8, 64, 128, 262)},
            # an uncached step's time per token it runs, around the last 16 steps
            "uncached_ms_per_token_last": 1e3 * float(np.median(median[False][-16:] / tokens_in[-16:])),
            "_curves": (positions, median[True], median[False])}


# ---- 4. working memory ----------------------------------------------------------------------

def working(model, prompt: str, new_tokens: int = 256) -> dict:
    w = measure.working_memory(model, prompt, new_tokens)
    c = model.config
    length = len(model.encode(prompt)) + new_tokens - 1       # the last step's tokens
    rebuilt_kv = measure.kv_cache_bytes(c, length, dtype="fp32")
    one_layer_kv = rebuilt_kv // c.n_layers
    return {"model": c.name, "new_tokens": new_tokens, "threads": kvlab.get_num_threads(),
            "tokens_last_step": length,
            "cached_scratch": w.cached_scratch, "cache_bytes": w.cache_bytes,
            "cached_total": w.cached_total, "uncached_scratch": w.uncached_scratch,
            "uncached_rebuilt_kv": rebuilt_kv,
            "uncached_activations": w.uncached_scratch - rebuilt_kv,
            "ratio": w.ratio,
            # the same last step, holding one layer's K and V at a time
            "one_layer": {"scratch": w.uncached_one_layer_scratch, "kv": one_layer_kv,
                          "activations": w.uncached_one_layer_scratch - one_layer_kv,
                          "ratio": w.one_layer_ratio},
            "kv_floats_per_token": 2 * c.n_layers * c.kv_dim,
            "activation_floats_per_token": activation_floats(c)}


def activation_floats(c) -> int:
    """The floats of scratch one token needs in a forward call (csrc/model.c, run_state)."""
    return 3 * c.dim + 2 * c.q_dim + 2 * c.kv_dim + 2 * c.hidden_dim + c.head_dim


def working_from_shapes(c, length: int) -> dict:
    """The same accountings as working_memory, from the shapes: the last uncached step
    (every layer's K and V held, or one layer's) against the cache plus the scratch of one
    cached step (fp32, one thread). Then a third program's: one that also keeps a layer's
    whole (heads, tokens, tokens) matrices of scores and of softmax weights at once, and
    computes logits at every position without a cache (at the last one only with it), as
    straightforward implementations do."""
    cache = measure.kv_cache_bytes(c, length, dtype="fp32")
    cached = cache + measure.scratch_bytes(c, 1, 1)
    all_layers = measure.scratch_bytes(c, length, 1, cached=False)
    one_layer = measure.scratch_bytes(c, length, 1, cached=False, uncached_kv="one_layer")
    matrices = 2 * c.n_heads * length * length * FLOAT
    logits = length * c.vocab_size * FLOAT
    return {"config": c.name, "n_layers": c.n_layers, "tokens": length, "cache_bytes": cache,
            "cached": cached, "all_layers": all_layers, "ratio": all_layers / cached,
            "one_layer": one_layer, "one_layer_ratio": one_layer / cached,
            "one_layer_kv_bytes": cache // c.n_layers,
            "whole_matrices": {
                "score_matrices": matrices, "every_logit": logits,
                "uncached": all_layers + matrices + logits,
                "cached": cached + c.vocab_size * FLOAT,
                "ratio": (all_layers + matrices + logits) / (cached + c.vocab_size * FLOAT),
                "one_layer_ratio": (one_layer + matrices + logits)
                                   / (cached + c.vocab_size * FLOAT)},
            "kv_floats_per_token": 2 * c.n_layers * c.kv_dim,
            "activation_floats_per_token": activation_floats(c)}


# ---- figures --------------------------------------------------------------------------------

def plot_step_time(steps: dict, path: Path) -> None:
    positions, cached, uncached = steps["_curves"]
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=100)
    ax.plot(positions, 1e3 * uncached, label="without a cache (whole sequence each step)",
            color="#e45756", lw=1.2)
    ax.plot(positions, 1e3 * cached, label="with the KV cache (one token each step)",
            color="#4c78a8", lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("position of the step's newest input token")
    ax.set_ylabel("ms per step (log scale)")
    ax.set_title(f"{steps['model']}: {steps['new_tokens']} greedy tokens, {THREADS} thread, "
                 f"median of {steps['runs']} runs", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_flops(arith: dict, path: Path) -> None:
    cached, uncached, ratio = arith["_curves"]
    steps = np.arange(1, len(cached) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=100)
    left.plot(steps - 1, uncached / 1e9, color="#e45756", label="without a cache")
    left.plot(steps - 1, cached / 1e9, color="#4c78a8", label="with the KV cache")
    left.set_yscale("log")
    left.set_xlabel("position of the token generated")
    left.set_ylabel("GFLOPs for that step (log)")
    left.set_title("Llama 2 7B shape: arithmetic per step", fontsize=10)
    left.legend(fontsize=8)
    left.grid(alpha=0.3, which="both")
    right.plot(steps, ratio, color="#54a24b")
    right.axhline(1000, color="#999", ls="--", lw=1)
    r2048 = arith["arithmetic_ratio_2048"]
    right.plot([2048], [r2048], "o", color="#54a24b")
    right.annotate(f"2,048 tokens: {r2048:.0f}x", (2048, r2048), textcoords="offset points",
                   xytext=(-120, 12), fontsize=8)
    right.text(60, 1030, "1,000x", fontsize=8, color="#666")
    right.set_xlabel("tokens generated (after a 1-token prompt)")
    right.set_ylabel("uncached / cached FLOPs, whole run")
    right.set_title("the whole run's ratio grows with its length", fontsize=10)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_working_memory(rows: list, shape: dict, path: Path) -> None:
    """Left, measured: for each kit model, the cached run (cache + scratch) against the
    uncached run holding every layer's K and V or one layer's. Right: the same three bars
    from the shapes of a 7B model, where the activations are small beside the cache."""
    colors = {"cache": "#4c78a8", "scratch": "#9ecae9", "kv": "#e45756", "act": "#ff9d98"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100,
                             gridspec_kw={"width_ratios": [1.6, 1]})

    def bars(ax, y, cache, scratch, kv_all, act_all, kv_one, act_one, unit, legend):
        for dy, parts in ((0.3, ((cache, "cache", "KV cache"), (scratch, "scratch", "scratch of one call"))),
                          (0.0, ((kv_all, "kv", "K and V rebuilt"), (act_all, "act", "activations and attention scratch"))),
                          (-0.3, ((kv_one, "kv", None), (act_one, "act", None)))):
            left = 0.0
            for value, color, label in parts:
                ax.barh(y + dy, value * unit, 0.26, left=left, color=colors[color],
                        label=label if legend else None)
                left += value * unit
        total = cache + scratch
        for dy, kv, act in ((0.0, kv_all, act_all), (-0.3, kv_one, act_one)):
            ax.text((kv + act) * unit, y + dy, f"  {(kv + act) / total:.2f}x", va="center", fontsize=7)

    left, right = axes
    labels, ticks = [], []
    for i, row in enumerate(rows):
        one = row["one_layer"]
        bars(left, i, row["cache_bytes"], row["cached_scratch"], row["uncached_rebuilt_kv"],
             row["uncached_activations"], one["kv"], one["activations"], 1 / 1024, i == 0)
        ticks += [i + 0.3, i, i - 0.3]
        labels += [f"{row['model']}: with the cache", "without: all layers' K, V",
                   "without: one layer's K, V"]
    left.set_yticks(ticks, labels, fontsize=7)
    left.set_xlabel("KiB, peak of one call (measured, 256 new tokens)")
    left.set_title("the kit's models, counted by the core", fontsize=10)
    left.set_xlim(0, max(r["uncached_scratch"] for r in rows) / 1024 * 1.15)

    c = shape
    cache, kv_one = c["cache_bytes"], c["cache_bytes"] // c["n_layers"]
    bars(right, 0, cache, c["cached"] - cache, cache, c["all_layers"] - cache, kv_one,
         c["one_layer"] - kv_one, 1e-6, False)
    right.set_yticks([0.3, 0, -0.3], ["with the cache", "without: all layers' K, V",
                                      "without: one layer's K, V"], fontsize=7)
    right.set_xlabel(f"MB, from the shapes ({c['tokens']} tokens, fp32)")
    right.set_title(f"{c['config']} shape", fontsize=10)
    right.set_xlim(0, max(c["all_layers"], c["cached"]) * 1e-6 * 1.15)
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def strip(d):
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if not k.startswith("_")}
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    args = parser.parse_args()
    out, quick = Path(args.out), args.quick
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    default_threads = kvlab.get_num_threads()
    kvlab.set_num_threads(THREADS)
    # --quick: the same code, fewer rounds and tokens
    runs_48, runs_steps, steps_tokens, wm_tokens = (3, 2, 64, 64) if quick else (15, 5, 256, 256)
    smol_runs, smol_tokens = (2, 8) if quick else (7, 48)

    model = kvlab.load()
    stories = load_stories()
    result = {"setup": {**machine(), "default_threads": default_threads, "threads": THREADS,
                        "quick": quick,
                        "note": "a shared 2-core machine, quiet during the final run (load "
                                "average about 1); timed with one thread of the C core, cached and "
                                "uncached in turn, ratios as medians of the pairs' ratios "
                                "(chapters/appendix_measuring.md)",
                        "model": "shakespeare-1m (kvlab.load()); SmolLM2-135M-Instruct Q4_1 "
                                 "(kvlab.load('smollm2-135m')) for the chat timing",
                        "stories260K": stories is not None},
              "course": COURSE, "reruns_elsewhere": RERUNS_ELSEWHERE}
    result["exactness"] = {"shakespeare-1m": exactness(model)}
    arith = arithmetic()
    result["arithmetic"] = arith
    result["timing_48"] = {"shakespeare-1m": timing_48(model, PROMPT, runs=runs_48)}
    if stories is not None:
        result["exactness"]["stories260K"] = {
            "same_tokens": kvlab.generate(stories, STORIES_PROMPT, 48).tokens
            == kvlab.generate(stories, STORIES_PROMPT, 48, use_cache=False).tokens}
        result["timing_48"]["stories260K"] = timing_48(stories, STORIES_PROMPT, runs=runs_48)
    # the bundled model's step times before SmolLM2 is loaded: loading and freeing its
    # large blocks moves glibc's mmap threshold, and the uncached steps' fresh scratch would
    # then come from the heap at a cost that varies from step to step
    steps = step_times(model, new_tokens=steps_tokens, runs=runs_steps)
    result["step_times_256"] = steps
    result["timing_48"]["smollm2"] = smol = smollm2_timing(smol_runs, smol_tokens)
    wm = [working(model, PROMPT, wm_tokens)]
    if stories is not None:
        wm.append(working(stories, STORIES_PROMPT, wm_tokens))
    result["working_memory_256"] = {row["model"]: row for row in wm}
    result["working_memory_from_shapes"] = {
        c.name: working_from_shapes(c, 262) for c in
        (kvlab.ModelConfig.shakespeare_1m(), kvlab.ModelConfig.stories260k(),
         kvlab.ModelConfig(**smol["config"]).replace(name="SmolLM2-135M"),
         kvlab.ModelConfig.tinyllama_1b(), kvlab.ModelConfig.llama2_7b())}
    # Appendix B (chapters/appendix_course.md) sets the course's figures beside the kit's
    result["course_vs_kit"] = {
        "course_seconds_per_token": COURSE["cached_seconds_per_token"],
        "course_time_ratio": COURSE["time_ratio"],
        "smollm2_cached_ms_per_token": smol["cached_ms_per_token"],
        "smollm2_time_ratio": smol["speedup"]["median"],
        "smollm2_flop_ratio": smol["flop_ratio"],
        "course_over_smollm2_per_token": COURSE["cached_seconds_per_token"]
                                         / (smol["cached_ms_per_token"] / 1e3)}

    plot_step_time(steps, out / "ch01_step_time.png")
    plot_flops(arith, out / "ch01_flops.png")
    plot_working_memory(wm, result["working_memory_from_shapes"]["Llama 2 7B"],
                        out / "ch01_working_memory.png")
    result["setup"]["script_seconds"] = round(time.perf_counter() - started, 1)
    (out / "ch01.json").write_text(json.dumps(strip(result), indent=2) + "\n")
    print(json.dumps({k: {f: v[f] for f in ("speedup", "flop_ratio", "cached_ms_per_token",
                                              "uncached_ms_per_token", "same_tokens")}
                      for k, v in strip(result)["timing_48"].items()}, indent=1))
    print(f"wrote {out}/ch01_*.png and ch01.json in {result['setup']['script_seconds']} s")


if __name__ == "__main__":
    main()
