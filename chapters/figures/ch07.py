"""Figures and numbers for chapter 7, "Kernels for decode attention".

    python chapters/figures/ch07.py [--out DIR] [--rounds 11] [--quick]

Measures, on this machine: the memory read bandwidth (kvlab's own probe, csrc/bandwidth.c,
before every round and at the end), a NumPy float32 matrix product as the CPU's
practical compute roof, decode attention alone (cache.attend) on one Llama 3 8B-shaped
layer (32 query heads, 8 KV heads of head_dim 128) at 1K to 16K positions in fp32, fp16
and int8, all threads against one at 16K, and a paged decode step against a contiguous
one (benchmarks/bench_paged.py's model). Every timing is taken in rounds, the compared
variants in turn (each first in turn; bench_paged.py keeps its own order), and reported as
the median over the rounds with their spread (chapters/figures/common.spread); a speed-up
is the median of each round's ratio. The two roofs keep their best measurement instead (a roof is the most the machine
delivers; a slower pass only saw other work), with the spread beside it. Checks a NumPy
flash-decoding split/merge against cache.attend and kvlab.reference. Everything about the
H200 is arithmetic from published figures (a bandwidth model, FACTS), not a measurement.
Writes ch07_roofline.png, ch07_cpu_attention.png, ch07_h200_estimate.png and ch07.json
(every number the chapter quotes, with the setup; "facts": those it quotes from elsewhere,
with their sources). Runs in about 15 s on the 2-core development machine.
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
from common import gpu_facts, machine, spread  # noqa: E402  (chapters/figures/common.py)
# one layer of Llama 3 8B (32 query heads, 8 KV heads of 128), filled as the benchmark
# does (common.py puts benchmarks/ on the path)
import bench_paged  # noqa: E402
from bench_cpu import HEAD_DIM, N_HEADS, N_KV_HEADS, filled_cache  # noqa: E402
from kvlab import measure, reference  # noqa: E402

# numbers the chapter quotes from elsewhere, with where they come from (written to the JSON
# as "facts")
FACTS = {
    **gpu_facts("h200_hbm_bytes_per_s", "h200_bf16_dense_flops", "h200_fp32_flops", "h200_sms"),
    "hopper_shared_memory_kb": {
        "value": {"per_sm": 228, "per_thread_block": 227},
        "source": "NVIDIA Hopper Tuning Guide (references.md, ref-hopper): up to 228 KB of "
                  "shared memory per SM, at most 227 KB for one thread block"},
    "readme_paged_over_contiguous": {
        "value": [0.91, 1.0],
        "source": "README.md, benchmarks/bench_paged.py's run (block size 16, 128 to 32K "
                  "positions, best of 15 rounds each) as committed at 71244c7"},
    "readme_paged_over_contiguous_earlier": {
        "value": [0.78, 1.07],
        "source": "README.md, an earlier run of benchmarks/bench_paged.py (block size 16, "
                  "128 to 32K positions, best of 15 rounds each), committed at 579c205 and "
                  "replaced at 71244c7"},
}
H200 = {"hbm_bytes_per_s": FACTS["h200_hbm_bytes_per_s"]["value"],
        "bf16_dense_flops": FACTS["h200_bf16_dense_flops"]["value"],
        "fp32_flops": FACTS["h200_fp32_flops"]["value"], "sms": FACTS["h200_sms"]["value"]}
CONTEXTS_CPU = [1024, 2048, 4096, 8192, 16384]
CONTEXTS_PAGED = [128, 512, 2048, 8192, 32768]   # bench_paged.py's
PAGED_BLOCK = 16
CONTEXTS_GPU = [4096, 8192, 16384, 32768]
FORMATS = ["fp32", "fp16", "int8"]


def split_attention(q, keys, values, n_splits):
    """Flash-decoding in NumPy: each chunk of positions gives (unnormalized output, max,
    sum); the chunks are merged exactly afterwards. q (n_heads, head_dim), keys/values
    (positions, n_kv_heads, head_dim)."""
    n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    qg = q.reshape(n_kv, n_heads // n_kv, head_dim)
    scale = np.float32(1.0 / np.sqrt(head_dim))
    bounds = np.linspace(0, len(keys), n_splits + 1).astype(int)
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        s = np.einsum("kgd,pkd->kgp", qg, keys[a:b]) * scale
        m = s.max(axis=-1)
        p = np.exp(s - m[..., None])
        parts.append((np.einsum("kgp,pkd->kgd", p, values[a:b]), m, p.sum(axis=-1)))
    m_all = np.max([m for _, m, _ in parts], axis=0)
    num = sum(o * np.exp(m - m_all)[..., None] for o, m, _ in parts)
    den = sum(l * np.exp(m - m_all) for _, m, l in parts)
    return (num / den[..., None]).reshape(n_heads, head_dim)


def measure_bandwidth():
    bw = kvlab.measure.memory_bandwidth(1 << 28, 4)
    return {k: float(v) for k, v in bw.items()}


def matmul_flops_runs(runs: int) -> list:
    """FLOP/s of each of `runs` NumPy float32 1024 x 1024 matrix products (OpenBLAS, every
    core), as benchmarks/bench_cpu.py's numpy_matmul_flops measures them."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a
    flops = []
    for _ in range(runs):
        start = time.perf_counter()
        a @ a
        flops.append(2 * 1024 ** 3 / (time.perf_counter() - start))
    return flops


