"""Figures and numbers for chapter 11, "Serving at scale".

    python chapters/figures/ch11.py [--out DIR] [--threads N] [--rounds R] [--sections 1,3,4,5]
                                    [--quick]

Writes ch11_goodput.png, ch11_tiers.png, ch11_sharing.png, ch11_tp.png and ch11.json (every
number the chapter quotes, with the setup; "facts": those it quotes from elsewhere, with
their sources; "quoted": numbers the prose prints whole). The model is SmolLM2-135M-Instruct
(kvlab.load("smollm2-135m")); --quick runs the same code on the bundled model with smaller
workloads (its numbers are not the chapter's). The sections not run keep their numbers from
the ch11.json already in DIR. Sections (the chapter's 11.1 and 11.2 share one):

1. SLOs, goodput and disaggregation: the same Poisson workloads at several request rates,
   served by one engine (kvlab.serving.serve on a kvlab.slo.VirtualClock) and by a prefill
   engine and a decode engine joined by a link (kvlab.cluster.Disaggregated); throughput,
   goodput under one SLO (kvlab.slo.goodput_report), p99 TTFT and TPOT; the greedy tokens of
   both, compared. Virtual time: the same numbers on every machine and under any load.
3. K/V tiers: for contexts of 128 to 1,024 tokens, the seconds to compute the K and V
   (a prefill), to swap them out to host memory and back, and to write them to a file and
   read them back (kvlab.cluster.measure_tiers, median of R rounds, wall clock); then the
   same comparison for Llama-3-8B on an H100 from data sheet numbers.
4. Prefix sharing: a multi-turn chat and a few-shot workload in SmolLM2's chat template;
   the tokens a radix tree reuses (kvlab.cluster.radix_hits) against the pool's block
   hashing at block sizes 8, 16 and 32 (kvlab.cluster.block_hash_hits, the model running).
5. Tensor parallelism: K/V bytes per token per GPU and tokens per 80 GB GPU for SmolLM2,
   Llama-3-8B and Llama-3-70B (kvlab.cluster.kv_bytes_per_gpu; arithmetic, no model).

The full run computes about 30,000 SmolLM2 tokens: section 1 took 9 minutes and sections 3
to 5 four on the shared 2-core machine under a load of 15 to 28 (far less on a quiet one;
setup.section_runs keeps each section's seconds); --quick takes well under a minute.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
from common import gpu_facts, machine, smollm2  # noqa: E402
from kvlab import chat, cluster, serving  # noqa: E402
from kvlab import slo as slo_module  # noqa: E402
from kvlab.serving import SAMPLE_TEXT  # noqa: E402

HERE = Path(__file__).resolve().parent
SECTION_KEYS = {1: ["serving"], 3: ["tiers", "tiers_gpu"], 4: ["sharing"], 5: ["tp"]}
BLOCK_SIZES = (8, 16, 32)
TP_SIZES = (1, 2, 3, 4, 8, 9, 16)
SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.05     # the chapter's SLO for SmolLM2 on the kit's clock
FACTS = {
    **gpu_facts("h100_bf16_dense_flops"),
    "link_bytes_per_s": {
        "value": 50e9,
        "source": "the link between the prefill and the decode GPU in the simulation: 50 GB/s, "
                  "about one 400 Gb/s InfiniBand NDR port (references.md, ref-ndr), the "
                  "order of the links DistServe and Splitwise assume between machines"},
    "h100_memory_bytes": {
        "value": 80e9,
        "source": "NVIDIA H100 data sheet (references.md, ref-h100), H100 SXM: 80 GB of GPU "
                  "memory"},
    "pcie5_x16_bytes_per_s": {
        "value": 64e9,
        "source": "PCI Express 5.0 (references.md, ref-pcie5): 32 GT/s per lane, so about "
                  "64 GB/s each way over 16 lanes, the H100 SXM's link to its host"},
    "pcie_revision": {
        "value": 5.0,
        "source": "PCI Express Base Specification Revision 5.0 (references.md, ref-pcie5), the "
                  "link an H100 SXM has to its host"},
    "nvme_read_bytes_per_s": {
        "value": 7e9,
        "source": "a PCIe 4.0 NVMe SSD's sequential read, about 7 GB/s (e.g. Samsung 990 PRO "
                  "data sheet: 7,450 MB/s; references.md, ref-990pro)"},
    "llama3_shapes": {
        "value": {name: {"n_layers": c.n_layers, "n_heads": c.n_heads,
                         "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "dim": c.dim,
                         "hidden_dim": c.hidden_dim}
                  for name, c in cluster.SHAPES.items() if name.startswith("Llama")},
        "source": "Meta's Llama 3 model card and Grattafiori et al. 2024 (references.md, "
                  "ref-llama3-card, ref-llama3): 8B: 32 layers, 32 heads, 8 KV heads of 128; "
                  "70B: 80 layers, 64 heads, 8 KV heads of 128"},
}


# ---- 1. SLOs, goodput, disaggregation ---------------------------------------------------------

def requests_at(model, rate: float, n: int, prompt_range, new_range, seed: int = 0) -> list:
    """n requests of a Poisson load of `rate` a second (kvlab.serving.arrival_times):
    prompts of prompt_range tokens cut from the sample text, new_range new tokens each.
    The same seed gives the same prompts at every rate, so the rates differ only in when."""
    rng = np.random.default_rng(seed)
    text = model.encode(SAMPLE_TEXT * 40)
    requests = []
    for arrival in serving.arrival_times(n, rate, seed):
        length = int(rng.integers(*prompt_range))
        start = int(rng.integers(0, len(text) - length))
        requests.append((float(arrival), text[start:start + length], int(rng.integers(*new_range))))
    return requests


def same_tokens(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        [o.tokens for o in a[i].outputs] == [o.tokens for o in b[i].outputs] for i in a)


def serving_runs(model, rates, n, prompt_range, new_range, slo, link) -> list:
    """At each rate: one engine (1 GPU), two engines each given every other request (2
    GPUs, replicas), and a prefill engine with a decode engine (2 GPUs, disaggregated)."""
    rows = []
    for rate in rates:
        requests = requests_at(model, rate, n, prompt_range, new_range)
        one, seconds = cluster.colocated(model, requests)
        halves = [cluster.colocated(model, requests[i::2]) for i in (0, 1)]
        split = cluster.Disaggregated(model, link)
        apart = split.run(requests)
        # the replicas' request ids restart at 0 in each: key them by their arrival order
        pair = {2 * k + i: out for i, (outs, _) in enumerate(halves) for k, out in outs.items()}
        row = {"rate": rate, "one": cluster.served(one, seconds, slo),
               "replicas": cluster.served(pair, max(s for _, s in halves), slo),
               "disaggregated": cluster.served(apart, split.seconds, slo),
               "moved_bytes": split.moved_bytes, "hand_offs": split.hand_offs,
               "same_tokens": same_tokens(one, apart) and same_tokens(one, pair)}
        for gpus, key in ((1, "one"), (2, "replicas"), (2, "disaggregated")):
            row[key]["goodput_per_gpu"] = row[key]["goodput"] / gpus
        print(f"rate {rate:5.2f}/s: " + "  ".join(
            f"{key} {row[key]['tokens_per_s']:6.1f} tok/s goodput {row[key]['goodput']:5.2f} "
            f"(p99 TTFT {row[key]['ttft_p99_ms']:6.0f} ms, TPOT {row[key]['tpot_p99_ms']:5.0f} ms)"
            for key in ("one", "replicas", "disaggregated")) + f"  same tokens {row['same_tokens']}",
            flush=True)
        rows.append(row)
    return rows


def serving_section(model, quick: bool) -> dict:
    cost = slo_module.StepCost.for_model(model)
    setup = (dict(rates=(20.0, 80.0), n=8, prompt_range=(16, 64), new_range=(8, 24),
                  slo=(0.05, 0.004)) if quick else
             dict(rates=(0.5, 1.5, 3.0), n=16, prompt_range=(32, 256), new_range=(8, 40),
                  slo=(SLO_TTFT_S, SLO_TPOT_S)))
    slo = slo_module.SLO(*setup["slo"])
    link = FACTS["link_bytes_per_s"]["value"]
    rows = serving_runs(model, setup["rates"], setup["n"], setup["prompt_range"],
                        setup["new_range"], slo, link)
    return {"cost": dict(vars(cost)) if hasattr(cost, "__dict__") else
            {f: getattr(cost, f) for f in cost.__dataclass_fields__},
            "requests": setup["n"], "prompt_tokens": list(setup["prompt_range"]),
            "new_tokens": list(setup["new_range"]),
            "slo_ttft_s": slo.ttft_s, "slo_tpot_s": slo.tpot_s, "link_bytes_per_s": link,
            "rows": rows}


def plot_goodput(result, path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0))
    rates = [r["rate"] for r in result["rows"]]
    one = [r["one"] for r in result["rows"]]
    left.plot(rates, [r["requests_per_s"] for r in one], "o--", label="throughput (requests/s)")
    left.plot(rates, [r["goodput"] for r in one], "o-", label="goodput (within the SLO)")
    left.plot(rates, rates, ":", color="grey", label="offered load")
    left.set_title("One engine: throughput and goodput")
    left.set_ylabel("requests a second")
    for key, label in (("one", "one engine (1 GPU)"), ("replicas", "two engines (2 GPUs)"),
                       ("disaggregated", "prefill + decode (2 GPUs)")):
        right.plot(rates, [100 * r[key]["served"] / r[key]["requests"] for r in result["rows"]],
                   "o-", label=label)
    right.set_title("Requests served within the SLO")
    right.set_ylabel("% of requests (TTFT and TPOT met)")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.set_xlabel("offered load (requests a second)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- 3. K/V tiers ------------------------------------------------------------------------

def tiers(model, lengths, rounds: int) -> list:
    """measure_tiers for each context length, `rounds` times in turn; the median of each
    time per length."""
    text = model.encode(SAMPLE_TEXT * 40)
    runs = {n: [] for n in lengths}
    with tempfile.TemporaryDirectory(dir=HERE) as folder:   # a disk, not a RAM-backed /tmp
        for _ in range(rounds):
            for n in lengths:
                runs[n].append(cluster.measure_tiers(model, (text * (n // len(text) + 2))[:n + 1],
                                                     folder))
    rows = []
    for n in lengths:
        row = {"tokens": runs[n][0]["tokens"], "bytes": runs[n][0]["bytes"]}
        for key in ("compute_s", "host_out_s", "host_in_s", "disk_write_s", "disk_read_s"):
            row[key] = statistics.median(r[key] for r in runs[n])
        row["host_s"] = row["host_out_s"] + row["host_in_s"]
        row["disk_s"] = row["disk_write_s"] + row["disk_read_s"]
        row["compute_over_host"] = row["compute_s"] / row["host_s"]
        row["compute_over_disk"] = row["compute_s"] / row["disk_s"]
        rows.append(row)
    return rows


def tiers_gpu() -> dict:
    """Llama-3-8B on an H100, from the facts: a token's K and V (bf16) moved over PCIe 5.0
    or read from an NVMe disk, against computing it again at the GPU's peak bf16 rate
    (2 FLOPs per parameter per token, attention left out: the recompute's best case)."""
    c = cluster.SHAPES["Llama-3-8B"]
    per_token = cluster.kv_bytes_per_gpu(c, 1)["per_gpu"]
    compute = 2 * c.n_params() / FACTS["h100_bf16_dense_flops"]["value"]
    host = cluster.Tier("host", FACTS["pcie5_x16_bytes_per_s"]["value"]).seconds(per_token)
    disk = cluster.Tier("disk", FACTS["nvme_read_bytes_per_s"]["value"]).seconds(per_token)
    return {"kv_bytes_per_token": per_token, "flops_per_token": 2 * c.n_params(),
            "compute_s_per_token": compute, "host_s_per_token": host, "disk_s_per_token": disk,
            "compute_us_per_token": 1e6 * compute, "host_us_per_token": 1e6 * host,
            "disk_us_per_token": 1e6 * disk,
            "compute_over_host": compute / host, "compute_over_disk": compute / disk}


def plot_tiers(rows, path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [r["tokens"] for r in rows]
    for key, label, style in (("compute_s", "compute again (prefill)", "o-"),
                              ("disk_s", "file: write + read back", "s-"),
                              ("host_s", "host memory: swap out + in", "^-")):
        ax.plot(x, [1e3 * r[key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms (median)")
    ax.set_title("SmolLM2: getting a context's K and V back")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- 4. prefix sharing ----------------------------------------------------------------------

ANSWERS = ["Paris is the capital of France.", "It is about 2.1 million people.",
           "The Seine runs through it.", "Try the Louvre and the Musee d'Orsay."]
QUESTIONS = ["What is the capital of France?", "How many people live there?",
             "Which river runs through it?", "What should I visit first?"]
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
SHOTS = [("Translate to French: cat", "chat"), ("Translate to French: dog", "chien"),
         ("Translate to French: house", "maison"), ("Translate to French: bread", "pain")]
WORDS = ["water", "apple", "book", "tree", "car", "river", "night", "sun", "friend", "school",
         "garden", "window"]


def conversation(model, messages) -> list:
    """The token ids of a conversation in the model's chat template (SmolLM2's); a model
    without one (the bundled model, --quick) gets the turns as plain lines."""
    if getattr(model.tokenizer, "chat_template", None):
        return chat.prompt(model, messages)[1]
    return model.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


def chat_workload(model, conversations: int, turns: int) -> list:
    """Multi-turn chats: turn t's prompt is the whole conversation so far (the earlier turns
    with their answers), in the model's chat template; conversations differ in their
    opening system line."""
    prompts = []
    for c in range(conversations):
        messages = [{"role": "system", "content": f"{SYSTEM} (session {c + 1})"}]
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            prompts.append(conversation(model, messages))
            messages.append({"role": "assistant", "content": ANSWERS[t % len(ANSWERS)]})
    return prompts


def few_shot_workload(model, n: int) -> list:
    """One few-shot preamble (a system line and four worked examples), then n different
    questions."""
    prompts = []
    for word in WORDS[:n]:
        messages = [{"role": "system", "content": SYSTEM}]
        for question, answer in SHOTS:
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": f"Translate to French: {word}"})
        prompts.append(conversation(model, messages))
    return prompts


def sharing(model, workloads: dict) -> dict:
    result = {}
    for name, prompts in workloads.items():
        radix = cluster.radix_hits(prompts)
        row = {"prompts": len(prompts), "tokens": int(sum(len(p) for p in prompts)),
               "radix": int(sum(radix)), "blocks": {}}
        for size in BLOCK_SIZES:
            row["blocks"][str(size)] = int(sum(cluster.block_hash_hits(model, prompts, size)))
        row["radix_share"] = row["radix"] / row["tokens"]
        for size in BLOCK_SIZES:
            row[f"lost_at_{size}"] = row["radix"] - row["blocks"][str(size)]
            row[f"lost_share_at_{size}"] = row[f"lost_at_{size}"] / row["radix"]
        result[name] = row
    return result


def plot_sharing(result, path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = list(result)
    kinds = ["radix tree"] + [f"blocks of {s}" for s in BLOCK_SIZES]
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        values = [(result[n]["radix"] if i == 0 else result[n]["blocks"][str(BLOCK_SIZES[i - 1])])
                  / result[n]["tokens"] for n in names]
        ax.bar(np.arange(len(names)) + i * width, [100 * v for v in values], width, label=kind)
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_title("Prompt tokens found in the cache")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- 5. tensor parallelism ----------------------------------------------------------------

def tp_table() -> dict:
    gpu = FACTS["h100_memory_bytes"]["value"]
    table = {}
    for name, config in cluster.SHAPES.items():
        rows = []
        for tp in TP_SIZES:
            try:
                row = cluster.kv_bytes_per_gpu(config, tp)
            except ValueError:
                continue                                  # no such split of its heads
            row["tokens_per_80gb_gpu"] = cluster.tokens_per_gpu(config, tp, gpu)
            row["weight_bytes_per_gpu"] = config.n_params() * 2 / tp
            rows.append(row)
        table[name] = {"n_params": config.n_params(), "rows": rows}
    return table


def plot_tp(table, path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0))
    for name, entry in table.items():
        tps = [r["tp"] for r in entry["rows"]]
        left.plot(tps, [r["per_gpu"] / 1024 for r in entry["rows"]], "o-", label=name)
        right.plot(tps, [r["copies"] for r in entry["rows"]], "o-", label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(TP_SIZES, [str(t) for t in TP_SIZES])
        ax.set_xlabel("tensor-parallel GPUs (tp)")
        ax.grid(True, alpha=0.3)
    left.set_yscale("log", base=2)
    left.set_ylabel("K/V KiB per token, per GPU (bf16)")
    left.set_title("Each GPU's share of a token's K and V")
    right.set_ylabel("K/V bytes on all GPUs / the model's")
    right.set_title("KV heads copied once tp > n_kv_heads")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the numbers the prose prints whole ---------------------------------------------------

def quoted(result) -> dict:
    """Every number the chapter prints from this JSON, formatted as printed, by name
    (tests/test_chapters.py finds each in the prose; the chapter was written from them)."""
    q = {}
    if result.get("serving"):
        s = result["serving"]
        q["slo_ttft_ms"], q["slo_tpot_ms"] = f"{1e3 * s['slo_ttft_s']:,.0f}", f"{1e3 * s['slo_tpot_s']:,.0f}"
        for name in ("step_s", "token_s", "sequence_s", "kv_row_s"):
            q[f"cost_{name}_ms"] = f"{1e3 * s['cost'][name]:.4g}"
        q["moved"] = f"{s['rows'][0]['moved_bytes']:,}"   # the same requests at every rate
        for row in s["rows"]:
            r = f"{row['rate']:g}"
            q[f"one_{r}_tok"] = f"{row['one']['tokens_per_s']:.1f}"
            for key in ("one", "replicas", "disaggregated"):
                x = row[key]
                q[f"{key}_{r}_served"] = f"{x['served']} of {x['requests']}"
                q[f"{key}_{r}_ttft"] = f"{x['ttft_p99_ms']:,.0f}"
                q[f"{key}_{r}_tpot"] = f"{x['tpot_p99_ms']:.1f}"
                q[f"{key}_{r}_per_gpu"] = f"{x['goodput_per_gpu']:.2f}"
    if result.get("tiers"):
        for row in result["tiers"]:
            n = row["tokens"]
            q[f"tier_{n}_bytes"] = f"{row['bytes']:,}"
            for key in ("compute_s", "host_s", "disk_s"):
                q[f"tier_{n}_{key}"] = f"{1e3 * row[key]:,.2f}"
            q[f"tier_{n}_over_host"] = f"{row['compute_over_host']:.0f}"
            q[f"tier_{n}_over_disk"] = f"{row['compute_over_disk']:.1f}"
        g = result["tiers_gpu"]
        q["gpu_kv_bytes"] = f"{g['kv_bytes_per_token']:,}"
        q["gpu_gflop"] = f"{g['flops_per_token'] / 1e9:.2f}"
        for key in ("compute", "host", "disk"):
            q[f"gpu_{key}_us"] = f"{g[key + '_us_per_token']:.2f}"
        q["gpu_over_host"] = f"{g['compute_over_host']:.1f}"
        q["gpu_over_disk"] = f"{g['compute_over_disk']:.2f}"
    if result.get("sharing"):
        for name, row in result["sharing"].items():
            k = name.split()[0].replace("-", "_")
            q[f"{k}_prompts"], q[f"{k}_tokens"] = f"{row['prompts']}", f"{row['tokens']:,}"
            q[f"{k}_radix"] = f"{row['radix']:,}"
            q[f"{k}_radix_share"] = f"{100 * row['radix_share']:.1f} %"
            for size in BLOCK_SIZES:
                q[f"{k}_blocks_{size}"] = f"{row['blocks'][str(size)]:,}"
                q[f"{k}_lost_{size}"] = f"{row[f'lost_at_{size}']:,}"
                q[f"{k}_lost_share_{size}"] = f"{100 * row[f'lost_share_at_{size}']:.1f} %"
    if result.get("tp"):
        for name, entry in result["tp"].items():
            for row in entry["rows"]:
                key = f"tp_{name}_{row['tp']}"
                q[f"{key}_bytes"] = f"{row['per_gpu']:,}"
                q[f"{key}_tokens"] = f"{row['tokens_per_80gb_gpu']:,}"
    return q


# ---- the run -----------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run on the bundled model that checks the script works "
                             "(the tests run this); its numbers are not the chapter's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", default=",".join(str(n) for n in SECTION_KEYS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kvlab.set_num_threads(args.threads)
    sections = sorted(int(s) for s in args.sections.split(","))
    started, load_before = time.perf_counter(), os.getloadavg()
    old = json.loads((out / "ch11.json").read_text()) if (out / "ch11.json").is_file() else {}
    result = {key: old.get(key) for keys in SECTION_KEYS.values() for key in keys}
    model = kvlab.load() if args.quick else smollm2()
    section_runs = dict(old.get("setup", {}).get("section_runs", {}))

    if 1 in sections:
        result["serving"] = serving_section(model, args.quick)
        plot_goodput(result["serving"], out / "ch11_goodput.png")
    if 3 in sections:
        lengths = (16, 64) if args.quick else (128, 256, 512, 1024)
        result["tiers"] = tiers(model, lengths, 1 if args.quick else args.rounds)
        result["tiers_gpu"] = tiers_gpu()
        plot_tiers(result["tiers"], out / "ch11_tiers.png")
    if 4 in sections:
        workloads = {"multi-turn chat": chat_workload(model, 2 if args.quick else 4, 4),
                     "few-shot": few_shot_workload(model, 4 if args.quick else 12)}
        result["sharing"] = sharing(model, workloads)
        plot_sharing(result["sharing"], out / "ch11_sharing.png")
    if 5 in sections:
        result["tp"] = tp_table()
        plot_tp(result["tp"], out / "ch11_tp.png")
    for n in sections:
        section_runs[str(n)] = {"quick": args.quick, "date": time.strftime("%Y-%m-%d"),
                                "seconds": round(time.perf_counter() - started, 1)}

    result = {
        "setup": {**machine(), "threads": kvlab.get_num_threads(), "machine": platform.machine(),
                  "model": model.config.name or model.source, "rounds": args.rounds,
                  "quick": args.quick, "section_runs": section_runs,
                  "load_average_before_after": [load_before, os.getloadavg()],
                  "seconds": round(time.perf_counter() - started, 1)},
        **result,
        "facts": FACTS,
        "quoted": quoted(result),
    }
    (out / "ch11.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {out / 'ch11.json'} in {result['setup']['seconds']} s (sections {sections})")


if __name__ == "__main__":
    main()
