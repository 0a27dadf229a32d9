"""Figures and numbers for chapter 1, "Autoregressive decoding and the KV cache".

    python chapters/figures/ch01.py [--out DIR]

Writes ch01_step_time.png, ch01_flops.png, ch01_working_memory.png and ch01.json (every
number the chapter quotes, with the setup) into DIR (default: this script's folder).
Runs in about 30 s on a 2-core machine.

1. Exactness: greedy generation with and without the cache gives the same tokens; the
   logits of every decode step equal, bit for bit, the rows of one uncached pass over
   the whole sequence; the first position's cached keys do not change as the text grows.
2. Arithmetic from the shapes alone (kvlab.measure): FLOPs per step with and without the
   cache on the Llama 2 7B shape, the whole-run ratio for 2,048 tokens (arithmetic_ratio),
   where it crosses 1,000x, and per_token_saving by position.
3. Timing on this machine, one thread of the C core: 48 new tokens after a short prompt,
   cached and uncached, each step's best of 15 runs (the course's experiment, on the kit's
   models),
   and the wall time of every step of a 256-token run.
4. Working memory (kvlab.measure.working_memory) for 256 new tokens, and the same
   accounting from the shapes (kvlab.measure.scratch_bytes) for the Llama 2 7B shape.
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
from common import machine  # noqa: E402  (chapters/figures/common.py)
from kvlab import measure  # noqa: E402

THREADS = 1            # the timed runs: see the note in setup()
PROMPT = "ROMEO:\n"
STORIES_PROMPT = "Once upon a time"
COURSE = {"new_tokens": 48, "cached_seconds": 8.85, "uncached_seconds": 78.95,
          "working_memory_ratio_256": 8.3, "per_token_saving": "75-90 %",
          "arithmetic_2048": "over 1,000x"}


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
    saving = {str(p): measure.per_token_saving(c, p) for p in range(16)}
    step = {str(p): {"cached_flops": int(cached[p]), "uncached_flops": int(uncached[p])}
            for p in (0, 1, 3, 9, 99, 1023, 2047)}
    return {"config": c.name, "prompt_len": 1, "new_tokens": 2048,
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

def timing_48(model, prompt: str, repeats: int = 15) -> dict:
    """48 new tokens, cached and uncached, `repeats` runs of each in turn (so both meet the
    same load). A busy machine interrupts some steps of some runs; each step's fastest time
    over the runs, summed, is the closest to what the steps cost (best_steps_*), and the
    fastest whole run is reported beside it (best_run_*)."""
    kvlab.generate(model, prompt, 8, use_cache=True)            # warm up
    steps = {True: [], False: []}
    same = True
    for _ in range(repeats):
        a = kvlab.generate(model, prompt, 48, use_cache=True, stop_at_eos=False)
        b = kvlab.generate(model, prompt, 48, use_cache=False, stop_at_eos=False)
        steps[True].append(a.step_seconds)
        steps[False].append(b.step_seconds)
        same = same and a.tokens == b.tokens
    best_c = float(np.min(np.stack(steps[True]), axis=0).sum())
    best_u = float(np.min(np.stack(steps[False]), axis=0).sum())
    run_c = float(min(s.sum() for s in steps[True]))
    run_u = float(min(s.sum() for s in steps[False]))
    return {"model": model.config.name, "params": model.n_params, "prompt": prompt,
            "prompt_tokens": len(a.prompt_tokens), "new_tokens": 48, "repeats": repeats,
            "same_tokens": same, "completion": a.completion,
            "cached_seconds": best_c, "uncached_seconds": best_u,
            "speedup": best_u / best_c,
            "best_run_cached_seconds": run_c, "best_run_uncached_seconds": run_u,
            "best_run_speedup": run_u / run_c,
            "cached_flops": a.flops, "uncached_flops": b.flops,
            "flop_ratio": b.flops / a.flops,
            "cached_gflops_per_s": a.flops / best_c / 1e9,
            "uncached_gflops_per_s": b.flops / best_u / 1e9,
            "cached_ms_per_token": 1e3 * best_c / 48,
            "cached_decode_ms_median": 1e3 * float(np.median(np.min(np.stack(steps[True]), axis=0)[1:])),
            "first_step_ms": {"cached": 1e3 * float(np.min(np.stack(steps[True]), axis=0)[0]),
                              "uncached": 1e3 * float(np.min(np.stack(steps[False]), axis=0)[0])}}


def step_times(model, new_tokens: int = 256, repeats: int = 2) -> dict:
    """Per-step wall times, the element-wise best of `repeats` runs of each."""
    best = {}
    for use_cache in (True, False):
        runs = [kvlab.generate(model, PROMPT, new_tokens, use_cache=use_cache).step_seconds
                for _ in range(repeats)]
        best[use_cache] = np.min(np.stack(runs), axis=0)
    prompt_len = len(model.encode(PROMPT))
    positions = prompt_len - 1 + np.arange(new_tokens)   # position of the step's last input
    tokens_in = positions + 1                            # tokens an uncached step runs
    return {"model": model.config.name, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats,
            "cached_total_seconds": float(best[True].sum()),
            "uncached_total_seconds": float(best[False].sum()),
            "speedup": float(best[False].sum() / best[True].sum()),
            "flop_ratio": measure.arithmetic_ratio(model.config, prompt_len, new_tokens),
            "cached_decode_ms_median": 1e3 * float(np.median(best[True][1:])),
            "uncached_ms_at": {str(int(t)): 1e3 * float(best[False][i])
                               for i, t in enumerate(tokens_in) if int(t) in (8, 64, 128, 262)},
            # an uncached step's time per token it runs, around the last 16 steps
            "uncached_ms_per_token_last": 1e3 * float(np.median(best[False][-16:] / tokens_in[-16:])),
            "_curves": (positions, best[True], best[False])}


# ---- 4. working memory ----------------------------------------------------------------------

def working(model, prompt: str, new_tokens: int = 256) -> dict:
    w = measure.working_memory(model, prompt, new_tokens)
    c = model.config
    length = len(model.encode(prompt)) + new_tokens - 1       # the last step's tokens
    rebuilt_kv = measure.kv_cache_bytes(c, length, dtype="fp32")
    return {"model": c.name, "new_tokens": new_tokens, "threads": kvlab.get_num_threads(),
            "tokens_last_step": length,
            "cached_scratch": w.cached_scratch, "cache_bytes": w.cache_bytes,
            "cached_total": w.cached_total, "uncached_scratch": w.uncached_scratch,
            "uncached_rebuilt_kv": rebuilt_kv,
            "uncached_activations": w.uncached_scratch - rebuilt_kv,
            "ratio": w.ratio,
            "kv_floats_per_token": 2 * c.n_layers * c.kv_dim,
            "activation_floats_per_token": 3 * c.dim + 2 * c.q_dim + 2 * c.kv_dim
                                           + 2 * c.hidden_dim + c.head_dim}


def working_from_shapes(c, length: int) -> dict:
    """The same accounting as working_memory, from the shapes: the last uncached step
    against the cache plus the scratch of one cached step (fp32, one thread)."""
    uncached = measure.scratch_bytes(c, length, 1, cached=False)
    cached = measure.kv_cache_bytes(c, length, dtype="fp32") + measure.scratch_bytes(c, 1, 1)
    return {"config": c.name, "tokens": length, "uncached": uncached, "cached": cached,
            "ratio": uncached / cached,
            "kv_floats_per_token": 2 * c.n_layers * c.kv_dim,
            "activation_floats_per_token": 3 * c.dim + 2 * c.q_dim + 2 * c.kv_dim
                                           + 2 * c.hidden_dim + c.head_dim}


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
                 f"best of {steps['repeats']}", fontsize=10)
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


def plot_working_memory(rows: list, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8.5, 3.2), dpi=100)
    labels, y = [], 0
    for row in rows:
        kib = 1 / 1024
        ax.barh(y + 0.2, row["cache_bytes"] * kib, 0.35, color="#4c78a8", label="KV cache" if y == 0 else None)
        ax.barh(y + 0.2, row["cached_scratch"] * kib, 0.35, left=row["cache_bytes"] * kib,
                color="#9ecae9", label="scratch of one call" if y == 0 else None)
        ax.barh(y - 0.2, row["uncached_rebuilt_kv"] * kib, 0.35, color="#e45756",
                label="K and V rebuilt each step" if y == 0 else None)
        ax.barh(y - 0.2, row["uncached_activations"] * kib, 0.35,
                left=row["uncached_rebuilt_kv"] * kib, color="#ff9d98",
                label="activations of every token" if y == 0 else None)
        ax.text(row["uncached_scratch"] * kib, y - 0.2, f"  {row['ratio']:.1f}x", va="center",
                fontsize=8)
        labels += [f"{row['model']}\nwithout cache", f"{row['model']}\nwith cache"]
        y += 1
    ticks = []
    for i in range(len(rows)):
        ticks += [i - 0.2, i + 0.2]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("KiB of working memory, peak (256 new tokens)")
    ax.set_title("what each way of generating holds at its peak", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlim(0, max(r["uncached_scratch"] for r in rows) / 1024 * 1.12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def strip(d):
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if not k.startswith("_")}
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    default_threads = kvlab.get_num_threads()
    kvlab.set_num_threads(THREADS)

    model = kvlab.load()
    stories = load_stories()
    result = {"setup": {**machine(), "default_threads": default_threads, "threads": THREADS,
                        "note": "timed with one thread of the C core: on this shared 2-core "
                                "machine two threads wait on each other whenever another "
                                "process holds a core, and these small models gain nothing "
                                "from a second thread",
                        "model": "shakespeare-1m (kvlab.load())",
                        "stories260K": stories is not None},
              "course": COURSE}
    result["exactness"] = {"shakespeare-1m": exactness(model)}
    arith = arithmetic()
    result["arithmetic"] = arith
    result["timing_48"] = {"shakespeare-1m": timing_48(model, PROMPT)}
    if stories is not None:
        result["exactness"]["stories260K"] = {
            "same_tokens": kvlab.generate(stories, STORIES_PROMPT, 48).tokens
            == kvlab.generate(stories, STORIES_PROMPT, 48, use_cache=False).tokens}
        result["timing_48"]["stories260K"] = timing_48(stories, STORIES_PROMPT)
    steps = step_times(model)
    result["step_times_256"] = steps
    wm = [working(model, PROMPT)]
    if stories is not None:
        wm.append(working(stories, STORIES_PROMPT))
    result["working_memory_256"] = {row["model"]: row for row in wm}
    result["working_memory_from_shapes"] = {
        c.name: working_from_shapes(c, 262) for c in
        (kvlab.ModelConfig.shakespeare_1m(), kvlab.ModelConfig.llama2_7b())}

    plot_step_time(steps, out / "ch01_step_time.png")
    plot_flops(arith, out / "ch01_flops.png")
    plot_working_memory(wm, out / "ch01_working_memory.png")
    result["setup"]["script_seconds"] = round(time.perf_counter() - started, 1)
    (out / "ch01.json").write_text(json.dumps(strip(result), indent=2) + "\n")
    print(json.dumps(strip(result)["timing_48"], indent=1))
    print(f"wrote {out}/ch01_*.png and ch01.json in {result['setup']['script_seconds']} s")


if __name__ == "__main__":
    main()
