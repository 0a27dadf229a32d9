"""Figures and numbers for chapter 6, "Quantizing the cache".

    python chapters/figures/ch06.py [--out DIR] [--threads N] [--sections 1,2,3,4,5,6] [--quick]

Writes ch06_errors.png, ch06_accuracy.png, ch06_attention.png, ch06_whose_bytes.png and
ch06.json (every number the chapter quotes, with the setup; "facts": those it quotes from
elsewhere, with their sources; "from_other_chapters": what it quotes of chapter 7, read
from its JSON beside this script; "quoted": whole numbers the prose prints). The real
model is SmolLM2-135M-Instruct (kvlab.load("smollm2-135m"), its Q4_1 file), the text the
opening of Tiny Shakespeare (common.english_text()). The sections can be run separately
(--sections): the ones not run keep their numbers from the ch06.json already in DIR, and
setup.section_runs says when each section ran; each section's figure is drawn only when
it runs. Sections:

1. Bytes per token of each format, scales and zero points included
   (kvlab.kv_bytes_per_token), for SmolLM2-135M, stories260K and two large shapes,
   checked against what a real cache allocates.
2. Round-trip error of real keys and values: SmolLM2's K/V for 512 tokens of English,
   quantized by kvlab.quant, against kvlab.quant's error bound; the C cache's codes
   compared with kvlab.quant's, bit for bit.
3. Accuracy of each cache format against the fp32 cache (kvlab.accuracy.evaluate):
   SmolLM2 with float32 activations on 2,048 tokens in windows of 512.
4. Decode attention alone (cache.attend) on one Llama 3 8B layer (32 query heads, 8 KV
   heads of head_dim 128) filled with random rows, every format timed round-robin in 25
   rounds, as benchmarks/bench_quant.py does at more contexts: the median of the rounds,
   with their spread (chapters/figures/common.py's spread), and each round's fp32 time
   over the format's, median and spread.
5. Weights or cache, whose bytes: for the presets, the bytes a decode step reads of each
   (kvlab.measure.decode_step_bytes), the context where the cache's overtake the weights'
   per batch and format, and what each quantization saves at a few (context, batch)
   points; measured on SmolLM2, each weight format (the file's Q4_1, Q8_0, fp16, fp32)
   with float32 or int8 activations and an fp32 or int8 cache, against the file's values
   in float32 (weights_accuracy); the near tie of "What is the capital of France?" under
   both activations; the down-projection's input per layer (massive activations).
6. Decode on the stories15M shape per weight format (benchmarks/bench_weights.py's model,
   15 interleaved rounds: medians and spreads).

The full run takes about 15 minutes on the shared 2-core machine (sections 3 and 5 run
SmolLM2 over 2,048 tokens many times); --quick about a minute.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
from common import english_text, machine, smollm2, spread  # noqa: E402  (common.py also puts benchmarks/ on the path)
import bench_quant  # noqa: E402
import bench_weights  # noqa: E402
from kvlab import accuracy, chat, measure, quant, reference  # noqa: E402
from kvlab.model import Model  # noqa: E402

HERE = Path(__file__).resolve().parent
FORMATS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
# the formats evaluate() compares (its default list, spelled out) and their labels
SPECS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4", {"dtype": "int4", "window": 32},
         {"key_format": "int8", "value_format": "int4"}]
LABELS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int4 +window 32", "int8 K, int4 V"]
ATTENTION_ROUNDS = 25
DECODE_ROUNDS = 15
# the chat question whose first answer token is a near tie (README, tests/test_chat.py)
NEAR_TIE_QUESTION = "What is the capital of France?"
# numbers the chapter quotes from elsewhere, with where they come from (written to the JSON
# as "facts")
FACTS = {
    "check_yourself_int8_group": {
        "value": [0.01, -0.02, 0.03, 12.7],
        "source": "made-up values for Check yourself, question 2: a group of small values "
                  "with one outlier"},
    "kivi": {
        "value": {"group_size_G": 32, "residual_length_R": 128, "bits": 2},
        "source": "Liu et al., KIVI, 2024 (arXiv:2402.02750): keys quantized per channel in "
                  "groups of G tokens, values per token; the most recent tokens (up to the "
                  "residual length R) stay in full precision until a group fills; G and R "
                  "as in the paper's experiments"},
    "vllm_fp8_cache": {
        "value": {"format": "fp8 e4m3", "scales": ["per tensor", "per attention head"]},
        "source": "vLLM documentation, Quantized KV Cache (docs.vllm.ai/en/latest/features/"
                  "quantization/quantized_kvcache/): kv_cache_dtype='fp8', one scale per "
                  "K and V tensor or per KV head, from calibration (llm-compressor) or "
                  "estimated on the fly; default scales 1.0"},
    "sglang_fp8_cache": {
        "value": {"formats": ["fp8_e5m2", "fp8_e4m3"]},
        "source": "SGLang documentation, Quantized KV Cache (docs.sglang.io/advanced_features/"
                  "quantized_kv_cache.html)"},
    "gqa_uptraining_compute": {
        "value": 0.05,
        "source": "Ainslie et al., GQA, 2023 (arXiv:2305.13245): multi-head checkpoints "
                  "converted to GQA by mean-pooling heads and uptrained with 5 % of the "
                  "original pre-training compute"},
}
# the sections' formats for SmolLM2 (head_dim 64): int8 and fp8 one scale per head row,
# int4 groups of 32
# the JSON keys each section writes (those of a section not run are kept from the last run)
SECTION_KEYS = {
    1: ["bytes_per_token", "allocation_matches_formula", "tokens_in_16_gib_llama3_8b"],
    2: ["round_trip", "c_codes_equal_kvlab_quant"],
    3: ["accuracy"],
    4: ["attention", "attention_summary"],
    5: ["whose_bytes", "weights_x_cache_accuracy", "near_tie", "massive_activations"],
    6: ["decode_by_weight_format_15m"],
}


# ---- 1. bytes per token ----------------------------------------------------------------------

def bytes_table(configs) -> dict:
    table = {}
    for config in configs:
        row = {fmt: kvlab.kv_bytes_per_token(config, fmt) for fmt in FORMATS}
        g = config.head_dim
        if g % 32 == 0:
            row["int8 g32"] = kvlab.kv_bytes_per_token(config, "int8", group=32)
            row[f"int4 g{g}"] = kvlab.kv_bytes_per_token(config, "int4", group=g)
        if g % 8 == 0:
            row["int4 g8"] = kvlab.kv_bytes_per_token(config, "int4", group=8)
        row["int8 K / int4 V"] = kvlab.kv_bytes_per_token(config, "int8", value_format="int4")
        table[config.name] = {"n_layers": config.n_layers, "n_kv_heads": config.n_kv_heads,
                              "head_dim": config.head_dim, "bytes_per_token": row,
                              "fraction_of_fp32": {f: b / row["fp32"] for f, b in row.items()}}
    return table


def check_allocation(model) -> bool:
    """The formula is what a cache allocates: nbytes of a 1,024-position cache / 1,024."""
    return all(model.new_cache(1024, fmt).nbytes == 1024 * kvlab.kv_bytes_per_token(model.config, fmt)
               for fmt in FORMATS)


# ---- 2. round-trip error on real K and V -----------------------------------------------------

def real_kv(model, tokens):
    cache = model.new_cache(len(tokens))
    model.prefill(tokens, cache)
    return cache.keys.copy(), cache.values.copy()      # (n_layers, length, n_kv_heads, head_dim)


def round_trip(keys, values) -> dict:
    rows = {}
    x = np.concatenate([keys.ravel(), values.ravel()]).reshape(-1, keys.shape[-1])
    group_max = np.abs(x).max(axis=-1, keepdims=True)
    for fmt in FORMATS[1:]:
        q = quant.quantize(x, fmt)
        back = quant.dequantize(q)
        error = back - x
        bound = quant.round_trip_error_bound(x, fmt)
        rows[fmt] = {
            "relative_rms_error": float(np.linalg.norm(error) / np.linalg.norm(x)),
            "max_abs_error": float(np.abs(error).max()),
            "within_bound": bool((np.abs(error) <= bound).all()),
            "max_error_over_bound": float((np.abs(error) / bound).max()),
            "bytes": int(q.nbytes), "values": int(x.size),
            "bytes_per_value": q.nbytes / x.size,
            # the error in units of the largest magnitude of its head row: the histogram
            "_scaled": np.abs(error / np.where(group_max > 0, group_max, 1)).ravel(),
        }
    return rows


def codes_match(model, keys, values) -> dict:
    """The C cache's stored codes and scales equal kvlab.quant's, bit for bit."""
    rows = {}
    k_rows = np.ascontiguousarray(keys.transpose(1, 0, 2, 3))      # (length, n_layers, ...)
    v_rows = np.ascontiguousarray(values.transpose(1, 0, 2, 3))
    for fmt in FORMATS[1:]:
        cache = model.new_cache(keys.shape[1], fmt)
        cache.append(k_rows, v_rows)
        q = quant.quantize(keys, fmt)
        codes = cache.key_codes.view(q.codes.dtype)
        same = np.array_equal(codes, q.codes)
        if q.scales is not None:
            same &= np.array_equal(cache.key_scales, q.scales)
        if q.zeros is not None:
            same &= np.array_equal(cache.key_zeros, q.zeros)
        stored_keys, _ = cache.dequantized()
        same &= np.array_equal(stored_keys, quant.dequantize(q))
        rows[fmt] = bool(same)
    return rows


# ---- 4. attention speed --------------------------------------------------------------------

def attention_times(contexts, repeats: int = ATTENTION_ROUNDS) -> list:
    """benchmarks/bench_quant.py's measurement (one Llama 3 8B layer, every format timed
    round-robin), in this chapter's units: the median of the rounds and their spread, the
    speed-up as the median of each round's fp32 time over the format's."""
    rows = []
    for r in bench_quant.attention_times(contexts, repeats):
        ms = spread([1e3 * s for s in r["round_seconds"]])
        speedup = spread(r["round_ratios_to_fp32"])
        rows.append({"context": r["context"], "format": r["format"],
                     "bytes_per_value": quant.bytes_per_value(r["format"], 128),
                     "ms": ms["median"], "ms_spread": ms,
                     "speedup_vs_fp32": speedup["median"], "speedup_spread": speedup,
                     "cache_bytes": r["bytes_read"], "gb_per_s": r["bytes_read"] / ms["median"] / 1e6,
                     "best_ms": 1e3 * r["seconds"]})
    return rows


def attention_summary(rows) -> dict:
    """Per format, the range of the median speed-ups over the contexts, and of the single
    rounds' speed-ups."""
    summary = {}
    for fmt in FORMATS[1:]:
        mine = [r for r in rows if r["format"] == fmt]
        medians = [r["speedup_vs_fp32"] for r in mine]
        summary[fmt] = {"speedup_median_range": [min(medians), max(medians)],
                        "speedup_round_range": [min(r["speedup_spread"]["min"] for r in mine),
                                                max(r["speedup_spread"]["max"] for r in mine)]}
    return summary


