"""Figures and numbers for chapter 3, "Sharing keys and values: MHA, GQA, MQA".

    python chapters/figures/ch03.py [--out DIR] [--quick]

Writes ch03_cache_bytes.png, ch03_attention_time.png, ch03_conversion.png and ch03.json (every number the
chapter quotes, with the setup; "facts": those it quotes from elsewhere, with their
sources) into DIR (default: this script's folder). Runs in about
20 s on a 2-core machine.

1. Cache sizes of the preset shapes (exact arithmetic, kvlab.kv_cache_bytes), and of the
   Llama 2 7B shape with its 32 KV heads cut to 16, 8, 4, 2 and 1 (config.replace).
2. The head mapping: the C attention (cache.attend) against kvlab.reference.attention on
   random rows, and a cache whose KV head g holds the value g everywhere, so each query
   head's output says which KV head it read.
3. Decode attention alone (cache.attend: one token's queries over one layer's cache) for
   32 query heads of head_dim 128 over caches with 32, 8 and 1 KV heads (the MHA, GQA and
   MQA shapes of one layer of a 7B/8B model), filled with random rows. 25 rounds, the
   three shapes measured in turn within each round (so each pair meets the same load):
   the median round and the spread over the rounds (common.spread) of each time, read
   rate and per-round ratio; at 4,096 positions each round also measures what one core
   reads from memory (kvlab.measure.memory_bandwidth, one pass).
4. K/V bytes one decode step reads on the bundled model (GQA) and on the same shape with
   8 KV heads (MHA) or 1 (MQA), as the C core counts them.
5. An MHA model converted (the GQA lab's experiment): kvlab.MHA_MODEL, the bundled model's
   MHA twin, with each group's key and value heads mean-pooled to 4, 2 and 1 KV heads, on
   the Tiny Shakespeare validation split (from ../shared/data, or $KVLAB_SHARED), windows
   of 512 tokens: perplexity, and KL from the MHA model's predictions (kvlab.accuracy's);
   beside them the bundled model, trained with 2 KV heads from the start.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
from common import machine, spread  # noqa: E402  (chapters/figures/common.py)
from kvlab import accuracy, reference  # noqa: E402

GIB = 2 ** 30
HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("KVLAB_SHARED", HERE.parents[2] / "shared"))
DATA = SHARED / "data" / "tinyshakespeare.txt"
# numbers the chapter quotes from elsewhere, with where they come from (written to the JSON
# as "facts")
FACTS = {
    "course_weights_gb_fp16": {
        "value": 14,
        "source": "the course's worked example (7 billion parameters x 2 bytes); the "
                  "kit's Llama 2 7B shape has 13.5 GB (cache_sizes)"},
    "gqa_uptraining_share": {
        "value": 0.05,
        "source": "Ainslie et al. 2023, GQA, arXiv:2305.13245, abstract: converted "
                  "checkpoints are uptrained with 5% of the original pre-training compute"},
}


def cache_sizes() -> dict:
    C = kvlab.ModelConfig
    seq_len, batch = 4096, 16
    shapes = {
        "Llama 2 7B (MHA)": C.llama2_7b(),
        "Llama 3 8B (GQA)": C.llama3_8b(),
        "Llama 2 70B (GQA)": C.llama2_70b(),
        "Llama 2 70B as MHA": C.llama2_70b().replace(n_kv_heads=64, name="Llama 2 70B as MHA"),
        "Llama 2 7B as MQA": C.llama2_7b().replace(n_kv_heads=1, name="Llama 2 7B as MQA"),
    }
    rows = {}
    for label, c in shapes.items():
        rows[label] = {
            "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim, "kv_mul": c.kv_mul, "kind": c.attention_kind,
            "bytes_per_token_fp16": kvlab.kv_bytes_per_token(c, "fp16"),
            "bytes_4096_fp16": kvlab.kv_cache_bytes(c, seq_len, dtype="fp16"),
            "bytes_16x4096_fp16": kvlab.kv_cache_bytes(c, seq_len, batch=batch, dtype="fp16"),
            "weights_bytes_fp16": c.n_params() * 2,
        }
    base = C.llama2_7b()
    sweep = {}
    for n_kv in (32, 16, 8, 4, 2, 1):
        c = base.replace(n_kv_heads=n_kv)
        sweep[n_kv] = kvlab.kv_cache_bytes(c, seq_len, batch=batch, dtype="fp16")
    mha = sweep[32]
    return {"seq_len": seq_len, "batch": batch, "dtype": "fp16", "presets": rows,
            "llama2_7b_by_n_kv_heads": {str(k): v for k, v in sweep.items()},
            "llama2_7b_ratio_by_n_kv_heads": {str(k): mha / v for k, v in sweep.items()}}


def head_mapping(rng) -> dict:
    """C attention against the NumPy reference, and which KV head each query head reads."""
    n_heads, head_dim, length = 8, 16, 40
    out = {}
    for n_kv in (8, 2, 1):
        kv_mul = n_heads // n_kv
        cache = kvlab.KVCache(1, n_kv, head_dim, length)
        keys = rng.standard_normal((length, 1, n_kv, head_dim), dtype=np.float32)
        values = rng.standard_normal((length, 1, n_kv, head_dim), dtype=np.float32)
        cache.append(keys, values)
        q = rng.standard_normal((n_heads, head_dim), dtype=np.float32)
        c_out = cache.attend(q, layer=0)
        ref = reference.attention(q[None], cache.keys[0], cache.values[0],
                                  np.array([length - 1]))[0]
        # every value of KV head g is g: query head h's output is the number it read
        labelled = kvlab.KVCache(1, n_kv, head_dim, length)
        label_values = np.broadcast_to(np.arange(n_kv, dtype=np.float32)[None, None, :, None],
                                       (length, 1, n_kv, head_dim)).copy()
        labelled.append(keys, label_values)
        read = labelled.attend(q, layer=0)[:, 0]
        out[f"n_kv_heads={n_kv}"] = {
            "kv_mul": kv_mul,
            "max_abs_diff_vs_reference": float(np.abs(c_out - ref).max()),
            "kv_head_read_by_query_head": [round(float(x), 6) for x in read],
            "equals_h_floordiv_kv_mul": bool(np.allclose(read, np.arange(n_heads) // kv_mul,
                                                         atol=1e-5)),
        }
    return out


ROUNDS = 25
BANDWIDTH_CONTEXT = 4096      # the context whose rounds also measure one core's read rate


def attention_timing(rng, contexts, threads, repeats=ROUNDS) -> tuple:
    """Decode attention of the three shapes, `repeats` rounds of the three in turn, and at
    BANDWIDTH_CONTEXT one pass of memory_bandwidth after them in each round: (rows, the
    read rates in bytes/s)."""
    n_heads, head_dim = 32, 128
    kvlab.set_num_threads(threads)
    results, read_rates = [], []
    for context in contexts:
        caches = {}
        for n_kv in (32, 8, 1):
            cache = kvlab.KVCache(1, n_kv, head_dim, context)
            rows = rng.standard_normal((context, 1, n_kv, head_dim), dtype=np.float32)
            cache.append(rows, rows)
            caches[n_kv] = cache
        q = rng.standard_normal((n_heads, head_dim), dtype=np.float32)
        for cache in caches.values():
            cache.attend(q, 0)                      # warm up: pages, caches
        rounds = {n_kv: [] for n_kv in caches}
        for _ in range(repeats):
            for n_kv, cache in caches.items():
                start = time.perf_counter()
                cache.attend(q, 0)
                rounds[n_kv].append(time.perf_counter() - start)
            if context == BANDWIDTH_CONTEXT:
                read_rates.append(kvlab.measure.memory_bandwidth(1 << 28, 1)["read_bytes_per_s"])
        for n_kv, times in rounds.items():
            kv_bytes = 2 * context * n_kv * head_dim * 4
            flops = 4 * n_heads * context * head_dim
            # the MHA time over this shape's, round by round (both met the same load)
            ratios = np.array(rounds[32]) / np.array(times)
            row = {}
            if context == BANDWIDTH_CONTEXT:     # this shape's read rate over one core's, by round
                row["GBps_over_one_core_read"] = spread(
                    kv_bytes / np.array(times) / np.array(read_rates[-repeats:]))
            results.append({"threads": threads, "context": context, "n_heads": n_heads,
                            "n_kv_heads": n_kv, "head_dim": head_dim,
                            "seconds": spread(times), "best_seconds": min(times),
                            "kv_bytes_read": kv_bytes,
                            "GBps": spread(kv_bytes / np.array(times) / 1e9),
                            "flops": flops, "GFLOPs": spread(flops / np.array(times) / 1e9),
                            "mha_over_this": spread(ratios), **row})
        del caches
    return results, read_rates


def decode_kv_bytes() -> dict:
    """K/V bytes one decode step reads at position 255, counted by the C core."""
    model = kvlab.load()
    tokens = (np.arange(255) % 90 + 32).astype(np.int32)
    out = {}
    for n_kv in (8, 2, 1):
        if n_kv == model.config.n_kv_heads:
            m = model
        else:
            c = model.config.replace(n_kv_heads=n_kv, name=f"shakespeare-1m shape, {n_kv} KV heads")
            m = kvlab.Model(c, kvlab.Weights.random(c, seed=0))
        cache = m.new_cache(256)
        m.prefill(tokens, cache)
        with m.counting() as counts:
            m.decode(65, cache)
        out[str(n_kv)] = {"kind": m.config.attention_kind, "kv_read_bytes": counts.kv_read_bytes,
                          "weight_bytes": counts.weight_bytes,
                          "flops_attention": counts.flops_attention,
                          "cache_nbytes_256": cache.nbytes}
    return out


def plot_cache_bytes(sizes: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    labels = ["Llama 2 7B (MHA)", "Llama 3 8B (GQA)", "Llama 2 7B as MQA",
              "Llama 2 70B as MHA", "Llama 2 70B (GQA)"]
    presets = sizes["presets"]
    cache = [presets[k]["bytes_16x4096_fp16"] / GIB for k in labels]
    weights = [presets[k]["weights_bytes_fp16"] / GIB for k in labels]
    x = np.arange(len(labels))
    left.bar(x - 0.2, cache, 0.4, label="KV cache, 16 x 4,096 tokens", color="#4c78a8")
    left.bar(x + 0.2, weights, 0.4, label="weights", color="#bbbbbb")
    for xi, v in zip(x, cache):
        left.text(xi - 0.2, v * 1.15, f"{v:g}", ha="center", fontsize=8)
    left.set_yscale("log")
    left.set_xticks(x, [k.replace(" (", "\n(").replace(" as ", "\nas ") for k in labels],
                    fontsize=7)
    left.set_ylabel("GiB (fp16)")
    left.set_title("cache vs weights", fontsize=10)
    left.legend(fontsize=7, loc="upper left")
    sweep = sizes["llama2_7b_by_n_kv_heads"]
    n_kv = np.array([int(k) for k in sweep])
    gib = np.array(list(sweep.values())) / GIB
    right.plot(n_kv, gib, "o-", color="#4c78a8")
    for k, v in zip(n_kv, gib):
        right.annotate(f"{v:g} GiB", (k, v), textcoords="offset points", xytext=(4, -10),
                       fontsize=7)
    right.axhline(presets["Llama 2 7B (MHA)"]["weights_bytes_fp16"] / GIB, color="#999",
                  ls="--", lw=1)
    right.text(1, 13.5, "7B weights, fp16", fontsize=7, color="#666", va="top")
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xticks(n_kv, [str(k) for k in n_kv])
    right.set_xlabel("KV heads (32 query heads; 32 = MHA, 1 = MQA)")
    right.set_ylabel("GiB, 16 requests x 4,096 tokens")
    right.set_title("Llama 2 7B shape, KV heads varied", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attention(timing: list, path: Path, machine_line: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    names = {32: "MHA (32 KV heads)", 8: "GQA (8 KV heads)", 1: "MQA (1 KV head)"}
    colors = {32: "#e45756", 8: "#4c78a8", 1: "#54a24b"}
    one = [r for r in timing if r["threads"] == 1]
    for n_kv in (32, 8, 1):
        rows = [r for r in one if r["n_kv_heads"] == n_kv]
        ctx = [r["context"] for r in rows]
        for ax, get, scale in ((left, "seconds", 1e3), (right, "GBps", 1)):
            med = np.array([scale * r[get]["median"] for r in rows])
            low = np.array([scale * r[get]["min"] for r in rows])
            high = np.array([scale * r[get]["max"] for r in rows])
            ax.errorbar(ctx, med, yerr=[med - low, high - med], fmt="o-", capsize=3,
                        color=colors[n_kv], label=names[n_kv])
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (cached positions)")
    left.set_yscale("log")
    left.set_ylabel("ms per decode attention call")
    left.set_title("time: one layer, 32 query heads x 128, 1 thread", fontsize=9)
    left.legend(fontsize=8)
    right.set_ylabel("GB/s of K and V read")
    right.set_title("the same calls as K/V read rate", fontsize=9)
    fig.text(0.5, 0.005, machine_line, ha="center", fontsize=7, color="#666")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mean_pooled(model, n_kv_heads: int):
    """The model with each group of n_heads // n_kv_heads consecutive key (and value) heads
    replaced by their mean: the conversion of Ainslie et al. (2023), before uptraining."""
    c, w = model.config, model.weights

    def pool(stacked):          # (n_layers, n_kv_heads_before * head_dim, dim)
        n_layers, rows, dim = stacked.shape
        heads = stacked.reshape(n_layers, n_kv_heads, rows // c.head_dim // n_kv_heads, c.head_dim, dim)
        return heads.mean(axis=2, dtype=np.float64).reshape(n_layers, -1, dim).astype(np.float32)
    return kvlab.Model(c.replace(n_kv_heads=n_kv_heads, name=f"{c.name} pooled to {n_kv_heads}"),
                       dataclasses.replace(w, wk=pool(w.wk), wv=pool(w.wv)), model.tokenizer)


def all_logits(model, tokens, context: int = 512) -> list:
    """Each window's logits (prefill of up to `context` tokens from an empty cache)."""
    windows = [tokens[i:i + context] for i in range(0, len(tokens), context)]
    return [(w, model.prefill(w, model.new_cache(len(w)), all_logits=True)) for w in windows if len(w) >= 2]


