"""Figures and numbers for chapter 8, "Keeping fewer positions".

    python chapters/figures/ch08.py [--out DIR]

Writes ch08_memory.png, ch08_accuracy.png, ch08_kept.png, ch08_past_context.png,
ch08_mla.png and ch08.json (every number the chapter quotes, with the setup; "quoted"
holds each number exactly as the chapter prints it, and tests/test_chapters.py checks
that the chapter does). Most measurements are benchmarks/bench_policies.py's own
functions, at smaller sizes:

1. Memory against generated length (measured first, before matplotlib is imported): the
   bundled model generating up to 16,384 tokens with SlidingWindow(64) and
   AttentionSinks(4, 60), and with a full cache sized for the sequence up to 4,096;
   cache.nbytes and the process's resident growth with the cache alive.
2. Where attention goes: the share of position 0 and of the first 4 positions in the
   attention of queries 128-255 (cache.track_attention), the reason for attention sinks,
   on the bundled model and on SmolLM2-135M-Instruct (trained, 8,192 positions).
3. Accuracy against the budget (kvlab.accuracy.evaluate_budgets) on SmolLM2: the first
   2,048 tokens of Tiny Shakespeare (common.english_text) as one window, its first 1,024
   the prompt and the next 1,024 scored, at budgets of 64, 256 and 1,024 rows.
4. Which positions survive: cache.positions after a 256-token prompt under
   HeavyHitters(64) and SnapKV(64), per layer and KV head, on SmolLM2 (drawn in
   ch08_kept.png; ch08.json keeps only their summary, summarize_kept: how many heads keep
   each position).
5. Positions as stored against StreamingLLM's re-rotation: (a) the bundled model past its
   trained context, perplexity by position over 2,048 held-out tokens, teacher-forced,
   for the full cache, window, sinks (as stored, and re-rotated by place in the cache, in
   NumPy) and H2O; (b) SmolLM2 inside its context, the same NumPy code on the scored
   half of section 3's text, window against sinks as stored and re-rotated.
6. Decode time per token: the full cache against each policy's 64 rows, round-robin,
   25 rounds: the median and spread (common.spread) of each step's time and of the
   per-round ratio of the full cache's step to the policy's (the best round kept too).
7. Multi-head latent attention (DeepSeek-V2): cache bytes per token for its published
   shapes against MHA, GQA and MQA of the same shape, and a NumPy check that attention
   over the latent cache, with W_UK absorbed into the query, equals attention over the
   up-projected keys and values. DeepSeek-V3's cache per token, from its published shape.

The full run takes several minutes on a 2-core machine (SmolLM2's policies decode a token
at a time); --quick runs the same code on shorter texts, fewer lengths and rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

import kvlab
import common  # noqa: E402,F401  (chapters/figures/common.py puts benchmarks/ on the path)
from common import machine, spread  # noqa: E402
import bench_policies as bench  # noqa: E402
from kvlab import accuracy  # noqa: E402
from kvlab.cache_policy import HeavyHitters, SnapKV  # noqa: E402

# matplotlib is imported only after the memory measurements (see chapter 2: freeing the
# large blocks it allocates changes how later caches are allocated)

HERE = Path(__file__).resolve().parent
THREADS = 1
BUDGET = bench.BUDGET
LENGTHS = (256, 1024, 4096, 16384)
FULL_MAX = 4096
SMOL_BUDGETS = (64, 256, 1024)   # SmolLM2: rows kept
SMOL_CONTEXT = 2048              # SmolLM2: one window, the first half the prompt
LONG_TOKENS = 2048
ROUNDS = 25                      # decode timing: rounds of the round-robin
EDGES = [0, 256, 512, 1024, 1536, 2048]
PROMPT_LEN = 256
CHECK_TOKENS = 192               # the NumPy reference against the kit's AttentionSinks
QUICK = dict(LENGTHS=(256, 1024), FULL_MAX=1024, SMOL_BUDGETS=(16, 64), SMOL_CONTEXT=192,
             LONG_TOKENS=640, ROUNDS=3, EDGES=[0, 256, 512, 640], PROMPT_LEN=96,
             CHECK_TOKENS=96)
COLORS = {"full": "#444444", "window": "#4c78a8", "sinks": "#f58518", "h2o": "#54a24b",
          "snapkv": "#b279a2", "sinks, re-rotated (StreamingLLM)": "#e45756"}

# DeepSeek-V2 (arXiv:2405.04434, section 3.1.2 and its config.json on Hugging Face):
# 60 layers, 128 heads of d_h = 128, KV compression d_c = 512 (kv_lora_rank), decoupled
# RoPE key d_h^R = 64 (qk_rope_head_dim), cached in bf16.
DEEPSEEK_V2 = {"n_layers": 60, "n_heads": 128, "head_dim": 128, "kv_lora_rank": 512,
               "rope_head_dim": 64, "hidden": 5120, "bytes_per_element": 2,
               "source": "DeepSeek-V2 technical report, arXiv:2405.04434, section 3.1.2 "
                         "(Table 1 for the per-token formulas); deepseek-ai/DeepSeek-V2 "
                         "config.json: num_hidden_layers 60, num_attention_heads 128, "
                         "qk_nope_head_dim 128, v_head_dim 128, kv_lora_rank 512, "
                         "qk_rope_head_dim 64"}
# DeepSeek-V3 (arXiv:2412.19437, section 4.2, "Model Hyper-Parameters"): 61 layers, 128
# heads of 128, KV compression d_c = 512, decoupled RoPE key d_h^R = 64; the same MLA as
# V2. The cache is counted in bf16 here, as for V2.
DEEPSEEK_V3 = {"n_layers": 61, "n_heads": 128, "head_dim": 128, "kv_lora_rank": 512,
               "rope_head_dim": 64, "hidden": 7168, "bytes_per_element": 2,
               "source": "DeepSeek-V3 technical report, arXiv:2412.19437, section 4.2: 61 "
                         "Transformer layers, hidden 7168, 128 heads of d_h = 128, d_c = 512, "
                         "d_h^R = 64; deepseek-ai/DeepSeek-V3 config.json: "
                         "num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64"}
# Other facts the chapter quotes, with their sources
FACTS = {
    "mistral_v01_window": {"value": 4096, "source": "Jiang et al. 2023, arXiv:2310.06825 "
                           "(Mistral 7B v0.1: sliding window 4,096)"},
    "mistral_v02": {"sliding_window": None, "context": 32768,
                    "source": "Mistral-7B-Instruct-v0.2 model card (Hugging Face): 'No "
                              "Sliding-Window Attention', 32k context"},
    "gemma2": {"local_window": 4096, "global_context": 8192, "pattern": "alternating",
               "source": "Gemma Team 2024, arXiv:2408.00118 (local 4,096 / global 8,192, "
                         "every other layer)"},
    "gemma3": {"local_window": 1024, "local_per_global": 5,
               "source": "Gemma Team 2025, arXiv:2503.19786 (5 local layers per global, "
                         "local span 1,024)"},
}


# ---- 2. where attention goes -------------------------------------------------------------

def attention_share(model, tokens, first: int = 4, windows: int = 4, context: int = 256) -> dict:
    """The share of attention that queries at positions context/2 .. context-1 give to the
    first `first` positions, mean over windows, layers and heads (and the largest of any
    layer and KV head), against the share an even spread would give them. Summaries only:
    the per-head shares are not written."""
    kv_mul = model.config.n_heads // model.config.n_kv_heads
    half = context // 2
    windows = max(1, min(windows, len(tokens) // context))
    shares, firsts = [], []
    for w in range(windows):
        window = tokens[w * context:(w + 1) * context]
        cache = model.new_cache(context)
        model.forward(window[:half], cache)
        cache.track_attention(True)
        model.forward(window[half:], cache)
        # weights summed over the `half` queries and the kv_mul query heads of a KV head
        shares.append(cache.attention_weights[:, :first, :].sum(axis=1) / (half * kv_mul))
        firsts.append(cache.attention_weights[:, 0, :] / (half * kv_mul))
    shares = np.mean(shares, axis=0)                     # (n_layers, n_kv_heads)
    position_0 = np.mean(firsts, axis=0)
    even = float(np.mean([first / (p + 1) for p in range(half, context)]))
    return {"model": model.config.name, "first": first, "queries": [half, context - 1],
            "mean_share": float(shares.mean()), "max_share": float(shares.max()),
            "position_0_share": float(position_0.mean()),
            "position_0_max": float(position_0.max()),
            "position_0_layers_over_half": int((position_0.mean(axis=1) > 0.5).sum()),
            "even_share": even}


# ---- 4. which positions survive -----------------------------------------------------------

def kept_positions(model, tokens) -> dict:
    """{policy: cache.positions (n_layers, rows, n_kv_heads)} after the prompt, for the
    figure; ch08.json gets summarize_kept of each."""
    prompt = tokens[:PROMPT_LEN]
    out = {}
    for name, policy in (("h2o", HeavyHitters(BUDGET)), ("snapkv", SnapKV(BUDGET))):
        cache = bench.policy_cache(model, policy, PROMPT_LEN + 1)
        policy.forward(model, prompt, cache)
        out[name] = np.array(cache.positions)
    return out


def summarize_kept(positions, prompt_len: int) -> dict:
    """What ch08.json keeps of one policy's kept positions (n_layers, rows, n_kv_heads):
    how many layer-and-KV-head pairs keep position 0, out of how many, and how many keep
    each position of the prompt (the column sums of ch08_kept.png)."""
    positions = np.asarray(positions)
    per_head = positions.transpose(0, 2, 1).reshape(-1, positions.shape[1])   # (heads, rows)
    return {"heads_keeping_position_0": int((per_head == 0).any(axis=1).sum()),
            "heads": int(per_head.shape[0]), "rows": int(per_head.shape[1]),
            "heads_keeping_each_position":
                np.bincount(per_head.ravel(), minlength=prompt_len).tolist()}


# ---- 5b. StreamingLLM's re-rotation inside a trained context ------------------------------

def rerotation_inside_context(model, ids, budget: int = BUDGET, sinks: int = 4,
                              check_tokens: int = CHECK_TOKENS) -> dict:
    """SmolLM2 (float32 weights, for the NumPy forward pass) on ids, teacher-forced: the
    perplexity of the scored half (the second half of ids, as in section 3) when every
    query sees all positions (full), the newest `budget` (window), or `sinks` first ones
    and the newest budget - sinks, with each key at its own position (as stored, the kit's
    choice) or the sinks re-rotated by their place in the cache (StreamingLLM). All four in
    bench_policies.sinks_reference; its as-stored sinks checked against the kit's
    AttentionSinks on the first check_tokens tokens."""
    from kvlab.cache_policy import AttentionSinks
    ids = np.asarray(ids)
    n = len(ids)
    policy = AttentionSinks(sinks, budget - sinks)
    kit = policy.forward(model, ids[:check_tokens], policy.new_cache(model), all_logits=True)
    ref = bench.sinks_reference(model, ids[:check_tokens], sinks, budget - sinks, rerotate=False)
    check = float(np.abs(kit - ref).max())
    del kit, ref
    runs = {"full": (0, n, False), "window": (0, budget, False),
            "sinks, as stored": (sinks, budget - sinks, False),
            "sinks, re-rotated (StreamingLLM)": (sinks, budget - sinks, True)}
    scored = np.arange(n // 2 - 1, n - 1)            # the logits that predict ids[n // 2:]
    perplexity, seconds = {}, {}
    for name, (k, window, rerotate) in runs.items():
        start = time.perf_counter()
        logits = bench.sinks_reference(model, ids, k, window, rerotate=rerotate)[scored]
        seconds[name] = time.perf_counter() - start
        logits = logits - logits.max(axis=1, keepdims=True)
        nll = np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(len(scored)), ids[scored + 1]]
        perplexity[name] = float(np.exp(nll.mean()))
        del logits
    return {"model": model.config.name, "tokens": n, "scored": [int(n // 2), n],
            "budget": budget, "sinks": sinks, "perplexity": perplexity, "seconds": seconds,
            "numpy_sinks_vs_kit_max_abs_logit_difference": check, "check_tokens": check_tokens,
            "weights": "float32, dequantized from the Q4_1 file"}


# ---- 7. multi-head latent attention --------------------------------------------------------

def mla_bytes(shape=DEEPSEEK_V2, gqa_heads: int = 8) -> dict:
    """Cache bytes per token (all layers) at one shape, for each way of caching K and V
    (the formulas of the DeepSeek-V2 report's Table 1, times bytes per element)."""
    l, n_h, d_h = shape["n_layers"], shape["n_heads"], shape["head_dim"]
    d_c, d_r, b = shape["kv_lora_rank"], shape["rope_head_dim"], shape["bytes_per_element"]
    elements = {"MHA": 2 * n_h * d_h * l, f"GQA ({gqa_heads} KV heads)": 2 * gqa_heads * d_h * l,
                "MQA": 2 * d_h * l, "MLA": (d_c + d_r) * l}
    per_token = {k: v * b for k, v in elements.items()}
    mha = per_token["MHA"]
    # decode attention, per cached position per layer: bytes read and FLOPs (all heads);
    # MHA reads K and V of every head; MLA (absorbed) reads the latent and the RoPE key once,
    # and each head does a (d_c + d_r)-long score and a d_c-long weighted sum
    return {"shape": shape, "elements_per_token": elements, "bytes_per_token": per_token,
            "fraction_of_mha": {k: v / mha for k, v in per_token.items()},
            "mha_over": {k: mha / v for k, v in per_token.items()},
            "gqa_groups_equivalent": (d_c + d_r) / (2 * d_h),
            "per_position_per_layer": {
                name: {"bytes": nbytes, "flops": flops, "flops_per_byte": flops / nbytes}
                for name, nbytes, flops in (("MHA", 2 * n_h * d_h * b, 2 * n_h * 2 * d_h),
                                            ("MLA (absorbed)", (d_c + d_r) * b,
                                             2 * n_h * (d_c + d_r + d_c)))},
            "gib_at_128k_tokens": {k: v * 131072 / 2 ** 30 for k, v in per_token.items()}}


def rope64(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """Rotate pairs (x[2i], x[2i+1]) of the last axis by position * theta^(-2i/d), float64."""
    d = x.shape[-1]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * theta ** (-np.arange(0, d, 2) / d)
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + angles.shape[1:])
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def mla_demo(n: int = 10, d_model: int = 32, n_h: int = 4, d_h: int = 8, d_c: int = 12,
             d_r: int = 4, seed: int = 0) -> dict:
    """MLA on a tiny random example, float64: the cache holds c_kv (n, d_c) and the shared
    RoPE key (n, d_r). The newest token's attention output computed (1) by up-projecting
    every cached c_kv into per-head K and V, as MHA would see them, and (2) from the latent
    cache directly, with W_UK absorbed into the query and W_UV into W_O."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d_model))                      # the layer's inputs
    w_dkv = rng.standard_normal((d_c, d_model)) / math.sqrt(d_model)
    w_uk = rng.standard_normal((n_h, d_h, d_c)) / math.sqrt(d_c)
    w_uv = rng.standard_normal((n_h, d_h, d_c)) / math.sqrt(d_c)
    w_kr = rng.standard_normal((d_r, d_model)) / math.sqrt(d_model)
    w_q = rng.standard_normal((n_h, d_h, d_model)) / math.sqrt(d_model)
    w_qr = rng.standard_normal((n_h, d_r, d_model)) / math.sqrt(d_model)
    w_o = rng.standard_normal((d_model, n_h, d_h)) / math.sqrt(n_h * d_h)
    positions = np.arange(n)
    c_kv = h @ w_dkv.T                                         # cached: (n, d_c)
    k_rope = rope64(h @ w_kr.T, positions)                     # cached: (n, d_r), one for all heads
    t = n - 1                                                  # the newest token's query
    q_c = w_q @ h[t]                                           # (n_h, d_h)
    q_r = rope64((w_qr @ h[t])[None], [t])[0]                  # (n_h, d_r)
    scale = 1 / math.sqrt(d_h + d_r)
    # (1) up-project every cached position: per-head keys and values, as MHA caches them
    k_c = np.einsum("hdc,nc->nhd", w_uk, c_kv)
    v = np.einsum("hdc,nc->nhd", w_uv, c_kv)
    p1 = softmax64((np.einsum("hd,nhd->hn", q_c, k_c) + q_r @ k_rope.T) * scale)
    y1 = np.einsum("mhd,hd->m", w_o, np.einsum("hn,nhd->hd", p1, v))
    # (2) absorbed: q_c^T (W_UK c) = (W_UK^T q_c)^T c, and W_O W_UV folded into one matrix
    q_latent = np.einsum("hdc,hd->hc", w_uk, q_c)              # (n_h, d_c)
    p2 = softmax64((q_latent @ c_kv.T + q_r @ k_rope.T) * scale)
    o_latent = p2 @ c_kv                                       # (n_h, d_c)
    w_ov = np.einsum("mhd,hdc->mhc", w_o, w_uv)                # (d_model, n_h, d_c)
    y2 = np.einsum("mhc,hc->m", w_ov, o_latent)
    return {"n": n, "d_model": d_model, "n_heads": n_h, "head_dim": d_h, "kv_lora_rank": d_c,
            "rope_head_dim": d_r, "cached_floats_per_token": {"MLA": d_c + d_r, "MHA": 2 * n_h * d_h},
            "max_abs_weight_difference": float(np.abs(p1 - p2).max()),
            "max_abs_output_difference": float(np.abs(y1 - y2).max()),
            "output_norm": float(np.linalg.norm(y1))}


# ---- figures ------------------------------------------------------------------------------

def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_memory(memory, config, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.8, 4.0))
    per_token = kvlab.kv_bytes_per_token(config, "fp32")
    prompt = next(r for r in memory if r["policy"] == "full")
    prompt = prompt["rows"] - prompt["generated"]
    xs = np.geomspace(64, max(LENGTHS), 100)
    ax.plot(xs, (xs + prompt) * per_token / 2 ** 20, color=COLORS["full"], ls=":", lw=1,
            label=f"full cache, formula ({per_token:,} B x positions)")
    for name, marker in (("full", "o"), ("window", "s"), ("sinks", "^")):
        rows = [r for r in memory if r["policy"] == name]
        label = {"full": "full cache sized for the sequence",
                 "window": f"SlidingWindow({BUDGET})",
                 "sinks": f"AttentionSinks(4, {BUDGET - 4})"}[name]
        ax.plot([r["generated"] for r in rows], [r["resident_growth"] / 2 ** 20 for r in rows],
                marker=marker, color=COLORS[name], ms=6, lw=1.5,
                label=f"{label}: resident growth (measured)")
    ax.axhline(BUDGET * per_token / 2 ** 20, color=COLORS["window"], lw=0.8, ls="--")
    ax.text(max(LENGTHS), BUDGET * per_token / 2 ** 20 * 0.8,
            f"a policy's cache.nbytes: {BUDGET * per_token:,} B", fontsize=7,
            color=COLORS["window"], ha="right", va="top")
    ax.axvline(config.max_seq_len, color="#999", lw=0.8)
    ax.text(config.max_seq_len * 1.06, 3, f"the model's trained\ncontext ({config.max_seq_len})",
            fontsize=7, color="#666")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(0.04, 60)
    ax.set_xticks(list(LENGTHS), [f"{n:,}" for n in LENGTHS])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("tokens generated (log scale)")
    ax.set_ylabel("MiB (log scale)")
    ax.set_title(f"{config.name}, fp32: the full cache grows with the sequence, a policy's does not\n"
                 f"(full cache generated up to {FULL_MAX:,} tokens; dotted: its formula beyond)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="major")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_accuracy(reports, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(reports), 2, figsize=(10, 3.3 * len(reports)), squeeze=False)
    for row, report in zip(axes, reports):
        name = report["model"].split(" (")[0]
        for policy in bench.POLICIES:
            rs = [r for r in report["results"] if r["policy"] == policy]
            style = dict(color=COLORS[policy], marker="o", ms=4, lw=1.5,
                         ls="--" if policy == "snapkv" else "-",
                         label=policy + (" (prompt only: reads more rows)" if policy == "snapkv" else ""))
            row[0].plot([r["budget"] for r in rs], [max(r["perplexity_change"], 0.01) for r in rs], **style)
            row[1].plot([r["budget"] for r in rs], [100 * r["top1"] for r in rs], **style)
        row[0].set_yscale("log")
        row[0].set_ylabel("perplexity change, % (log)")
        row[0].set_title(f"{name}: perplexity against the full cache "
                         f"({report['full_perplexity']:.3f})", fontsize=9)
        row[1].set_ylabel("top-1 agreement, %")
        row[1].set_title(f"{name}: same most likely token as the full cache", fontsize=9)
        for ax in row:
            ax.set_xscale("log", base=2)
            budgets = sorted({r["budget"] for r in report["results"]})
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.xaxis.set_minor_locator(plt.NullLocator())
            ax.set_xlabel(f"budget: rows kept (windows of {report['context']}, "
                          f"the first {report['context'] // 2} the prompt)")
            ax.grid(alpha=0.3, which="both")
        row[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_kept(kept_by_model, path: Path) -> None:
    plt = pyplot()
    n = len(kept_by_model)
    fig, axes = plt.subplots(n, 2, figsize=(11, 1.5 + 3.5 * n), squeeze=False)
    for row, (model_name, kept) in zip(axes, kept_by_model.items()):
        for ax, (policy, title) in zip(row, (("h2o", f"HeavyHitters({BUDGET})"),
                                             ("snapkv", f"SnapKV({BUDGET}, observation 16)"))):
            positions = kept[policy]                                  # (layers, rows, heads)
            n_layers, _, n_heads = positions.shape
            image = np.zeros((n_layers * n_heads, PROMPT_LEN))
            for layer in range(n_layers):
                for head in range(n_heads):
                    image[layer * n_heads + head, positions[layer, :, head]] = 1
            ax.imshow(image, aspect="auto", cmap="Greys", interpolation="nearest",
                      extent=(-0.5, PROMPT_LEN - 0.5, n_layers * n_heads - 0.5, -0.5))
            step = max(1, n_layers // 6)
            ax.set_yticks(range(0, n_layers * n_heads, n_heads * step),
                          [f"layer {layer}" for layer in range(0, n_layers, step)], fontsize=7)
            for layer in range(step, n_layers, step):
                ax.axhline(layer * n_heads - 0.5, color="#4c78a8", lw=0.4)
            ax.set_xlabel(f"position in the {PROMPT_LEN}-token prompt", fontsize=8)
            ax.set_title(f"{model_name}, {title}", fontsize=9)
    fig.suptitle(f"Which positions of a {PROMPT_LEN}-token prompt the cache keeps (black), "
                 f"one row per layer and KV head", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_past_context(long, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.8, 3.8))
    mids = [(a + b) / 2 for a, b in long["ranges"]]
    for name, values in long["perplexity"].items():
        label = {"full": "full cache", "window": f"SlidingWindow({BUDGET})",
                 "sinks": f"AttentionSinks(4, {BUDGET - 4}), positions as stored (kvlab)",
                 "h2o": f"HeavyHitters({BUDGET}), positions as stored",
                 "sinks, re-rotated (StreamingLLM)":
                     f"AttentionSinks(4, {BUDGET - 4}), re-rotated by place (StreamingLLM, NumPy)"}[name]
        rerotated = "re-rotated" in name
        ax.plot(mids, values, marker="x" if rerotated else "o", ms=7 if rerotated else 5,
                color=COLORS[name], label=label, ls="--" if rerotated else "-",
                lw=1.2 if rerotated else (3 if name == "window" else 1.5))
    ax.axvline(long["trained_context"], color="#999", lw=0.8)
    ax.text(long["trained_context"] + 20, 2.9, f"the model's trained context ({long['trained_context']})",
            fontsize=7, color="#666")
    ax.set_yscale("log")
    ticks = [t for t in (3, 4, 6, 10, 20, 40, 60, 100, 200)
             if t <= 1.1 * max(max(v) for v in long["perplexity"].values())]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_minor_locator(plt.NullLocator())
    edges = [a for a, _ in long["ranges"]] + [long["ranges"][-1][1] + 1]
    ax.set_xticks(edges, [str(e) for e in edges])
    ax.set_xlabel("position in the held-out text (each point: the perplexity of a range)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(f"{long['model']}, {long['tokens']:,} held-out tokens teacher-forced "
                 f"from position 0", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_mla(mla, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.8, 3.0))
    names = list(mla["bytes_per_token"])
    values = [mla["bytes_per_token"][k] for k in names]
    bars = ax.barh(range(len(names)), values, color=["#999", "#4c78a8", "#9ecae9", "#e45756"])
    for bar, v in zip(bars, values):
        ax.text(v * 1.08, bar.get_y() + bar.get_height() / 2,
                f"{v:,} B  ({v / values[0]:.1%} of MHA)", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(1e4, 4e7)
    s = mla["shape"]
    ax.set_xlabel("cache bytes per token, all layers, bf16 (log scale)")
    ax.set_title(f"DeepSeek-V2's shape: {s['n_layers']} layers, {s['n_heads']} heads of "
                 f"{s['head_dim']}; MLA caches d_c = {s['kv_lora_rank']} + d_R = "
                 f"{s['rope_head_dim']} values a layer", fontsize=9)
    ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def with_spreads(rows: list) -> list:
    """bench_policies.decode_times' rows (one context, the full cache first) with each
    step's time and the full cache's time over the policy's as spreads over the rounds
    (the ratio taken round by round: both steps met the same load); its best round kept."""
    full = np.array(next(r for r in rows if r["policy"] == "full")["seconds_by_round"])
    out = []
    for r in rows:
        r = dict(r)
        by_round = np.array(r.pop("seconds_by_round"))
        r.pop("median_seconds", None)
        r["best_seconds"] = r.pop("seconds")
        r["full_over_this_best"] = r.pop("full_over_this")
        r["seconds"] = spread(by_round)
        r["full_over_this"] = spread(full / by_round)
        out.append(r)
    return out


# ---- the numbers the chapter prints ---------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x:+.2f} %"


def quoted(result: dict) -> dict:
    """Each number as the chapter prints it (tests/test_chapters.py checks the text holds
    every one of these strings)."""
    setup = result["setup"]
    q = {"prompt_tokens": f"{setup['prompt_tokens']}-token prompt",
         "smollm2_tokens": f"first {setup['smollm2_tokens']:,} tokens of Tiny Shakespeare",
         "long_tokens": f"first {setup['long_tokens']:,} tokens",
         "decode_rounds": f"{setup['rounds']} rounds"}
    memory = {(r["policy"], r["generated"]): r for r in result["memory"]}
    for name in ("window", "sinks"):
        growth = [memory[(name, n)]["resident_growth"] // 1024 for n in LENGTHS]
        q[f"memory_{name}_kib"] = (f"{min(growth):,} to {max(growth):,} KiB" if min(growth) < max(growth)
                                   else f"{min(growth):,} KiB")
    q["policy_nbytes"] = f"{memory[('window', LENGTHS[0])]['cache_nbytes']:,} bytes"
    for n in LENGTHS:
        if ("full", n) in memory:
            r = memory[("full", n)]
            q[f"memory_full_{n}"] = f"{r['resident_growth']:,}"
            q[f"nbytes_full_{n}"] = f"{r['cache_nbytes']:,}"
    per_token = kvlab.kv_bytes_per_token(kvlab.load().config, "fp32")
    q["full_16384_formula"] = f"{(max(LENGTHS) + result['setup']['prompt_tokens']) * per_token:,}"
    for share in result["attention_share"]:
        key = share["model"]
        q[f"share_{key}_mean"] = f"{100 * share['mean_share']:.2f} %"
        q[f"share_{key}_position_0"] = f"{100 * share['position_0_share']:.1f} %"
        q[f"share_{key}_even"] = f"{100 * share['even_share']:.1f} %"
    for report in result["accuracy"]:
        key = report["model"].split(" (")[0]
        q[f"{key}_full_perplexity"] = f"{report['full_perplexity']:.2f}"
        for r in report["results"]:
            tag = f"{key}_{r['policy']}_{r['budget']}"
            q[tag] = f"{_pct(r['perplexity_change'])} ({100 * r['top1']:.1f} %)"
            if r["policy"] == "snapkv":
                q[f"{key}_snapkv_{r['budget']}_rows"] = f"{r['mean_rows']:,.1f}"
    for model_name, kept in result["kept"].items():
        for policy in ("h2o", "snapkv"):
            k = kept[policy]
            q[f"kept_{model_name}_{policy}_position_0"] = f"{k['heads_keeping_position_0']} of {k['heads']}"
    long = result["past_context"]
    for name, values in long["perplexity"].items():
        for (a, b), v in zip(long["ranges"], values):
            q[f"long_{name}_{a}"] = f"{v:.2f}"
    # an upper bound, as the chapter says "within": rounded up, never down
    worst = long['numpy_sinks_vs_kit_max_abs_logit_difference']
    exponent = math.floor(math.log10(worst)) if worst > 0 else -9
    q["long_check"] = f"{math.ceil(worst / 10 ** exponent)}e{exponent:03d}"
    for r in result["decode_times"]:
        tag = f"time_{r['model']}_{r['context']}_{r['policy']}"
        q[tag] = f"{1e6 * r['seconds']['median']:,.0f} µs"
        if r["policy"] != "full":
            ratio = r["full_over_this"]
            q[tag + "_ratio"] = f"{ratio['median']:.1f}x ({ratio['min']:.1f}-{ratio['max']:.1f})"
    inside = result["inside_context"]
    for name, v in inside["perplexity"].items():
        q[f"inside_{name}"] = f"{v:.2f}"
    worst = inside["numpy_sinks_vs_kit_max_abs_logit_difference"]
    exponent = math.floor(math.log10(worst)) if worst > 0 else -9
    q["inside_check"] = f"{math.ceil(worst / 10 ** exponent)}e{exponent:03d}"
    mla = result["mla"]
    for name, v in mla["bytes_per_token"].items():
        q[f"mla_{name}"] = f"{v:,}"
    q["mla_mha_over_mla"] = f"{mla['mha_over']['MLA']:.1f}"
    q["mla_groups"] = f"{mla['gqa_groups_equivalent']:.2f}"
    q["mla_fraction_gqa"] = f"{mla['bytes_per_token']['MLA'] / mla['bytes_per_token']['GQA (8 KV heads)']:.0%}"
    for k, v in mla["per_position_per_layer"].items():
        q[f"mla_pos_{k}_bytes"] = f"{v['bytes']:,} bytes"
        q[f"mla_pos_{k}_flops"] = f"{v['flops']:,} FLOPs"
        q[f"mla_pos_{k}_intensity"] = f"{v['flops_per_byte']:.0f} FLOP"
    for k, v in mla["fraction_of_mha"].items():
        if k != "MHA":
            q[f"mla_fraction_{k}"] = f"{100 * v:.2f} %"
    for k, v in mla["gib_at_128k_tokens"].items():
        q[f"mla_128k_{k}"] = f"{v:.1f} GiB"
    q["mla_demo"] = f"{result['mla_demo']['max_abs_output_difference']:.0e}"
    return q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        globals().update(QUICK)
    started = time.perf_counter()
    kvlab.set_num_threads(THREADS)
    model = kvlab.load()

    # 1. memory, first thing in the process
    memory = []
    for name in ("window", "sinks"):
        memory += bench.memory_growth(model, name, LENGTHS)
    memory += bench.memory_growth(model, "full", [n for n in LENGTHS if n <= FULL_MAX])
    for r in memory:
        print(f"{r['policy']:<7}{r['generated']:>7,} tokens: {r['rows']:>6,} rows, nbytes "
              f"{r['cache_nbytes']:>10,}, resident growth {r['resident_growth']:>10,}")

    tokens = accuracy.validation_tokens(model, str(bench.DATA), LONG_TOKENS)
    smol = common.smollm2()
    text, text_source = common.english_text()
    smol_tokens = np.asarray(smol.encode(text))

    # 2. where attention goes
    shares = [attention_share(model, tokens), attention_share(smol, smol_tokens)]
    for s in shares:
        print(f"{s['model']}: position 0 gets {100 * s['position_0_share']:.2f} %, the first "
              f"{s['first']} {100 * s['mean_share']:.2f} % of the attention (most: "
              f"{100 * s['max_share']:.1f} %; an even spread: {100 * s['even_share']:.1f} %)")

    # 3. accuracy against the budget, SmolLM2
    report = accuracy.evaluate_budgets(smol, smol_tokens[:SMOL_CONTEXT], SMOL_BUDGETS,
                                       context=SMOL_CONTEXT)
    report.model += f" ({text_source})"
    print(report.table())
    reports = [report.as_dict()]

    # 4. which positions survive
    kept = {smol.config.name: kept_positions(smol, smol_tokens)}

    # 5. past the trained context (the bundled model), and inside it (SmolLM2)
    long = bench.past_context(model, tokens[:LONG_TOKENS], EDGES)
    for name, values in long["perplexity"].items():
        print(f"{name:<34}" + "".join(f"{v:>9.3f}" for v in values))
    del smol
    smol32 = common.smollm2(weights="fp32")
    inside = rerotation_inside_context(smol32, smol_tokens[:SMOL_CONTEXT],
                                       check_tokens=CHECK_TOKENS)
    del smol32
    print(inside)

    # 6. decode time per token
    times = []
    for m, context in ((model, min(512, max(LENGTHS))), (model, max(LENGTHS)),
                       (bench.random_gqa(max(LENGTHS)), max(LENGTHS))):
        times += with_spreads(bench.decode_times(m, context, repeats=ROUNDS))
    for r in times:
        print(f"{r['model']:<20}{r['context']:>7,} {r['policy']:<7}"
              f"{1e6 * r['seconds']['median']:>8.0f} us {r['full_over_this']['median']:>6.2f}x "
              f"({r['full_over_this']['min']:.2f}-{r['full_over_this']['max']:.2f})")

    # 7. MLA
    mla = mla_bytes()
    mla_v3 = mla_bytes(DEEPSEEK_V3)
    demo = mla_demo()
    print(json.dumps(mla["bytes_per_token"]), json.dumps(mla_v3["bytes_per_token"]), demo)

    result = {
        "setup": {**machine(), "threads": THREADS, "budget": BUDGET, "prompt": bench.PROMPT,
                  "quick": args.quick,
                  "machine_note": "a 2-core machine shared with other jobs while it ran: "
                                  "times are medians over rounds taken side by side",
                  "prompt_tokens": len(model.encode(bench.PROMPT)),
                  "memory": "resident sizes from /proc/self/status (VmRSS), glibc malloc; "
                            "growth from before the cache was made to after the last token, "
                            "cache alive",
                  "smollm2_text": text_source, "smollm2_tokens": SMOL_CONTEXT,
                  "smollm2_budgets": list(SMOL_BUDGETS),
                  "long_tokens": LONG_TOKENS,
                  "decode_times": "random K/V rows by cache.append, one token per call, "
                                  f"round-robin, {ROUNDS} rounds: seconds and full_over_this "
                                  "(the full cache's step over the policy's, round by round) "
                                  "as median and spread over the rounds, best_seconds the "
                                  "fastest round",
                  "rounds": ROUNDS,
                  "seconds": None},
        "facts": FACTS,
        "memory": memory, "attention_share": shares, "accuracy": reports,
        "kept": {name: {policy: summarize_kept(positions, PROMPT_LEN)
                        for policy, positions in by_policy.items()}
                 for name, by_policy in kept.items()},
        "past_context": long, "inside_context": inside, "decode_times": times,
        "mla": mla, "mla_v3": mla_v3, "mla_demo": demo,
    }
    plot_memory(memory, model.config, out / "ch08_memory.png")
    plot_accuracy(reports, out / "ch08_accuracy.png")
    plot_kept(kept, out / "ch08_kept.png")
    plot_past_context(long, out / "ch08_past_context.png")
    plot_mla(mla, out / "ch08_mla.png")
    result["quoted"] = quoted(result)
    result["setup"]["seconds"] = round(time.perf_counter() - started, 1)
    (out / "ch08.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}/ch08_*.png and ch08.json in {result['setup']['seconds']} s")


if __name__ == "__main__":
    main()