# ---- figures -------------------------------------------------------------------------------

def plot_errors(errors, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    bins = np.logspace(-9, 0, 91)
    for fmt in FORMATS[1:]:
        scaled = errors[fmt]["_scaled"]
        scaled = scaled[scaled > 0]
        ax.hist(scaled, bins=bins, histtype="step", lw=1.4,
                label=f"{fmt}: {errors[fmt]['bytes_per_value']:.3g} B/value")
    ax.set_xscale("log")
    ax.set_xlabel("|dequantized - exact| / largest |value| of its head row")
    ax.set_ylabel("values")
    ax.set_title("Round-trip error of SmolLM2's K and V (512 tokens of English)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_accuracy(reports, path: Path) -> None:
    """KL and top-1 disagreement per format (SPECS order), per model."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    y = np.arange(len(LABELS) - 1)
    height = 0.8 / len(reports)
    for j, report in enumerate(reports):
        formats = report["formats"][1:]                       # fp32 against itself: 0
        fp32 = report["formats"][0]["bytes_per_token"]
        offset = (j - (len(reports) - 1) / 2) * height
        name = report["model"].split(" (")[0]
        left.barh(y + offset, [max(f["kl"], 1e-9) for f in formats], height, label=name)
        right.barh(y + offset, [max(100 * (1 - f["top1"]), 1e-3) for f in formats], height,
                   label=name)
        for yi, f in zip(y, formats):
            right.annotate(f"{f['bytes_per_token'] / fp32:.2f}", (1.2e-3, yi + offset),
                           fontsize=6, va="center")
    left.set_yticks(y, LABELS[1:], fontsize=8)
    left.invert_yaxis()
    left.set_xscale("log")
    left.set_xlabel("mean KL(p_fp32 || p_format), nats (log)")
    left.set_title("How far the next-token distribution moves", fontsize=10)
    left.legend(fontsize=8)
    right.set_xscale("log")
    right.set_xlabel("positions whose top token changes, % (log; 0 drawn at 0.001)")
    right.set_title("Top-1 disagreement (numbers: bytes/token vs fp32)", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attention(rows, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    contexts = sorted({r["context"] for r in rows})
    width = 0.8 / len(contexts)
    for j, context in enumerate(contexts):
        mine = [r for r in rows if r["context"] == context]
        x = np.arange(len(mine)) + (j - (len(contexts) - 1) / 2) * width
        medians = np.array([r["speedup_vs_fp32"] for r in mine])
        low = medians - [r["speedup_spread"]["q1"] for r in mine]
        high = [r["speedup_spread"]["q3"] for r in mine] - medians
        ax.bar(x, medians, width, yerr=[low, high], capsize=2, error_kw={"lw": 0.8},
               label=f"{context:,} positions (fp32: {mine[0]['ms']:.1f} ms)")
    ax.set_xticks(np.arange(len(FORMATS)),
                  [f"{f}\n{quant.bytes_per_value(f, 128):.3g} B/value" for f in FORMATS], fontsize=8)
    ax.axhline(1, color="k", lw=0.6)
    ax.set_ylabel("speed against fp32 (x)")
    rounds = rows[0]["speedup_spread"]["runs"]
    ax.set_title(f"Decode attention alone, one Llama 3 8B layer (cache.attend): median of "
                 f"{rounds} rounds, bars: their quartiles", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- 5. weights or cache: whose bytes? ----------------------------------------------------

WHOSE_PRESETS = ["tinyllama-1.1b", "llama2-7b", "llama3-8b", "llama2-70b"]
WEIGHT_FORMATS = ["fp16", "q8_0"]
CACHE_FORMATS = ["fp16", "int8", "int4"]
BATCHES = [1, 8, 32]
POINTS = [(4096, 1), (4096, 16), (32768, 1), (32768, 16)]     # (context, batch)


def whose_bytes() -> dict:
    presets = kvlab.ModelConfig.presets()
    table = {}
    for name in WHOSE_PRESETS:
        c = presets[name]
        table[name] = {
            "weights_per_step": {w: measure.decode_step_bytes(c, 0, 1, w)[0] for w in WEIGHT_FORMATS},
            "kv_per_token": {f: kvlab.kv_bytes_per_token(c, f) for f in CACHE_FORMATS},
            "crossover": {f"{w} weights, {f} cache": {str(b): round(measure.crossover_context(c, b, w, f))
                                                      for b in BATCHES}
                          for w in WEIGHT_FORMATS for f in CACHE_FORMATS},
            "saved_at": [_savings(c, context, batch) for context, batch in POINTS],
        }
    return table


def _savings(config, context: int, batch: int) -> dict:
    """Share of an fp16/fp16 decode step's bytes that Q8_0 weights, an int8 cache, or both save."""
    def total(w, f):
        return sum(measure.decode_step_bytes(config, context, batch, w, f))
    base = total("fp16", "fp16")
    weight_part, cache_part = measure.decode_step_bytes(config, context, batch, "fp16", "fp16")
    return {"context": context, "batch": batch, "cache_share": cache_part / base,
            "q8_0_weights": 1 - total("q8_0", "fp16") / base,
            "int8_cache": 1 - total("fp16", "int8") / base,
            "both": 1 - total("q8_0", "int8") / base}


def decode_by_weight_format(rounds: int = DECODE_ROUNDS) -> list:
    """Greedy decode on the stories15M shape (random weights), each weight format in turn:
    medians over the rounds, with their spread."""
    models = bench_weights.build_models("15m")
    prompt = np.random.default_rng(1).integers(0, 32000, 16).astype(np.int32)
    bench_weights.check(models, prompt[:6])
    times, ratios = bench_weights.interleaved(
        bench_weights.VARIANTS, rounds, lambda v: bench_weights.decode_seconds(models[v], prompt, 16))
    rows = []
    for v in bench_weights.VARIANTS:
        seconds = float(np.median(times[v]))
        step_bytes = bench_weights.bytes_per_decode_step(models[v], prompt)
        speedup = spread(ratios[v])
        rows.append({"weights": v, "weights_nbytes": models[v].weights_nbytes,
                     "fp32_bytes_over_these": models["fp32"].weights_nbytes / models[v].weights_nbytes,
                     "decode_tokens_per_s": 1 / seconds,
                     "tokens_per_s_spread": spread([1 / t for t in times[v]]),
                     "speedup_vs_fp32": speedup["median"], "speedup_spread": speedup,
                     "read_gb_per_s": step_bytes / seconds / 1e9})
    return rows


def _log_panel(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")


def plot_whose_bytes(table, combos, path: Path) -> None:
    """Left: bytes a Llama 3 8B decode step reads against context, weights flat and cache
    growing, batch 1 and 16. Right: what each weight x cache combination costs the bundled
    model in KL against its bytes."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    c = kvlab.ModelConfig.llama3_8b()
    contexts = np.logspace(np.log10(512), np.log10(131072), 60)
    for batch, style in ((1, "-"), (16, "--")):
        for f, color in zip(CACHE_FORMATS, ("C0", "C1", "C2")):
            kv = [measure.decode_step_bytes(c, int(n), batch, "fp16", f)[1] / 1e9 for n in contexts]
            left.plot(contexts, kv, style, color=color, label=f"K/V {f}, batch {batch}")
    for w, color in zip(WEIGHT_FORMATS, ("k", "grey")):
        left.axhline(table["llama3-8b"]["weights_per_step"][w] / 1e9, color=color, lw=1.5,
                     label=f"weights {w}")
    left.set_xscale("log", base=2)
    _log_panel(left, "positions cached per sequence", "GB read per decode step",
               "Llama 3 8B: whose bytes does a decode step read?")
    names = list(dict.fromkeys(r["weights"] for r in combos["results"]))
    for r in combos["results"]:
        if r["weights"] == "fp32" and r["cache"] == "fp32":
            continue
        right.scatter(r["weight_bytes"] / 1e6, max(r["kl"], 1e-8),
                      marker={"fp32": "o", "int8": "s", "int4": "^"}.get(r["cache"], "x"),
                      color=f"C{names.index(r['weights'])}")
    for i, name in enumerate(names):
        right.scatter([], [], color=f"C{i}", label=f"weights {name}")
    for cache, marker in (("fp32", "o"), ("int8", "s")):
        right.scatter([], [], color="k", marker=marker, label=f"cache {cache}")
    _log_panel(right, "weight MB (SmolLM2-135M)", "mean KL, nats (log; 0 drawn at 1e-8)",
               "SmolLM2: KL against float32 weights, fp32 cache")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- 5b. SmolLM2's weights: formats and activations --------------------------------------

def weight_variants(model) -> dict:
    """SmolLM2 as the file stores it (Q4_1 matrices, a Q8_0 embedding) and converted, each
    with float32 or int8 activations. The reference, "fp32": the file's values in float32;
    the original training weights are not in the file, so every row measures what its
    format adds to the file's values."""
    exact = model.weights.float32()
    c, tok, src = model.config, model.tokenizer, model.source
    q8 = exact.converted("q8_0")
    return {
        "fp32": Model(c, exact, tok, src, activations="fp32"),
        "fp16": Model(c, exact.converted("fp16"), tok, src, activations="fp32"),
        "file (Q4_1) x fp32": Model(c, model.weights, tok, src, activations="fp32"),
        "file (Q4_1) x int8": Model(c, model.weights, tok, src, activations="int8"),
        "q8_0 x fp32": Model(c, q8, tok, src, activations="fp32"),
        "q8_0 x int8": Model(c, q8, tok, src, activations="int8"),
    }


def weights_accuracy(variants: dict, tokens, caches, context: int) -> dict:
    """Every weight variant with every cache format, teacher-forced on `tokens` in windows of
    `context`, against variants["fp32"] with an fp32 cache (kvlab.accuracy.evaluate_weights'
    measure, for variants it cannot build: the file's own mixed Q4_1/Q8_0 weights)."""
    exact_model = variants["fp32"]
    windows = [tokens[i:i + context] for i in range(0, len(tokens) - 1, context)]
    windows = [w for w in windows if len(w) >= 2]
    runs = [(name, cache) for name in variants for cache in caches]
    totals = {run: {"kl": 0.0, "agree": 0, "nll": 0.0} for run in runs}
    exact_nll, n = 0.0, 0
    for window in windows:
        targets = window[1:]
        rows = np.arange(len(targets))
        exact = accuracy.log_softmax(exact_model.prefill(
            window, exact_model.new_cache(len(window)), all_logits=True))[:-1]
        p = np.exp(exact)
        exact_nll -= exact[rows, targets].sum()
        n += len(targets)
        for name, cache in runs:
            m = variants[name]
            log_q = accuracy.log_softmax(m.prefill(window, m.new_cache(len(window), cache),
                                                   all_logits=True))[:-1]
            t = totals[(name, cache)]
            t["kl"] += float((p * (exact - log_q)).sum())
            t["agree"] += int((log_q.argmax(-1) == exact.argmax(-1)).sum())
            t["nll"] -= log_q[rows, targets].sum()
    exact_ppl = float(np.exp(exact_nll / n))
    results = []
    for name, cache in runs:
        t, m = totals[(name, cache)], variants[name]
        ppl = float(np.exp(t["nll"] / n))
        results.append({"weights": name, "cache": cache, "weight_bytes": m.weights_nbytes,
                        "cache_bytes_per_token": kvlab.kv_bytes_per_token(m.config, cache),
                        "kl": t["kl"] / n, "top1": t["agree"] / n, "perplexity": ppl,
                        "perplexity_change": 100 * (ppl / exact_ppl - 1)})
    return {"model": exact_model.config.name, "n_tokens": n + len(windows), "context": context,
            "exact_perplexity": exact_ppl, "results": results}


def near_tie(model) -> dict:
    """The first answer token to NEAR_TIE_QUESTION with float32 and with int8 activations:
    the two best tokens' logits, and the greedy answer's start."""
    messages = [{"role": "user", "content": NEAR_TIE_QUESTION}]
    rows = {}
    for act in ("fp32", "int8"):
        m = Model(model.config, model.weights, model.tokenizer, model.source, activations=act)
        _, ids = chat.prompt(m, messages)
        logits = m.prefill(ids, m.new_cache(len(ids)))
        best = [int(t) for t in np.argsort(logits)[::-1][:2]]
        answer = kvlab.generate(m, messages=messages, max_new_tokens=8)
        rows[act] = {"prompt_tokens": len(ids),
                     "top2": [{"token": m.decode_text([t]), "logit": float(logits[t])} for t in best],
                     "margin": float(logits[best[0]] - logits[best[1]]),
                     "answer_start": m.decode_text(answer.tokens)}
    return {"question": NEAR_TIE_QUESTION, **rows}


def massive_activations(model) -> dict:
    """The input of each layer's down-projection (w2: silu(h w1) * (h w3)) on the chat
    prompt of NEAR_TIE_QUESTION, computed with kvlab.reference's float32 pieces: the
    largest magnitude per layer on token 0 and on every other token, and what int8
    activations (Q8_0's blocks of 32, scale = max / 127) make of the block that holds
    the largest value."""
    c, w = model.config, model.weights.float32()
    _, ids = chat.prompt(model, [{"role": "user", "content": NEAR_TIE_QUESTION}])
    tokens = np.asarray(ids)
    n, positions, inv_freq = len(tokens), np.arange(len(tokens)), c.rope_inv_freq()
    x = w.token_embedding[tokens].astype(np.float32)
    first, rest, worst = [], [], None
    for layer in range(c.n_layers):      # kvlab.reference.forward, keeping the w2 inputs
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q = reference.rope((h @ w.wq[layer].T).reshape(n, c.n_heads, c.head_dim), positions,
                           inv_freq, c.rope_interleaved)
        k = reference.rope((h @ w.wk[layer].T).reshape(n, c.n_kv_heads, c.head_dim), positions,
                           inv_freq, c.rope_interleaved)
        v = (h @ w.wv[layer].T).reshape(n, c.n_kv_heads, c.head_dim)
        x = x + reference.attention(q, k, v, positions).reshape(n, -1) @ w.wo[layer].T
        h = reference.rmsnorm(x, w.ffn_norm[layer], c.norm_eps)
        w2_input = reference.silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)
        x = x + w2_input @ w.w2[layer].T
        first.append(float(np.abs(w2_input[0]).max()))
        rest.append(float(np.abs(w2_input[1:]).max()))
        if worst is None or first[-1] > worst[0]:
            worst = (first[-1], layer, w2_input[0].copy())
    logits = reference.rmsnorm(x, w.final_norm, c.norm_eps) @ w.classifier.T
    same = float(np.abs(logits[-1] - model.prefill(ids, model.new_cache(n))).max())
    peak, layer, row = worst
    channel = int(np.abs(row).argmax())
    block = row[channel // 32 * 32: channel // 32 * 32 + 32]
    q = quant.quantize(block, "int8")               # Q8_0's activation rounding, one block
    others = np.delete(np.abs(block), channel % 32)
    back = np.delete(quant.dequantize(q), channel % 32)
    big = [i for i, v in enumerate(first) if v > 10 * max(rest)]
    return {"prompt_tokens": n, "token_0": model.tokenizer.id_to_piece(int(tokens[0])),
            "w2_input_max_token_0": first, "w2_input_max_other_tokens": rest,
            "layers_token_0_over_10x_others": big, "largest": peak, "largest_layer": layer,
            "largest_channel": channel, "max_other_tokens_all_layers": max(rest),
            "block_others_max": float(others.max()), "block_others_median": float(np.median(others)),
            "int8_step": float(q.scales.ravel()[0]),
            "block_others_rounded_to_zero": int((back == 0).sum()),
            "reference_vs_kvlab_last_logits_max_difference": same}


def other_chapters() -> dict:
    """What the chapter quotes of chapter 7, from its JSON file beside this
    script (None where a file or number is missing: rerun that chapter's script)."""
    def read(name, *keys):
        try:
            value = json.loads((HERE / name).read_text())
            for key in keys:
                value = value[key]
            return value
        except (OSError, KeyError, ValueError):
            print(f"({name}: no {'.'.join(keys)})")
            return None
    return {
        "ch07_fp32_fraction_of_read_bw_range": {
            "value": read("ch07.json", "cpu", "summary", "fp32", "fraction_of_read_bw_range"),
            "source": "chapter 7's run, ch07.json cpu.summary.fp32.fraction_of_read_bw_range: "
                      "fp32 decode attention's bytes per second over the measured read "
                      "bandwidth, lowest and highest over 1K-16K positions"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this):"
                             " fewer tokens and rounds; its numbers are not the chapter's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sections", default="1,2,3,4,5,6",
                        help="the sections to run; the others keep their numbers from the "
                             "ch06.json in --out")
    args = parser.parse_args()
    sections = sorted({int(x) for x in args.sections.split(",")})
    if not sections or not set(sections) <= set(SECTION_KEYS):
        parser.error(f"--sections takes numbers from {sorted(SECTION_KEYS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads((out / "ch06.json").read_text()) if (out / "ch06.json").is_file() else {}
    skipped = [n for n in SECTION_KEYS if n not in sections]
    missing = [n for n in skipped if any(key not in previous for key in SECTION_KEYS[n])]
    if missing:
        parser.error(f"{out / 'ch06.json'} holds no earlier run of sections {missing}: run them")
    # --quick: the same code paths on a short text and few rounds
    n_tokens = 128 if args.quick else args.tokens
    context = 64 if args.quick else 512
    round_trip_tokens = 64 if args.quick else 512
    attention_rounds = 3 if args.quick else ATTENTION_ROUNDS
    attention_contexts = [1024] if args.quick else [4096, 16384]
    decode_rounds = 3 if args.quick else DECODE_ROUNDS
    kvlab.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    today = datetime.datetime.now().isoformat(timespec="minutes")
    result = {key: previous[key] for n in skipped for key in SECTION_KEYS[n]}
    section_runs = {n: previous.get("setup", {}).get("section_runs", {}).get(str(n), "an earlier run")
                    for n in skipped}
    seconds = {}

    # SmolLM2-135M-Instruct as the file stores it (Q4_1), run with float32 activations: the
    # cache formats are compared on the file's own values, exactly
    model = smollm2(activations="fp32")
    text, text_source = english_text()
    tokens = np.asarray(model.encode(text), dtype=np.int64)[:n_tokens]

    def ran(n, since):
        seconds[n] = round(time.perf_counter() - since, 1)
        section_runs[n] = f"{today}, {seconds[n]} s" + (" (--quick)" if args.quick else "")

    if 1 in sections:
        since = time.perf_counter()
        configs = [model.config, kvlab.ModelConfig.stories260k(), kvlab.ModelConfig.llama2_7b(),
                   kvlab.ModelConfig.llama3_8b()]
        result["bytes_per_token"] = bytes_table(configs)
        result["allocation_matches_formula"] = check_allocation(model)
        result["tokens_in_16_gib_llama3_8b"] = {
            fmt: (16 * 2**30) // kvlab.kv_bytes_per_token(kvlab.ModelConfig.llama3_8b(), fmt)
            for fmt in FORMATS}
        print("bytes per token:", json.dumps(result["bytes_per_token"], indent=1),
              "allocation matches:", result["allocation_matches_formula"])
        ran(1, since)

    if 2 in sections:
        since = time.perf_counter()
        keys, values = real_kv(model, tokens[:round_trip_tokens])
        errors = round_trip(keys, values)
        matches = codes_match(model, keys, values)
        for fmt, row in errors.items():
            print(f"{fmt:<5} rel RMS {row['relative_rms_error']:.2e}  max {row['max_abs_error']:.3g}"
                  f"  within bound {row['within_bound']}  C codes = kvlab.quant {matches[fmt]}")
        plot_errors(errors, out / "ch06_errors.png")
        for row in errors.values():
            del row["_scaled"]
        result["round_trip"], result["c_codes_equal_kvlab_quant"] = errors, matches
        ran(2, since)

    if 3 in sections:
        since = time.perf_counter()
        report = accuracy.evaluate(model, tokens, SPECS, context=context)
        report.model += f" ({text_source})"
        print(report.table())
        reports = [report.as_dict()]
        plot_accuracy(reports, out / "ch06_accuracy.png")
        result["accuracy"] = reports
        ran(3, since)

    if 4 in sections:
        since = time.perf_counter()
        times = attention_times(attention_contexts, attention_rounds)
        for r in times:
            print(f"{r['context']:>6} {r['format']:<5}{r['ms']:8.2f} ms "
                  f"({r['ms_spread']['min']:.2f}-{r['ms_spread']['max']:.2f}) "
                  f"{r['speedup_vs_fp32']:6.2f}x ({r['speedup_spread']['min']:.2f}-"
                  f"{r['speedup_spread']['max']:.2f}) {r['gb_per_s']:7.2f} GB/s")
        plot_attention(times, out / "ch06_attention.png")
        result["attention"], result["attention_summary"] = times, attention_summary(times)
        ran(4, since)

    if 5 in sections:
        since = time.perf_counter()
        whose = whose_bytes()
        for name, row in whose.items():
            print(name, "crossover (fp16 weights, fp16 cache):",
                  row["crossover"]["fp16 weights, fp16 cache"])
        combos = weights_accuracy(weight_variants(model), tokens, ("fp32", "int8"), context)
        combos["model"] += f" ({text_source})"
        for r in combos["results"]:
            print(f"{r['weights']:<20}{r['cache']:<6}{r['weight_bytes']:>12,} KL {r['kl']:.2e} "
                  f"top-1 {100 * r['top1']:.2f} % ppl {r['perplexity_change']:+.3f} %")
        result["near_tie"] = near_tie(model)
        result["massive_activations"] = massive_activations(model)
        print(json.dumps(result["near_tie"], indent=1, ensure_ascii=False))
        print({k: v for k, v in result["massive_activations"].items() if not isinstance(v, list)})
        plot_whose_bytes(whose, combos, out / "ch06_whose_bytes.png")
        result["whose_bytes"], result["weights_x_cache_accuracy"] = whose, combos
        ran(5, since)

    if 6 in sections:
        since = time.perf_counter()
        decode = decode_by_weight_format(decode_rounds)
        for r in decode:
            print(f"15M shape, {r['weights']:<12} {r['decode_tokens_per_s']:8.1f} tok/s "
                  f"{r['speedup_vs_fp32']:5.2f}x ({r['speedup_spread']['min']:.2f}-"
                  f"{r['speedup_spread']['max']:.2f}) {r['read_gb_per_s']:6.1f} GB/s")
        result["decode_by_weight_format_15m"] = decode
        ran(6, since)

    result = {
        "setup": {**machine(), "threads": kvlab.get_num_threads(), "machine": platform.machine(),
                  "shared_machine": "a shared 2-core machine: other jobs ran beside these "
                                    "timings, so only side-by-side ratios are quoted "
                                    "(chapters/appendix_measuring.md)",
                  "model": f"{model.config.name}, float32 activations (cache formats); "
                           "weight variants in weights_x_cache_accuracy",
                  "text": text_source, "accuracy_tokens": int(len(tokens)),
                  "accuracy_context": context, "round_trip_tokens": round_trip_tokens,
                  "quick": args.quick,
                  "attention": "one Llama 3 8B layer (32 heads, 8 KV heads, head_dim 128), "
                               f"random K/V rows, cache.attend, {attention_rounds} rounds, "
                               "the formats in turn (each first in turn): the median, and "
                               "the spread over the rounds; speed-ups: the median of each "
                               "round's fp32 time over the format's",
                  "decode": "stories15M shape, random weights, median of 16 decode steps "
                            f"after 16 tokens, {decode_rounds} interleaved rounds "
                            "(benchmarks/bench_weights.py): the median and the spread over "
                            "the rounds",
                  "section_runs": {str(n): section_runs[n] for n in sorted(section_runs)},
                  "load_average_before_after": [load_before, os.getloadavg()],
                  "seconds": round(time.perf_counter() - started, 1)},
        **{key: result[key] for n in SECTION_KEYS for key in SECTION_KEYS[n]},
        "facts": FACTS,
        "from_other_chapters": other_chapters(),
    }
    result["quoted"] = quoted(result)
    (out / "ch06.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {out} in {result['setup']['seconds']} s (sections {sections})")


def quoted(result) -> dict:
    """Whole numbers the chapter prints (the number test skips whole numbers), formatted as
    printed."""
    big = result["massive_activations"]
    tie = result["near_tie"]
    return {"largest_w2_input": f"{big['largest']:,.0f}",
            "largest_layer": f"layer {big['largest_layer']}",
            "other_tokens_max": f"{big['max_other_tokens_all_layers']:.0f}",
            "fp32_first_token": tie["fp32"]["top2"][0]["token"].strip(),
            "int8_answer": tie["int8"]["answer_start"].split(",")[0]}


if __name__ == "__main__":
    main()
