"""Figures and numbers for chapter 2, "How big is the cache".

    python chapters/figures/ch02.py [--out DIR]

Writes ch02_cache_growth.png, ch02_formula_vs_measured.png and ch02.json (every number
the chapter quotes, with the setup; "facts": those it quotes from elsewhere, with their
sources) into DIR (default: this script's folder). Runs in
about 20 s on a 2-core machine.

1. Exact arithmetic (kvlab.kv_bytes_per_token, kvlab.kv_cache_bytes): the Llama 2 7B
   worked example, bytes per token of every preset in each cache format, and the number
   of cached tokens at which the cache outgrows the model's fp16 weights.
2. Measurement on the bundled model: cache.nbytes against the formula;
   kvlab.measure.measure_memory (formula, allocated, resident growth after creating and
   after filling) for 64 caches of 512 positions, first thing in this process (matplotlib
   is imported afterwards), and again for 16 caches after those were freed; and one cache
   of 65,536 positions (100 MB, always memory-mapped by the C allocator) filled with
   cache.append 4,096 positions at a time, the resident size read after each.
3. A real 8K-context GQA model, SmolLM2-135M-Instruct: its K/V bytes per token in each of
   the kit's cache formats (formula, and cache.nbytes of a real cache of its 8,192
   positions), the resident growth of one int8 cache filled with cache.append, and its
   weights at Q4_1 (as fetched: Q8_0 embeddings), Q8_0 and fp16, formula and loaded: when
   does its cache outgrow its weights.
4. Facts for the design questions (Llama 3 70B's shape, from its paper).

--quick runs the same code on smaller caches.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

import kvlab
from common import machine, smollm2  # noqa: E402  (chapters/figures/common.py)
from kvlab import measure
from kvlab.quant import FORMATS as CACHE_FORMATS

# matplotlib is imported only after the memory measurements (see pyplot() below)

GIB = 2 ** 30
THREADS = 1
CONTEXT = 512
BATCHES = (64, 16)        # 64 first: the first measurement in a fresh process
BIG = 65536               # positions of the cache filled step by step
STEP = 4096
FORMATS = ("fp32", "fp16", "int8", "fp8", "int4")
PRESETS = ("llama2-7b", "llama3-8b", "llama3.1-8b", "llama2-70b", "tinyllama-1.1b",
           "stories260k", "shakespeare-1m")
# numbers the chapter quotes from elsewhere, with where they come from (written to the JSON
# as "facts")
FACTS = {
    "llama_3_1_version": {
        "value": 3.1,
        "source": "a model's name, not a measurement: Meta's Llama 3.1 (July 2024), "
                  "meta-llama/Llama-3.1-8B on Hugging Face; its shape is the llama3.1-8b "
                  "preset of kvlab.ModelConfig"},
    # Check yourself, question 6: tensor parallelism splits the KV heads across the GPUs
    "llama3_70b": {
        "config": {"dim": 8192, "hidden_dim": 28672, "n_layers": 80, "n_heads": 64,
                   "n_kv_heads": 8, "vocab_size": 128256, "max_seq_len": 8192,
                   "tied_embeddings": False, "name": "Llama 3 70B"},
        "gpus": 8,
        "source": "Grattafiori et al., The Llama 3 Herd of Models, arXiv:2407.21783, "
                  "Table 3 (70B: 80 layers, model dimension 8,192, FFN 28,672, 64 attention "
                  "heads, 8 key/value heads); Meta's Llama 3 model card (8K context)"},
}
WEIGHT_FORMATS = ("q4_1", "q8_0", "fp16")
GB = 10 ** 9


def worked_example() -> dict:
    c = kvlab.ModelConfig.llama2_7b()
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2       # by hand
    assert per_token == kvlab.kv_bytes_per_token(c, "fp16")
    request = kvlab.kv_cache_bytes(c, 4096, dtype="fp16")
    sixteen = kvlab.kv_cache_bytes(c, 4096, batch=16, dtype="fp16")
    weights = measure.weights_bytes(c, "fp16")
    return {"config": c.name, "n_layers": c.n_layers, "dim": c.dim, "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "kind": c.attention_kind,
            "bytes_per_token_fp16": per_token, "kib_per_token": per_token / 1024,
            "bytes_4096": request, "gib_4096": request / GIB,
            "bytes_16x4096": sixteen, "gib_16x4096": sixteen / GIB, "gb_16x4096": sixteen / 1e9,
            "params": c.n_params(), "weights_bytes_fp16": weights,
            "weights_gb": weights / 1e9, "weights_gib": weights / GIB,
            "requests_of_4096_to_outgrow_weights": math.floor(weights / request) + 1,
            "cache_16x4096_over_weights": sixteen / weights,
            "gb_per_gib": GIB / 1e9,
            "bytes_per_token": {f: kvlab.kv_bytes_per_token(c, f) for f in FORMATS},
            "fraction_of_fp16": {f: kvlab.kv_bytes_per_token(c, f) / per_token
                                 for f in FORMATS}}


def presets() -> dict:
    rows = {}
    for key in PRESETS:
        c = kvlab.ModelConfig.presets()[key]
        per_token = kvlab.kv_bytes_per_token(c, "fp16")
        weights = measure.weights_bytes(c, "fp16")
        crossover = math.floor(weights / per_token) + 1      # tokens whose cache > weights
        rows[key] = {"name": c.name, "n_layers": c.n_layers, "n_heads": c.n_heads,
                     "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                     "kind": c.attention_kind, "max_seq_len": c.max_seq_len,
                     "params": c.n_params(),
                     "bytes_per_token": {f: kvlab.kv_bytes_per_token(c, f) for f in FORMATS},
                     "bytes_per_token_if_mha_fp16": kvlab.kv_bytes_per_token(
                         c.replace(n_kv_heads=c.n_heads), "fp16"),
                     "bytes_full_context_fp16": kvlab.kv_cache_bytes(c, c.max_seq_len, dtype="fp16"),
                     "weights_bytes_fp16": weights,
                     "crossover_tokens_fp16": crossover,
                     "crossover_requests_at_full_context": math.ceil(crossover / c.max_seq_len)}
    return rows


def measured(model) -> dict:
    c = model.config
    cache = model.new_cache(CONTEXT)
    by_hand = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * CONTEXT
    int8 = model.new_cache(CONTEXT, "int8")
    return {"context": CONTEXT, "nbytes_fp32": cache.nbytes, "by_hand_fp32": by_hand,
            "formula_fp32": kvlab.kv_cache_bytes(c, CONTEXT, dtype="fp32"),
            "nbytes_int8": int8.nbytes,
            "formula_int8": kvlab.kv_cache_bytes(c, CONTEXT, dtype="int8"),
            "bytes_per_token_fp32": kvlab.kv_bytes_per_token(c, "fp32"),
            "bytes_per_token_int8": kvlab.kv_bytes_per_token(c, "int8"),
            "weights_nbytes": model.weights_nbytes}


def fill_curve(model) -> dict:
    """Resident growth while one large cache fills: creating it, then after every STEP
    positions appended (random rows; attention never runs)."""
    c = model.config
    rows = np.random.default_rng(0).standard_normal(
        (STEP, c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
    measure.release_freed_memory()
    before = measure.resident_bytes()
    cache = model.new_cache(BIG)
    measure.release_freed_memory()
    written, growth = [0], [measure.resident_bytes() - before]
    while cache.length < cache.capacity:
        cache.append(rows, rows)
        measure.release_freed_memory()
        written.append(cache.length)
        growth.append(measure.resident_bytes() - before)
    per_token = kvlab.kv_bytes_per_token(c, "fp32")
    return {"capacity": BIG, "nbytes": cache.nbytes, "bytes_per_token": per_token,
            "positions_written": written, "resident_growth": growth,
            "created_growth": growth[0], "full_growth": growth[-1],
            "full_over_formula": growth[-1] / cache.nbytes,
            "full_excess_over_formula": growth[-1] / cache.nbytes - 1,
            "growth_per_position_fit": float(np.polyfit(written, growth, 1)[0])}


def memory_report(model, batch: int) -> dict:
    r = measure.measure_memory(model, CONTEXT, batch)
    return {"batch": batch, "context": CONTEXT, "formula_bytes": r.formula_bytes,
            "allocated_bytes": r.allocated_bytes,
            "rss_after_create": r.rss_after_create, "rss_after_fill": r.rss_after_fill,
            "fill_over_formula": r.rss_after_fill / r.formula_bytes,
            "fill_excess_over_formula": r.rss_after_fill / r.formula_bytes - 1,
            "create_over_formula": r.rss_after_create / r.formula_bytes,
            "weights_bytes": r.weights_bytes, "scratch_bytes": r.scratch_bytes,
            "table": r.table()}


def smollm2_bytes(quick: bool) -> dict:
    """SmolLM2-135M-Instruct's cache in every cache format at its full context, against its
    weights in three formats. Formula (kvlab.kv_bytes_per_token, kv_cache_bytes,
    measure.weights_bytes) and measured (cache.nbytes of real caches, the loaded model's
    weights_nbytes, the resident growth of filling one int8 cache)."""
    model = smollm2()
    c = model.config
    context = 1024 if quick else c.max_seq_len
    by_hand_fp16 = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    formats = {}
    for f in CACHE_FORMATS:
        cache = model.new_cache(context, f)
        formats[f] = {"bytes_per_token": kvlab.kv_bytes_per_token(c, f),
                      "bytes_full_context": kvlab.kv_cache_bytes(c, c.max_seq_len, dtype=f),
                      "nbytes_measured": cache.nbytes, "measured_context": context,
                      "nbytes_equals_formula":
                          cache.nbytes == kvlab.kv_cache_bytes(c, context, dtype=f),
                      "mb_full_context": kvlab.kv_cache_bytes(c, c.max_seq_len, dtype=f) / 1e6}
        del cache
    # resident growth while one int8 cache of the full context fills (random rows)
    rows = np.random.default_rng(0).standard_normal(
        (512, c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
    measure.release_freed_memory()
    before = measure.resident_bytes()
    cache = model.new_cache(context, "int8")
    measure.release_freed_memory()
    created = measure.resident_bytes() - before
    while cache.length < cache.capacity:
        cache.append(rows, rows)
    measure.release_freed_memory()
    filled = measure.resident_bytes() - before
    fill = {"dtype": "int8", "context": context, "nbytes": cache.nbytes,
            "created_growth": created, "filled_growth": filled,
            "filled_over_nbytes": filled / cache.nbytes}
    del cache
    weights = {"as_fetched": {"format": "q4_1 matrices, q8_0 embedding (the GGUF file's own)",
                              "measured": model.weights_nbytes}}
    for w in WEIGHT_FORMATS:
        weights[w] = {"formula": measure.weights_bytes(c, w)}
    for w in ("q8_0", "fp16"):
        weights[w]["measured"] = smollm2(weights=w).weights_nbytes
    weights["q4_1"]["measured"] = model.weights_nbytes   # as fetched (see above)
    for w, row in weights.items():
        for key in ("formula", "measured"):
            if key in row:
                row[f"{key}_mb"] = row[key] / 1e6
    # when the cache outgrows the weights: tokens (over all requests), and 8,192-token chats
    crossover = {}
    for w in WEIGHT_FORMATS:
        size = weights[w]["measured"]
        crossover[w] = {f: {"tokens": size // formats[f]["bytes_per_token"] + 1,
                            "full_context_requests": size / formats[f]["bytes_full_context"]}
                        for f in CACHE_FORMATS}
    return {"name": c.name, "config": c.to_dict(), "params": c.n_params(),
            "by_hand_fp16_bytes_per_token": by_hand_fp16,
            "formats": formats, "fill_int8": fill, "weights": weights,
            "crossover": crossover,
            "fp16_cache_over_q4_1_weights_at_full_context":
                formats["fp16"]["bytes_full_context"] / weights["q4_1"]["measured"],
            # Check yourself, question 7: 4,096-token chats in 10^9 bytes
            "chats_of_4096_in_1e9_bytes": {f: GB // kvlab.kv_cache_bytes(c, 4096, dtype=f)
                                           for f in CACHE_FORMATS}}


def design_questions() -> dict:
    """Question 6: Llama 3 70B on 8 GPUs, one KV head each (tensor parallelism)."""
    fact = FACTS["llama3_70b"]
    c = kvlab.ModelConfig(**fact["config"])
    per_gpu = c.replace(n_kv_heads=c.n_kv_heads // fact["gpus"])
    return {"llama3_70b_bytes_per_token_fp16": kvlab.kv_bytes_per_token(c, "fp16"),
            "llama3_70b_bytes_per_token_per_gpu_fp16": kvlab.kv_bytes_per_token(per_gpu, "fp16")}


def pyplot():
    """Imported late on purpose: importing matplotlib frees large blocks, and once glibc
    has freed a large block it raises its mmap threshold, so later caches come from its
    heap (see the chapter). The first measurement is made before that happens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_growth(rows: dict, path: Path, smol: dict = None) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=100)
    tokens = np.logspace(np.log10(256), np.log10(1_048_576), 200)
    colors = {"llama2-7b": "#e45756", "llama3-8b": "#4c78a8", "llama2-70b": "#54a24b",
              "tinyllama-1.1b": "#b279a2"}
    for key, color in colors.items():
        row = rows[key]
        per_token = row["bytes_per_token"]["fp16"]
        ax.plot(tokens, tokens * per_token / GIB, color=color,
                label=f"{row['name']} ({row['kind']}, {per_token / 1024:g} KiB/token)")
        ax.axhline(row["weights_bytes_fp16"] / GIB, color=color, ls="--", lw=1)
        cross = row["crossover_tokens_fp16"]
        ax.plot([cross], [row["weights_bytes_fp16"] / GIB], "o", color=color, ms=5)
        ctx = row["max_seq_len"]
        ax.plot([ctx], [ctx * per_token / GIB], "|", color=color, ms=12, mew=2)
    # Llama 3.1 8B: Llama 3 8B's shape (the same line), trained to 128K positions
    long = rows["llama3.1-8b"]
    ctx, per_token = long["max_seq_len"], long["bytes_per_token"]["fp16"]
    ax.plot([ctx], [ctx * per_token / GIB], "|", color=colors["llama3-8b"], ms=12, mew=2)
    ax.annotate(f"{long['name']}: one request\nat {ctx // 1024}K", (ctx, ctx * per_token / GIB),
                textcoords="offset points", xytext=(6, -22), fontsize=7, color=colors["llama3-8b"])
    if smol is not None:      # the kit's real model: its fp16 cache against its weights
        color, per_token = "#f58518", smol["formats"]["fp16"]["bytes_per_token"]
        ax.plot(tokens, tokens * per_token / GIB, color=color,
                label=f"SmolLM2-135M (GQA, {per_token / 1024:g} KiB/token)")
        for fmt, style in (("fp16", "--"), ("q4_1", ":")):
            weights = smol["weights"][fmt]["measured"]
            ax.axhline(weights / GIB, color=color, ls=style, lw=1)
            ax.plot([weights // per_token + 1], [weights / GIB], "o", color=color, ms=5)
        ctx = smol["config"]["max_seq_len"]
        ax.plot([ctx], [ctx * per_token / GIB], "|", color=color, ms=12, mew=2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks([2 ** k for k in range(8, 21, 2)],
                  [f"{2 ** k}" if k < 10 else f"{2 ** k // 1024}K" if k < 20 else "1M"
                   for k in range(8, 21, 2)])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_yticks([2.0 ** k for k in range(-10, 9, 2)],
                  [f"1/{2 ** -k}" if k < 0 else f"{2 ** k}" for k in range(-10, 9, 2)])
    ax.yaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("tokens in the cache, summed over requests (log scale)")
    ax.set_ylabel("GiB, fp16 (log scale)")
    ax.set_title("KV cache (lines) against the fp16 weights (dashed; dotted: SmolLM2's Q4_1 "
                 "weights);\ndots: cache = weights; bars: one request at the model's full context",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="major")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_measured(reports: list, curve: dict, model_name: str, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100,
                                      gridspec_kw={"width_ratios": [1.2, 1]})
    first = reports[0]
    names = ["formula", "allocated\n(nbytes)", "resident after\ncreating",
             "resident after\nfilling"]
    values = [first["formula_bytes"], first["allocated_bytes"], first["rss_after_create"],
              first["rss_after_fill"]]
    bars = left.bar(range(4), np.array(values) / 2 ** 20,
                    color=["#4c78a8", "#9ecae9", "#f58518", "#e45756"])
    for bar, v in zip(bars, values):
        left.text(bar.get_x() + bar.get_width() / 2, v / 2 ** 20 + 0.5, f"{v / 2 ** 20:.2f}",
                  ha="center", fontsize=8)
    left.set_xticks(range(4), names, fontsize=8)
    left.set_ylabel("MiB")
    left.set_title(f"{model_name}: {first['batch']} caches x {first['context']} positions, fp32",
                   fontsize=10)
    written = np.array(curve["positions_written"])
    growth = np.array(curve["resident_growth"]) / 2 ** 20
    right.plot(written, written * curve["bytes_per_token"] / 2 ** 20, color="#999", lw=1,
               ls="--", label=f"formula: {curve['bytes_per_token']:,} B x positions written")
    right.plot(written, growth, "o-", color="#e45756", ms=4, label="resident growth (measured)")
    right.axhline(curve["nbytes"] / 2 ** 20, color="#9ecae9", lw=1)
    right.text(0, curve["nbytes"] / 2 ** 20 * 0.95, "allocated (nbytes) from the start",
               fontsize=7, color="#4c78a8", va="top")
    right.set_xlabel("positions written (cache.append)")
    right.set_ylabel("MiB")
    right.set_title(f"one cache of {curve['capacity']:,} positions, filled in steps",
                    fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    model = kvlab.load()
    reports = [memory_report(model, BATCHES[0])]   # first, before anything frees a large block
    curve = fill_curve(model)
    reports += [memory_report(model, BATCHES[1])]
    rows = presets()
    smol = smollm2_bytes(quick)
    result = {"setup": {**machine(), "default_threads": default_threads, "threads": THREADS,
                        "quick": quick,
                        "note": "a shared 2-core machine; nothing here is timed",
                        "model": "shakespeare-1m (kvlab.load()); SmolLM2-135M-Instruct "
                                 "(kvlab.load('smollm2-135m'))",
                        "memory": "resident sizes from /proc/self/status (VmRSS), glibc malloc"},
              "course": {"bytes_per_token": 524288, "gib_per_request_4096": 2,
                         "gib_16_requests": 32, "weights_gb_fp16": 14},
              "facts": FACTS,
              "worked_example": worked_example(), "presets": rows,
              "bundled": measured(model), "measure_memory": reports, "fill_curve": curve,
              "smollm2": smol, "design_questions": design_questions()}
    plot_growth(rows, out / "ch02_cache_growth.png", smol)
    plot_measured(reports, curve, model.config.name, out / "ch02_formula_vs_measured.png")
    result["setup"]["script_seconds"] = round(time.perf_counter() - started, 1)
    (out / "ch02.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in reports:
        print(r["table"])
    print(f"wrote {out}/ch02_*.png and ch02.json in {result['setup']['script_seconds']} s")


if __name__ == "__main__":
    main()