def copies_of(context, dtype, rows):
    """Enough copies of a filled cache (64 MiB at least, twice the L3 cache) that cycling
    through them, every call reads its K and V from memory (benchmarks/bench_cpu.py's
    time_attend)."""
    first = filled_cache(context, dtype, rows)
    return [first] + [filled_cache(context, dtype, rows)
                      for _ in range(-(-(64 << 20) // first.nbytes) - 1)]


def attend_seconds(copies, q) -> float:
    """One round: the median time of cache.attend over each copy in turn (4 calls at least)."""
    seconds = []
    for i in range(max(4, len(copies))):
        cache = copies[i % len(copies)]
        start = time.perf_counter()
        cache.attend(q)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def paged_rounds(rounds: int, contexts=CONTEXTS_PAGED) -> list:
    """bench_paged.py's decode step (one layer, 8 query heads, 2 KV heads of 64) over a
    contiguous cache and a paged one, in turn: per context, the median of each round's
    paged time over its contiguous time, and the spread."""
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        r = bench_paged.bench_decode(context, rounds, 8, rng)
        contiguous, paged = r["round_seconds"]["contiguous"], r["round_seconds"][f"paged_{PAGED_BLOCK}"]
        ratio = spread([p / c for p, c in zip(paged, contiguous)])
        rows.append({"context": context, "block_size": PAGED_BLOCK,
                     "contiguous_us": 1e6 * float(np.median(contiguous)),
                     "paged_us": 1e6 * float(np.median(paged)),
                     "paged_over_contiguous": ratio["median"], "paged_over_contiguous_spread": ratio})
    return rows


def h200_estimate(cfg) -> tuple:
    """The H200 by arithmetic (bytes / bandwidth, FLOPs / peak), nothing measured: the
    estimate's numbers, the intensities of decode attention and of the weights, and the
    occupancy model of flash-decoding at 32K positions: (h200, intensity, occupancy)."""
    bw_gpu, flops_gpu, sms = H200["hbm_bytes_per_s"], H200["bf16_dense_flops"], H200["sms"]
    weights = measure.weights_bytes(cfg, "fp16")
    # what a decode step reads of the weights: every matrix, but of the (untied) input
    # embedding table only one row per token (measure.decode_step_bytes, as chapter 6.9)
    weights_read, _ = measure.decode_step_bytes(cfg, 0, weights="fp16")
    per_token = {d: kvlab.kv_bytes_per_token(cfg, d) for d in ("fp32", "fp16", "int8")}
    attn_flops_per_pos = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    h200 = {"weights_fp16_bytes": weights,
            "embedding_table_fp16_bytes": weights - weights_read,
            "weights_read_per_step_bytes": weights_read,
            "weights_read_ms": 1e3 * weights_read / bw_gpu,
            "kv_bytes_per_token": per_token, "contexts": {}}
    for ctx in CONTEXTS_GPU:
        kv = kvlab.kv_cache_bytes(cfg, ctx, dtype="fp16")
        kv8 = kvlab.kv_cache_bytes(cfg, ctx, dtype="int8")
        h200["contexts"][ctx] = {
            "kv_fp16_bytes": kv, "kv_fp16_read_ms": 1e3 * kv / bw_gpu,
            "kv_int8_bytes": kv8, "kv_int8_read_ms": 1e3 * kv8 / bw_gpu,
            "attention_flops": attn_flops_per_pos * ctx,
            "attention_compute_ms": 1e3 * attn_flops_per_pos * ctx / flops_gpu,
            "batch16_kv_fp16_read_ms": 16e3 * kv / bw_gpu}
    h200["kv_32k_over_weights_read"] = h200["contexts"][32768]["kv_fp16_bytes"] / weights_read
    h200["batch16_kv_32k_over_weights_read"] = 16 * h200["contexts"][32768]["kv_fp16_bytes"] / weights_read
    kv_mul = cfg.n_heads // cfg.n_kv_heads
    intensity = {"attention_fp32": 4 * kv_mul * cfg.head_dim / (2 * cfg.head_dim * 4),
                 "attention_fp16": 4 * kv_mul * cfg.head_dim / (2 * cfg.head_dim * 2),
                 "attention_fp16_bytes_per_flop": (2 * cfg.head_dim * 2) / (4 * kv_mul * cfg.head_dim),
                 "attention_int8": 4 * kv_mul * cfg.head_dim / (per_token["int8"] / cfg.n_layers / cfg.n_kv_heads),
                 "attention_fp16_mha": 4 * cfg.head_dim / (2 * cfg.head_dim * 2),
                 "weights_fp16_per_batch_row": 1.0,     # 2 FLOPs per weight per row / 2 bytes
                 "h200_ridge": flops_gpu / bw_gpu,
                 "h200_fp32_ridge": H200["fp32_flops"] / bw_gpu}
    # decode attention with an fp16 cache at the H200's bandwidth: its FLOP/s, and the
    # share of the chip's dense bf16 arithmetic that is
    h200["attention_fp16_flops_per_s"] = intensity["attention_fp16"] * bw_gpu
    h200["attention_fp16_share_of_bf16_peak"] = intensity["attention_fp16"] * bw_gpu / flops_gpu
    # the reads take this many times longer than the arithmetic (the ridge over the intensity)
    h200["kv_read_over_compute_time"] = flops_gpu / bw_gpu / intensity["attention_fp16"]
    # occupancy model: one thread block per (sequence, KV head, split); the chip's bandwidth
    # is assumed to scale with the share of its 132 SMs that have a block (an assumption)
    kv32 = h200["contexts"][32768]["kv_fp16_bytes"]
    occupancy = {}
    for batch in (1, 4, 16):
        occupancy[batch] = {}
        for splits in (1, 2, 4, 8, 16, 32, 64):
            blocks = batch * cfg.n_kv_heads * splits
            share = min(1.0, blocks / sms)
            occupancy[batch][splits] = {"blocks": blocks, "sm_share": share,
                                        "ms": 1e3 * batch * kv32 / (bw_gpu * share)}
    return h200, intensity, occupancy


def plot_h200_estimate(h200: dict, occupancy: dict, path: Path) -> None:
    """The H200 estimate (pure arithmetic, h200_estimate): left, the read time of a decode
    step's cache against context; right, the occupancy model of flash-decoding."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.6, 3.4))
    ctxs = CONTEXTS_GPU
    a1.plot(ctxs, [h200["contexts"][c]["kv_fp16_read_ms"] for c in ctxs], "o-", label="K/V, fp16, batch 1")
    a1.plot(ctxs, [h200["contexts"][c]["kv_int8_read_ms"] for c in ctxs], "^-", label="K/V, int8, batch 1")
    a1.plot(ctxs, [h200["contexts"][c]["batch16_kv_fp16_read_ms"] for c in ctxs], "s-",
            label="K/V, fp16, batch 16")
    a1.axhline(h200["weights_read_ms"], color="k", ls="--", lw=1, label="weights read per step, fp16")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xticks(ctxs, [f"{c // 1024}K" for c in ctxs])
    a1.set_xlabel("context per sequence")
    a1.set_ylabel("ms per decode step at 4.8 TB/s")
    a1.set_title("Llama 3 8B on an H200: bytes / bandwidth", fontsize=9)
    a1.legend(fontsize=7)
    for batch, style in zip((1, 4, 16), ("o-", "s-", "^-")):
        sp = sorted(occupancy[batch])
        a2.plot(sp, [occupancy[batch][s]["ms"] for s in sp], style, label=f"batch {batch}")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xticks(sp, [str(s) for s in sp])
    a2.set_xlabel("splits per (sequence, KV head)")
    a2.set_ylabel("ms for the attention's reads")
    a2.set_title("32K context: more splits fill the 132 SMs", fontsize=9)
    a2.legend(fontsize=7)
    fig.suptitle("estimates from a bandwidth model, not measurements", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    parser.add_argument("--rounds", type=int, default=11, help="rounds of every timing")
    args = parser.parse_args()
    # --quick: 2 rounds, the smallest and largest contexts (the same code, shorter)
    rounds = 2 if args.quick else args.rounds
    contexts_cpu = CONTEXTS_CPU[::len(CONTEXTS_CPU) - 1] if args.quick else CONTEXTS_CPU
    contexts_paged = CONTEXTS_PAGED[:2] if args.quick else CONTEXTS_PAGED
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    threads = kvlab.get_num_threads()

    # ---- the CPU: bandwidth, compute, decode attention ------------------------------------
    # the roofs keep their best measurement: a roof is the most the machine delivers, and
    # on a shared machine a slower pass only saw other work (their spread is kept too)
    bandwidths = []
    matmul_runs = matmul_flops_runs(rounds)
    matmul_flops = max(matmul_runs)
    q = rng.standard_normal((N_HEADS, HEAD_DIM), dtype=np.float32)
    kv_rows = rng.standard_normal((max(contexts_cpu), 1, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
    # every context and format is timed in every round (contexts and formats each first in
    # turn), after a bandwidth measurement: a slow spell of the shared machine hits them alike
    copies = {(context, dtype): copies_of(context, dtype, kv_rows)
              for context in contexts_cpu for dtype in FORMATS}
    # one thread against all of them, 16K fp32 (128 MiB, four times the L3 cache), in the
    # same rounds: the round's all-thread time is its (16384, "fp32") one
    taken = {key: [] for key in copies}
    one_thread = []
    for r in range(rounds):
        bandwidths.append(measure_bandwidth())
        for context in contexts_cpu[r % len(contexts_cpu):] + contexts_cpu[:r % len(contexts_cpu)]:
            for dtype in FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]:
                taken[context, dtype].append(attend_seconds(copies[context, dtype], q))
            if context == 16384:
                kvlab.set_num_threads(1)
                one_thread.append(attend_seconds(copies[16384, "fp32"], q))
                kvlab.set_num_threads(threads)
    rows = []
    for context in contexts_cpu:
        for dtype in FORMATS:
            nbytes = copies[context, dtype][0].nbytes
            mine, fp32 = taken[context, dtype], taken[context, "fp32"]
            seconds = spread(mine)
            flops = 4 * context * N_HEADS * HEAD_DIM        # q.k and p.v: 2 FLOPs each
            speedup = spread([f / t for f, t in zip(fp32, mine)])
            rows.append({"context": context, "dtype": dtype, "seconds": seconds["median"],
                         "seconds_spread": seconds,
                         "bytes_read": nbytes, "bytes_per_s": nbytes / seconds["median"],
                         "bytes_per_s_spread": spread([nbytes / t for t in mine]),
                         "round_spread_percent": 100 * (seconds["max"] - seconds["min"]) / seconds["median"],
                         "speedup_vs_fp32": speedup["median"], "speedup_vs_fp32_spread": speedup,
                         "flops": flops, "flops_per_s": flops / seconds["median"],
                         "flops_per_byte": flops / nbytes})
    del copies
    bandwidths.append(measure_bandwidth())
    read_bw = max(b["read_bytes_per_s"] for b in bandwidths)
    for row in rows:
        row["fraction_of_read_bw"] = row["bytes_per_s"] / read_bw
    summary = {}
    for dtype in FORMATS:
        mine = [r for r in rows if r["dtype"] == dtype]
        summary[dtype] = {
            "gb_per_s_range": [min(r["bytes_per_s"] for r in mine) / 1e9,
                               max(r["bytes_per_s"] for r in mine) / 1e9],
            "fraction_of_read_bw_range": [min(r["fraction_of_read_bw"] for r in mine),
                                          max(r["fraction_of_read_bw"] for r in mine)],
            "speedup_vs_fp32_range": [min(r["speedup_vs_fp32"] for r in mine),
                                      max(r["speedup_vs_fp32"] for r in mine)],
            "speedup_vs_fp32_round_range": [min(r["speedup_vs_fp32_spread"]["min"] for r in mine),
                                            max(r["speedup_vs_fp32_spread"]["max"] for r in mine)],
            "speedup_vs_fp32_quartile_range": [min(r["speedup_vs_fp32_spread"]["q1"] for r in mine),
                                               max(r["speedup_vs_fp32_spread"]["q3"] for r in mine)],
            "round_spread_percent_range": [min(r["round_spread_percent"] for r in mine),
                                           max(r["round_spread_percent"] for r in mine)]}
    summary["round_spread_percent_range"] = [min(r["round_spread_percent"] for r in rows),
                                             max(r["round_spread_percent"] for r in rows)]
    summary["fp32_over_int8_bytes"] = (rows[0]["bytes_read"] /
                                       [r for r in rows if r["dtype"] == "int8"][0]["bytes_read"])

    all_threads = taken[16384, "fp32"]
    t_all, t_one = spread(all_threads), spread(one_thread)
    thread_speedup = spread([o / a for o, a in zip(one_thread, all_threads)])

    # ---- paged against contiguous: bench_paged.py's decode step ------------------------------
    paged = paged_rounds(rounds, contexts_paged)
    paged_summary = {"ratio_range": [min(r["paged_over_contiguous"] for r in paged),
                                     max(r["paged_over_contiguous"] for r in paged)],
                     "round_ratio_range": [min(r["paged_over_contiguous_spread"]["min"] for r in paged),
                                           max(r["paged_over_contiguous_spread"]["max"] for r in paged)],
                     "quartile_range": [min(r["paged_over_contiguous_spread"]["q1"] for r in paged),
                                        max(r["paged_over_contiguous_spread"]["q3"] for r in paged)]}

    # ---- flash-decoding split/merge against the C kernel and the reference ----------------
    context = 4096
    exact = filled_cache(context, "fp32", rng.standard_normal((context, 1, N_KV_HEADS, HEAD_DIM),
                                                              dtype=np.float32))
    keys, values = exact.keys[0].copy(), exact.values[0].copy()
    c_out = exact.attend(q)
    ref_out = reference.attention(q[None], keys, values, np.array([context - 1]))[0]
    split_check = {"context": context, "c_vs_reference": float(np.abs(c_out - ref_out).max()),
                   "splits": {}}
    for n in (1, 2, 4, 8, 16, 32, 64):
        o = split_attention(q, keys, values, n)
        split_check["splits"][n] = {"vs_c": float(np.abs(o - c_out).max()),
                                    "vs_reference": float(np.abs(o - ref_out).max())}
    split_check["max_abs_output"] = float(np.abs(ref_out).max())
    del exact, kv_rows

    # ---- the H200 by arithmetic: bytes / bandwidth ------------------------------------------
    cfg = kvlab.ModelConfig.llama3_8b()
    flops_gpu, bw_gpu = H200["bf16_dense_flops"], H200["hbm_bytes_per_s"]
    h200, intensity, occupancy = h200_estimate(cfg)
    intensity["cpu_ridge"] = matmul_flops / read_bw

    # ---- figures --------------------------------------------------------------------------
    by_fmt = {d: [r for r in rows if r["dtype"] == d] for d in FORMATS}

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for d, style in zip(FORMATS, ("o-", "s-", "^-")):
        median = np.array([r["bytes_per_s"] / 1e9 for r in by_fmt[d]])
        # the point is bytes over the median time, the quartiles are of each pass's own rate:
        # with few passes far apart (a loaded machine) the point can fall outside them, and
        # matplotlib refuses a negative bar, so such a bar is drawn as zero
        low = np.maximum(median - [r["bytes_per_s_spread"]["q1"] / 1e9 for r in by_fmt[d]], 0)
        high = np.maximum([r["bytes_per_s_spread"]["q3"] / 1e9 for r in by_fmt[d]] - median, 0)
        ax.errorbar([r["context"] for r in by_fmt[d]], median, yerr=[low, high], fmt=style,
                    capsize=2, lw=1, label=f"decode attention, {d} cache")
    ax.axhline(read_bw / 1e9, color="k", ls="--", lw=1, label="memory read bandwidth (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts_cpu, [f"{c // 1024}K" for c in contexts_cpu])
    ax.set_ylim(0, read_bw / 1e9 * 1.15)
    ax.set_xlabel("context (positions in the cache)")
    ax.set_ylabel("bytes of K and V read, GB/s")
    ax.set_title(f"cache.attend, one Llama 3 8B layer, {threads} threads: median of {rounds} "
                 "rounds, bars: their quartiles", fontsize=9)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 0.6), ncol=2)
    fig.tight_layout()
    fig.savefig(out / "ch07_cpu_attention.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = np.logspace(-1, 3.5, 200)
    ax.plot(x, np.minimum(flops_gpu, x * bw_gpu), "C0", label="H200 roof (published: 4.8 TB/s, 989 TFLOP/s bf16)")
    ax.plot(x, np.minimum(matmul_flops, x * read_bw), "C1",
            label=f"this CPU's roof (measured: {read_bw / 1e9:.1f} GB/s, {matmul_flops / 1e9:.0f} GFLOP/s)")
    ai16 = intensity["attention_fp16"]
    ax.plot([ai16], [ai16 * bw_gpu], "C0o", ms=8)
    ax.annotate("H200 decode attention,\nfp16 cache (estimate)", (ai16, ai16 * bw_gpu),
                (0.25, 1.2e14), fontsize=7, arrowprops=dict(arrowstyle="->", lw=0.6))
    for batch in (1, 16, 256):
        ai = batch * intensity["weights_fp16_per_batch_row"]
        ax.plot([ai], [min(flops_gpu, ai * bw_gpu)], "C0s", ms=6, mfc="white")
        ax.annotate(f"weights, batch {batch}", (ai, min(flops_gpu, ai * bw_gpu)),
                    (ai * 1.3, min(flops_gpu, ai * bw_gpu) * 0.35), fontsize=7)
    for d, marker in zip(FORMATS, "os^"):
        cpu16 = [r for r in by_fmt[d] if r["context"] == 16384][0]
        ax.plot([cpu16["flops_per_byte"]], [cpu16["flops_per_s"]], "C1" + marker, ms=7)
        ax.annotate(d, (cpu16["flops_per_byte"], cpu16["flops_per_s"]),
                    (cpu16["flops_per_byte"] * 1.15, cpu16["flops_per_s"] * 0.55), fontsize=7)
        if d == "fp32":
            ax.annotate("this CPU, decode attention\nat 16K (measured)",
                        (cpu16["flops_per_byte"], cpu16["flops_per_s"]), (0.12, 2.5e9),
                        fontsize=7, arrowprops=dict(arrowstyle="->", lw=0.6))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e9, 3e15)
    ax.set_xlabel("arithmetic intensity, FLOPs per byte read")
    ax.set_ylabel("FLOP/s")
    ax.set_title("roofline: decode attention sits far left of both ridges", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "ch07_roofline.png", dpi=100)
    plt.close(fig)

    plot_h200_estimate(h200, occupancy, out / "ch07_h200_estimate.png")

    result = {
        "setup": {**machine(), "kvlab_threads": threads,
                  "attention_shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS,
                                      "head_dim": HEAD_DIM, "layers": 1},
                  "load_average_before_after": [load_before, os.getloadavg()],
                  "rounds": rounds,
                  "timing": f"every timing in {rounds} rounds, the compared variants in turn "
                            "(each first in turn); times: the median over the rounds, with "
                            "their spread (min, max, quartiles); speed-ups and ratios: the "
                            "median of each round's ratio, with its spread; an attention "
                            "round: the median of one call per copy of the cache (4 at "
                            "least); the roofs (read bandwidth, matrix product): the best "
                            "measurement, as a roof is the most the machine delivers, with "
                            "the spread of all of them"},
        "cpu": {"bandwidth_runs": bandwidths, "read_bytes_per_s": read_bw,
                "read_bytes_per_s_spread": spread([b["read_bytes_per_s"] for b in bandwidths]),
                "numpy_matmul_flops_per_s": matmul_flops,
                "numpy_matmul_flops_spread": spread(matmul_runs),
                "attention": rows, "summary": summary,
                "threads_16k_fp32": {"all_threads_s": t_all["median"], "one_thread_s": t_one["median"],
                                     "all_threads_spread": t_all, "one_thread_spread": t_one,
                                     "speedup": thread_speedup["median"],
                                     "speedup_spread": thread_speedup},
                "paged_over_contiguous": paged, "paged_summary": paged_summary},
        "split_check": split_check,
        "facts": FACTS,
        "h200_published": H200,
        "h200_estimate": h200,
        "intensity_flops_per_byte": intensity,
        "occupancy_model_32k": occupancy,
        "seconds": time.perf_counter() - started,
    }
    (out / "ch07.json").write_text(json.dumps(result, indent=2))
    print(f"read bandwidth {read_bw / 1e9:.2f} GB/s, NumPy matmul {matmul_flops / 1e9:.1f} GFLOP/s")
    for r in rows:
        print(f"{r['context']:>6} {r['dtype']:>5} {1e3 * r['seconds']:7.2f} ms "
              f"{r['bytes_per_s'] / 1e9:6.2f} GB/s ({100 * r['fraction_of_read_bw']:.0f} %)")
    print(f"16K fp32: one thread {1e3 * t_one['median']:.2f} ms, {threads} threads "
          f"{1e3 * t_all['median']:.2f} ms, {thread_speedup['median']:.2f}x "
          f"({thread_speedup['min']:.2f}-{thread_speedup['max']:.2f})")
    for r in paged:
        print(f"paged/contiguous at {r['context']:>6}: {r['paged_over_contiguous']:.3f} "
              f"({r['paged_over_contiguous_spread']['min']:.3f}-"
              f"{r['paged_over_contiguous_spread']['max']:.3f})")
    print("split check", split_check)
    print(f"wrote {out} in {result['seconds']:.1f} s")


if __name__ == "__main__":
    main()