def conversion(n_tokens: int = 8192) -> dict:
    """Perplexity and KL of the MHA model pooled to fewer KV heads, on held-out text."""
    mha = kvlab.load(kvlab.MHA_MODEL)
    trained_gqa = kvlab.load()
    tokens = accuracy.validation_tokens(mha, str(DATA), n_tokens)

    def perplexity(windows):     # over all windows together: exp of the mean NLL
        nll = [np.log(accuracy.perplexity(logits, w)) * (len(w) - 1) for w, logits in windows]
        return float(np.exp(sum(nll) / sum(len(w) - 1 for w, _ in windows)))

    original = all_logits(mha, tokens)
    rows = []
    for n_kv_heads in (8, 4, 2, 1):
        model = mha if n_kv_heads == 8 else mean_pooled(mha, n_kv_heads)
        windows = original if n_kv_heads == 8 else all_logits(model, tokens)
        kl = [accuracy.kl_divergence(a[:-1], b[:-1]) * (len(w) - 1)
              for (w, a), (_, b) in zip(original, windows)]
        rows.append({"model": "MHA pooled" if n_kv_heads < 8 else "MHA", "n_kv_heads": n_kv_heads,
                     "bytes_per_token_fp32": kvlab.kv_bytes_per_token(model.config, "fp32"),
                     "perplexity": perplexity(windows),
                     "kl_from_mha": float(sum(kl) / sum(len(w) - 1 for w, _ in original))})
    rows.append({"model": "trained GQA (bundled)", "n_kv_heads": trained_gqa.config.n_kv_heads,
                 "bytes_per_token_fp32": kvlab.kv_bytes_per_token(trained_gqa.config, "fp32"),
                 "perplexity": perplexity(all_logits(trained_gqa, tokens)), "kl_from_mha": None})
    return {"text": f"Tiny Shakespeare validation split, first {len(tokens)} tokens, windows of 512",
            "rows": rows}


def plot_conversion(result: dict, path: Path) -> None:
    rows = result["rows"]
    pooled = [r for r in rows if r["model"] != "trained GQA (bundled)"]
    trained = [r for r in rows if r["model"] == "trained GQA (bundled)"][0]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot([r["bytes_per_token_fp32"] for r in pooled], [r["perplexity"] for r in pooled],
            "o-", color="tab:red", label="MHA model, KV heads mean-pooled (no training after)")
    for r in pooled:
        ax.annotate(f"{r['n_kv_heads']} KV", (r["bytes_per_token_fp32"], r["perplexity"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.plot([trained["bytes_per_token_fp32"]], [trained["perplexity"]], "s", color="tab:blue",
            markersize=8, label="trained with 2 KV heads from the start (bundled model)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache bytes per token (fp32)")
    ax.set_ylabel("perplexity on held-out Shakespeare")
    ax.set_title("What sharing K/V heads costs a model trained without it")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    threads_before = kvlab.get_num_threads()

    sizes = cache_sizes()
    mapping = head_mapping(rng)
    # --quick: two contexts, 3 rounds, 1,024 held-out tokens (the same code, shorter)
    contexts = (512, BANDWIDTH_CONTEXT) if args.quick else (512, 1024, 2048, 4096, 8192)
    rounds = 3 if args.quick else ROUNDS
    timing, read_rates = attention_timing(rng, contexts, threads=1, repeats=rounds)
    # what one core can read from memory, the yardstick for the timings' GB/s, measured in
    # the rounds at BANDWIDTH_CONTEXT
    one_core_read = spread(np.array(read_rates) / 1e9)
    kvlab.set_num_threads(threads_before)
    decode = decode_kv_bytes()
    converted = conversion(1024 if args.quick else 8192)
    for r in converted["rows"]:
        kl = "" if r["kl_from_mha"] is None else f"  KL {r['kl_from_mha']:.4f}"
        print(f"{r['model']:<22} {r['n_kv_heads']} KV heads  {r['bytes_per_token_fp32']:>6} B/token  "
              f"perplexity {r['perplexity']:.3f}{kl}")

    setup = machine()
    setup.update({"timing": "cache.attend(q, layer=0): decode attention of one token over one "
                            f"layer, fp32 cache of random rows, 32 query heads of head_dim 128; "
                            f"{rounds} rounds, the three shapes in turn in each round; medians "
                            "and spreads over the rounds (common.spread), a ratio taken round "
                            "by round",
                  "rounds": rounds, "default_threads": threads_before})
    machine_line = (f"{setup['cpu']}, {setup['cpu_count']} cores (shared); median and range "
                    f"of {rounds} rounds; kvlab {setup['kvlab']}")
    plot_cache_bytes(sizes, out / "ch03_cache_bytes.png")
    plot_attention(timing, out / "ch03_attention_time.png", machine_line)
    plot_conversion(converted, out / "ch03_conversion.png")

    at = {f"{r['threads']}t_{r['context']}_{r['n_kv_heads']}": r for r in timing}
    summary = {}
    for threads in (1,):
        key = lambda n: f"{threads}t_4096_{n}"  # noqa: E731
        summary[f"context_4096_threads_{threads}"] = {
            "mha_ms": {k: 1e3 * v if k != "runs" else v for k, v in at[key(32)]["seconds"].items()},
            "gqa_ms": {k: 1e3 * v if k != "runs" else v for k, v in at[key(8)]["seconds"].items()},
            "mqa_ms": {k: 1e3 * v if k != "runs" else v for k, v in at[key(1)]["seconds"].items()},
            "mha_over_gqa": at[key(8)]["mha_over_this"],
            "mha_over_mqa": at[key(1)]["mha_over_this"],
            "mha_GBps": at[key(32)]["GBps"], "gqa_GBps": at[key(8)]["GBps"],
            "mqa_GBps": at[key(1)]["GBps"],
            "mqa_GFLOPs": at[key(1)]["GFLOPs"],
            "one_core_read_GBps": one_core_read,
            "mha_GBps_over_one_core_read": at[key(32)]["GBps_over_one_core_read"],
            "gqa_GBps_over_one_core_read": at[key(8)]["GBps_over_one_core_read"],
            # the median MQA speedup at the other contexts: [smallest, largest]
            "mha_over_mqa_other_contexts": [
                f(r["mha_over_this"]["median"] for r in timing if r["threads"] == threads
                  and r["n_kv_heads"] == 1 and r["context"] != 4096) for f in (min, max)],
        }
    # FLOPs per byte of K and V read (fp32), by shape: kv_mul / 2, whatever the context
    intensity = {name: at[f"1t_4096_{n}"]["flops"] / at[f"1t_4096_{n}"]["kv_bytes_read"]
                 for name, n in (("MHA", 32), ("GQA", 8), ("MQA", 1))}
    result = {"setup": setup, "cache_sizes": sizes, "head_mapping": mapping,
              "attention_timing": timing, "attention_summary": summary,
              "flops_per_kv_byte_fp32": intensity, "facts": FACTS,
              "decode_step_kv_bytes_at_position_255": decode, "mha_converted": converted,
              "script_seconds": time.perf_counter() - started}
    (out / "ch03.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}/ch03_*.png and ch03.json in {result['script_seconds']:.1f} s")


if __name__ == "__main__":
    main()
