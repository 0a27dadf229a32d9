"""Figures and numbers for chapter 5, "Batching and scheduling".

    python chapters/figures/ch05.py [--out DIR] [--threads N] [--rounds R] [--budget-rounds R]
                                    [--sections 1,2,3,4,5] [--quick]

Writes ch05_throughput.png, ch05_budget.png, ch05_latency.png and ch05.json (every number
the chapter quotes, with the setup and the facts it quotes from data sheets). All through
kvlab.Engine:

1. The engine's outputs equal kvlab.generate, token for token: greedy and sampled requests
   (n=2) on a pool small enough to force preemptions (the bundled model: an instant run).
2. Decode throughput against batch size on SmolLM2-135M: Q8_0 and Q4_1 weights with int8
   activations, and float32 weights. B requests decode together for B = 1 .. 32; a round
   runs every batch size of every format once, in turn, so each ratio to batch 1 is taken
   within one round and the chapter quotes the median over the rounds. The core's counters
   give the weight and K/V bytes and the FLOPs per token; with the data sheets' FLOP/s and
   bandwidth, the H100's and the H200's ridge points (this CPU's throughput saturates for
   another reason: batch 1 is partly core-bound, so it has no roofline ridge to measure).
3. One K/V memory budget (6 contiguous caches of 256 positions), served four ways: static
   or continuous batching, on contiguous reservations (one 256-position block per request)
   or on a paged pool of 16-position blocks; SmolLM2 (Q8_0, int8 activations) with its
   context cut to 256 positions, long-tailed request lengths (as benchmarks/bench_engine.py's
   workload); the four in turn each round, ratios within a round.
4. Latency under a Poisson load (kvlab.serving.serve, what `kvlab serve-bench` runs) on the
   same model: time to first token and time per output token, p50 and p99, at three request
   rates: paged with two max_batch_tokens, and contiguous caches of the same bytes.
5. Preemption by swapping against recompute (benchmarks/bench_swap.py) on the bundled model.

Sections 2 and 3 time CPU seconds of the one core thread, which other processes on a shared
machine disturb far less than the wall clock; section 4 is a real-time server, and section
5 is bench_swap's wall clock. The sections can be run separately (--sections): the ones not
run keep their numbers from the ch05.json already in DIR, and setup.section_runs says when
each ran. The full run takes a few minutes on the 2-core development machine (one core
thread by default); --quick runs the same code on fewer batch sizes, requests and rounds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
from common import (chosen_sections, earlier_sections, english_text,  # noqa: E402
                    gpu_facts, machine, smollm2)  # (common puts benchmarks/ on the path)
import bench_swap  # noqa: E402  (swapping against recompute, as the benchmark measures it)

HERE = Path(__file__).resolve().parent

# Facts the chapter quotes from data sheets and documentation, with their sources.
FACTS = {
    **gpu_facts("h100_hbm_bytes_per_s", "h100_bf16_dense_flops", "h200_hbm_bytes_per_s",
                "h200_bf16_dense_flops"),
    "vllm_v1_preemption": {
        "value": "recompute",
        "source": "vLLM documentation, Optimization and Tuning (vLLM V1; references.md, "
                  "ref-vllm-preemption): preempted requests are recomputed when KV cache "
                  "space becomes available again (PreemptionMode.RECOMPUTE)"},
}
FORMATS = {                    # name: kvlab.load's arguments for SmolLM2
    "Q8_0, int8 activations": {"weights": "q8_0"},
    "Q4_1, int8 activations": {"weights": "q4_1"},
    "float32": {"weights": "fp32"},
}


# ---- 1. same tokens as kvlab.generate ----------------------------------------------------

def equality_check(model: kvlab.Model) -> dict:
    prompts = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY:\n", "To be, or not",
               "O Romeo, "]
    pool = model.new_paged_pool(num_blocks=14, block_size=16)      # too small for all at once
    engine = kvlab.Engine(model, pool, max_batch_tokens=64)
    requests = []
    for i, prompt in enumerate(prompts):
        params = (kvlab.SamplingParams(max_new_tokens=60) if i % 2 == 0 else
                  kvlab.SamplingParams(max_new_tokens=60, temperature=0.8, top_k=40, seed=i, n=2))
        requests.append((engine.add_request(prompt, params), prompt, params))
    outputs = engine.run(progress=False)
    same, samples = True, 0
    for rid, prompt, p in requests:
        for i in range(p.n):
            alone = kvlab.generate(model, prompt, p.max_new_tokens, temperature=p.temperature,
                                   top_k=p.top_k, seed=None if p.seed is None else p.seed + i)
            same &= alone.tokens == outputs[rid].outputs[i].tokens
            samples += 1
    return {"requests": len(prompts), "samples": samples, "pool_blocks": 14, "block_size": 16,
            "max_batch_tokens": 64, "steps": len(engine.metrics),
            "max_batch": max(m.batch_size for m in engine.metrics),
            "preemptions": sum(m.preemptions for m in engine.metrics),
            "identical_to_generate": bool(same)}


# ---- 2. throughput against batch size ----------------------------------------------------

def decode_run(model: kvlab.Model, batch: int, new_tokens: int, prompt_len: int = 4,
               count: bool = False) -> dict:
    """B requests of random prompts decoded together: the median decode step's CPU time
    (one core thread: on a shared machine the CPU time is what the step cost, where the
    wall clock also counts the other processes' turns), and (count=True) what the core
    counted per generated token in the decode steps."""
    rng = np.random.default_rng(batch)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 4
    pool = model.new_paged_pool(num_blocks=blocks, block_size=16, max_seqs=batch)
    engine = kvlab.Engine(model, pool, max_batch_tokens=max(256, batch * prompt_len))
    for _ in range(batch):
        prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
        engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
    seconds, weight_bytes, kv_bytes, flops, tokens = [], 0, 0, 0, 0
    while engine.has_work:
        with model.counting() as counts:
            cpu = time.process_time()
            step = engine.step()
            cpu = time.process_time() - cpu
        if step.prefill_tokens == 0 and step.decode_tokens:
            seconds.append(cpu)
            weight_bytes += counts.weight_bytes
            kv_bytes += counts.kv_read_bytes
            flops += counts.flops
            tokens += step.decode_tokens
    row = {"step_s": statistics.median(seconds)}
    if count:
        row.update(weight_bytes_per_token=weight_bytes / tokens,
                   kv_read_bytes_per_token=kv_bytes / tokens, flops_per_token=flops / tokens)
    return row


def throughput(models: dict, batches, rounds: int, new_tokens: int) -> dict:
    """Every batch size of every format once per round, in turn: a round's ratios to its
    own batch 1 meet the same load; the medians over the rounds are quoted."""
    steps = {(name, b): [] for name in models for b in batches}
    counted = {}
    for name, model in models.items():          # counters do not depend on timing: once
        decode_run(model, 1, 2)                  # warm up (pages, caches)
        for b in batches:
            counted[(name, b)] = decode_run(model, b, 3, count=True)
    for _ in range(rounds):
        for b in batches:
            for name, model in models.items():
                steps[(name, b)].append(decode_run(model, b, new_tokens)["step_s"])
    rows = []
    for name, model in models.items():
        for b in batches:
            runs = steps[(name, b)]
            ratios = [steps[(name, 1)][r] * b / runs[r] for r in range(rounds)]
            tok_s = statistics.median(b / s for s in runs)
            c = counted[(name, b)]
            rows.append({"format": name, "batch": b, "rounds": rounds,
                         "weights_bytes": model.weights_nbytes,
                         "decode_tokens_per_s": round(tok_s, 1),
                         "speedup_vs_batch1": round(statistics.median(ratios), 2),
                         "speedup_range": [round(min(ratios), 2), round(max(ratios), 2)],
                         "weight_bytes_per_token": c["weight_bytes_per_token"],
                         "kv_read_bytes_per_token": c["kv_read_bytes_per_token"],
                         "flops_per_token": c["flops_per_token"],
                         # what a decode step achieved: weight bytes streamed, arithmetic done
                         "weight_gb_per_s": round(tok_s * c["weight_bytes_per_token"] / 1e9, 1),
                         "gflop_per_s": round(tok_s * c["flops_per_token"] / 1e9, 1),
                         "flops_per_weight_byte": round(c["flops_per_token"] / c["weight_bytes_per_token"], 2)})
    return {"batches": list(batches), "new_tokens": new_tokens, "prompt_tokens": 4,
            "rounds": rounds, "rows": rows}


def ridge(result: dict, params: int) -> dict:
    """Where the weight products stop being limited by memory. A sequence of a decode batch
    does 2 FLOPs per weight, so a batch of B does 2B FLOPs per weight read: per weight byte
    2B / (bytes per weight). For the CPU, the most arithmetic per second any batch reached
    over the weight bytes per second batch 1 streamed (one format's own run): not a true
    ridge, as batch 1 is partly core-bound here, so "ridge_batch" is only the best speed-up
    in FLOPs; the chapter quotes the peak and each format's FLOPs per byte per sequence.
    The GPUs' ridges from their data sheets, for bf16 weights (2 bytes: B FLOPs per byte)."""
    out = {}
    for name in dict.fromkeys(r["format"] for r in result["rows"]):
        mine = [r for r in result["rows"] if r["format"] == name]
        one = mine[0]
        peak = max(r["gflop_per_s"] for r in mine)
        flops_per_byte = peak / one["weight_gb_per_s"]
        per_sequence = 2 * params / one["weights_bytes"]      # FLOPs per weight byte at B=1
        out[name] = {"batch1_weight_gb_per_s": one["weight_gb_per_s"],
                     "peak_gflop_per_s": peak,
                     "ridge_flops_per_byte": round(flops_per_byte, 2),
                     "flops_per_weight_byte_per_sequence": round(per_sequence, 3),
                     "ridge_batch": round(flops_per_byte / per_sequence, 1)}
    for gpu in ("h100", "h200"):
        r = FACTS[f"{gpu}_bf16_dense_flops"]["value"] / FACTS[f"{gpu}_hbm_bytes_per_s"]["value"]
        out[gpu] = {"ridge_flops_per_byte": round(r), "ridge_batch_bf16_weights": round(r)}
    return out


# ---- 3. one memory budget: static or continuous, contiguous or paged ---------------------

# The four ways to serve, each (scheduling, memory): the two effects apart and together.
WAYS = (("static", "contiguous"), ("continuous", "contiguous"),
        ("static", "paged"), ("continuous", "paged"))
WAY_LABELS = {"static_contiguous": "static, contiguous",
              "continuous_contiguous": "continuous, contiguous",
              "static_paged": "static, paged", "continuous_paged": "continuous, paged"}


def short_context(model: kvlab.Model, context: int) -> kvlab.Model:
    """The same weights with a shorter context: a contiguous cache reserves the whole
    context, so the budget below counts caches of `context` positions."""
    return kvlab.Model(model.config.replace(max_seq_len=context), model.weights,
                       model.tokenizer, activations=model.activations)


def serve(model, pool, groups) -> dict:
    """Every request to the end, a group at a time: each group runs until its slowest
    request is done before the next starts (one group of all of them: continuous)."""
    running, made, generated, preemptions = [], [], 0, 0
    start = time.process_time()              # CPU seconds, as decode_run's
    with model.counting() as counts:          # what the core did, over the whole run
        for group in groups:
            engine = kvlab.Engine(model, pool, max_batch_tokens=512)
            for prompt, params in group:
                engine.add_request(prompt, params)
            while engine.has_work:
                step = engine.step()
                running.append(step.batch_size)
                generated += sum(len(t) for t in step.new_tokens.values())
                made.append(generated)
                preemptions += step.preemptions
    seconds = time.process_time() - start
    return {"seconds": seconds, "tokens": generated, "steps": len(running),
            "peak_running": max(running), "mean_running": float(np.mean(running)),
            "preemptions": preemptions, "flops": counts.flops,
            "weight_bytes": counts.weight_bytes, "kv_read_bytes": counts.kv_read_bytes,
            "tokens_run": counts.tokens, "running_per_step": running, "tokens_so_far": made}


def static_groups(requests, memory: str, pool, n_static: int) -> list:
    """Static batches. Contiguous: n_static requests at a time, each reserving a whole
    context. Paged: as many requests as the pool holds at their final lengths, known here
    in advance (a server does not know them: this is static batching at its best). A
    request's final length is its prompt and every new token but the last, which is never
    run through the model."""
    groups, group, blocks = [], [], 0
    for prompt, params in requests:
        need = -(-(len(prompt) + params.max_new_tokens - 1) // pool.block_size)
        full = len(group) == n_static if memory == "contiguous" else blocks + need > pool.num_blocks
        if group and full:
            groups.append(group)
            group, blocks = [], 0
        group.append((prompt, params))
        blocks += need
    return groups + [group]


def workload(model: kvlab.Model, n_requests: int, max_len: int, seed: int = 0) -> list:
    """Long-tailed lengths, as benchmarks/bench_engine.py's: most requests are short, a few
    run long (up to max_len in all); short prompts of random tokens (4 to 15), so that the
    run is mostly decode steps, where batching matters."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n_requests):
        prompt = rng.integers(0, model.config.vocab_size, int(rng.integers(4, 16))).tolist()
        new = int(min(max_len - 16, max(4, rng.lognormal(np.log(max_len / 8), 0.9))))
        requests.append((prompt, kvlab.SamplingParams(max_new_tokens=new, stop_at_eos=False)))
    return requests


def memory_budget(model: kvlab.Model, n_requests: int, rounds: int, n_static: int = 6) -> dict:
    max_len = model.config.max_seq_len
    budget = kvlab.kv_cache_bytes(model.config, max_len, n_static, dtype="fp32")
    requests = workload(model, n_requests, max_len)
    paged_blocks = budget // (16 * kvlab.kv_bytes_per_token(model.config, "fp32"))
    results, times = {}, {f"{s}_{m}": [] for s, m in WAYS}
    for _ in range(rounds):                      # in turn, so each meets the same load
        for scheduling, memory in WAYS:
            # Contiguous: one block of a whole context per request, reserved whole (16 of
            # them in the budget). Paged: blocks of 16. Fresh pools every run: a used
            # pool's prefix cache would remember the prompts.
            pool = (model.new_paged_pool(num_blocks=n_static, block_size=max_len)
                    if memory == "contiguous" else
                    model.new_paged_pool(num_blocks=paged_blocks, block_size=16))
            assert pool.nbytes == budget
            groups = (static_groups(requests, memory, pool, n_static) if scheduling == "static"
                      else [requests])
            run = serve(model, pool, groups)
            name = f"{scheduling}_{memory}"
            times[name].append(run["seconds"])
            results[name] = {"scheduling": scheduling, "memory": memory,
                             "block_size": pool.block_size, "groups": len(groups), **run}
    base = results["static_contiguous"]
    for name, run in results.items():
        ratios = [b / t for b, t in zip(times["static_contiguous"], times[name])]
        run["seconds"] = statistics.median(times[name])
        run["seconds_runs"] = times[name]
        run["tokens_per_s"] = run["tokens"] / run["seconds"]
        run["steps_vs_static_contiguous"] = base["steps"] / run["steps"]
        # the ratio within each round, then the median over the rounds
        run["speedup_vs_static_contiguous"] = statistics.median(ratios)
    return {"model": model.config.name, "max_len": max_len, "budget_bytes": budget,
            "contiguous_blocks": n_static, "paged_blocks": paged_blocks, "rounds": rounds,
            "requests": n_requests, "tokens": sum(p.max_new_tokens for _, p in requests),
            "mean_new_tokens": float(np.mean([p.max_new_tokens for _, p in requests])),
            "max_new_tokens": max(p.max_new_tokens for _, p in requests), **results}


# ---- 4. latency under a Poisson load: what a user waits for ---------------------------

LATENCY_CONFIGS = (("paged", 512), ("paged", 32), ("contiguous", 512))
LATENCY_STATS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                 "e2e_p50_ms", "e2e_p99_ms")


def latency_workload(model, n_requests: int, rate: float, seed: int = 0) -> list:
    """kvlab.serving.workload's shape, (arrival second, prompt ids, new tokens), sized for a
    135 M model on a CPU: prompts of 8 to 47 tokens of English text, 4 to 19 new tokens,
    arriving as a Poisson process at `rate` a second."""
    rng = np.random.default_rng(seed)
    text = model.encode(english_text(8_000)[0])
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(8, 48))
        start = int(rng.integers(0, len(text) - length))
        requests.append((float(arrival), text[start:start + length], int(rng.integers(4, 20))))
    return requests


def latency(model, rates, n_requests: int, num_blocks: int) -> dict:
    """kvlab.serving.serve at each rate, for each (memory, token budget): the same requests
    at one rate for all four, run one after the other. A pool of num_blocks blocks of 16;
    contiguous caches of the same bytes hold num_blocks * 16 / context requests."""
    runs = []
    for rate in rates:
        requests = latency_workload(model, n_requests, rate)
        for memory, budget in LATENCY_CONFIGS:
            row = kvlab.serving.serve(model, requests, budget, num_blocks=num_blocks,
                                      memory=memory)
            runs.append({"rate": rate, **row})
    return {"rates": list(rates), "requests_per_run": n_requests, "num_blocks": num_blocks,
            "block_size": 16, "context": model.config.max_seq_len,
            "contiguous_requests": num_blocks * 16 // model.config.max_seq_len, "runs": runs}


# ---- 5. preemption: swapping against recompute ------------------------------------------

def preemption(model, contexts=(64, 256, 1024), rounds: int = 9,
               engine_rounds: int = 3) -> dict:
    """benchmarks/bench_swap.py's two measurements: one sequence swapped out and in against
    recomputed, for several lengths (the bundled model's context raised to fit); and the
    Engine on a workload too large for its pool, preempting by recompute and by swapping,
    with the same tokens."""
    long = bench_swap.long_context(model, max(contexts) + 1)   # and one more step after
    sequences = [bench_swap.bench_one_sequence(long, n, "fp32", rounds) for n in contexts]
    return {"sequences": sequences, "engine": bench_swap.bench_engine(model, 16, engine_rounds)}


# ---- exact arithmetic the text shows ----------------------------------------------------

def llama2_7b_arithmetic(batch: int = 16, context: int = 4096) -> dict:
    """Bytes a decode step reads for Llama 2 7B in fp16: weights once per step, and each
    sequence's own cache."""
    config = kvlab.ModelConfig.llama2_7b()
    weights = kvlab.measure.weights_bytes(config, "fp16")
    per_token = kvlab.kv_bytes_per_token(config, "fp16")
    cache = kvlab.kv_cache_bytes(config, context, 1, dtype="fp16")
    return {"params": config.n_params(), "weights_fp16_bytes": weights,
            "kv_bytes_per_token_fp16": per_token, "batch": batch, "context": context,
            "cache_bytes_per_sequence": cache,
            "step_weight_bytes": weights, "step_kv_bytes": batch * cache,
            "weight_bytes_per_generated_token": weights / batch,
            "kv_bytes_per_generated_token": cache,
            "context_whose_cache_equals_weights_share": weights / batch / per_token}


# ---- figures -------------------------------------------------------------------------------

def plot_throughput(result: dict, ridges: dict, path: Path) -> None:
    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(dict.fromkeys(r["format"] for r in rows))
    for name in names:
        mine = [r for r in rows if r["format"] == name]
        b = [r["batch"] for r in mine]
        left.plot(b, [r["decode_tokens_per_s"] for r in mine], "o-",
                  label=f"{name} (up to {max(r['speedup_vs_batch1'] for r in mine):.2f}x "
                        f"batch 1)")
    first = [r for r in rows if r["format"] == names[0]]
    b = [r["batch"] for r in first]
    right.plot(b, [r["weight_bytes_per_token"] / 1e6 for r in first], "o-",
               label="weights read per token")
    right.plot(b, [r["kv_read_bytes_per_token"] / 1e6 for r in first], "s--",
               label="K/V read per token (contexts of 5 to 6 tokens)")
    right.set_title(f"SmolLM2-135M, {names[0].split(',')[0]} weights: bytes per generated "
                    f"token\n(counted by the core)", fontsize=10)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("requests decoded together (batch size)")
    left.set_ylabel("decode tokens per CPU second")
    left.set_title(f"SmolLM2-135M decode throughput, kvlab.Engine (medians of "
                   f"{result['rounds']} rounds)", fontsize=10)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size")
    right.set_ylabel("MB per generated token")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_budget(budget, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, label in WAY_LABELS.items():
        run = budget[name]
        steps = np.arange(1, run["steps"] + 1)
        left.plot(steps, run["running_per_step"], lw=0.8, label=label)
        right.plot(steps, run["tokens_so_far"], label=f"{label}: {run['steps']} steps")
    left.set_xlabel("engine step")
    left.set_ylabel("sequences in the step's batch")
    left.set_title(f"{budget['requests']} requests, one K/V budget of "
                   f"{budget['budget_bytes'] / 2**20:.1f} MiB (SmolLM2-135M)", fontsize=10)
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.set_xlabel("engine step")
    right.set_ylabel("tokens generated so far")
    right.set_title("Same requests, same memory", fontsize=10)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency(result: dict, path: Path) -> None:
    kvlab.serving.plot(result["runs"], path,
                       title=f"SmolLM2-135M, Poisson arrivals, {result['requests_per_run']} "
                             f"requests a run")


# ---- the run -------------------------------------------------------------------------------

# What each section writes into ch05.json: --sections reruns some, the rest keep the numbers
# of the ch05.json already in --out (setup.section_runs says when each was run).
SECTION_KEYS = {1: ["equality"], 2: ["throughput", "ridge"], 3: ["memory_budget"],
                4: ["latency"], 5: ["preemption"]}


def run_throughput(models: dict, quick: bool, rounds: int, out: Path) -> dict:
    batches = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
    q8 = models.get("Q8_0, int8 activations") or next(iter(models.values()))
    tp = throughput(models, batches, rounds=1 if quick else rounds,
                    new_tokens=3 if quick else 5)
    ridges = ridge(tp, q8.n_params)
    for r in tp["rows"]:
        print(f"{r['format']:<24}{r['batch']:>4}{r['decode_tokens_per_s']:>8,.0f} tok/s"
              f"{r['speedup_vs_batch1']:>7.2f}x {r['speedup_range']}  weights "
              f"{r['weight_bytes_per_token']:>12,.0f} B/token  {r['weight_gb_per_s']:5.1f} GB/s"
              f" {r['gflop_per_s']:5.1f} GFLOP/s", flush=True)
    print("ridges:", ridges, flush=True)
    plot_throughput(tp, ridges, out / "ch05_throughput.png")
    return {"throughput": tp, "ridge": ridges}


def run_budget(served_model: kvlab.Model, quick: bool, rounds: int, out: Path) -> dict:
    budget = memory_budget(served_model, n_requests=6 if quick else 24,
                           rounds=1 if quick else rounds)
    for name in WAY_LABELS:
        r = budget[name]
        print(f"{name}: {r['steps']} steps, running peak {r['peak_running']} mean "
              f"{r['mean_running']:.1f}, {r['seconds']:.2f} s "
              f"({r['speedup_vs_static_contiguous']:.2f}x), {r['tokens_per_s']:,.0f} tok/s, "
              f"{r['flops'] / 1e9:.1f} GFLOP, weights {r['weight_bytes'] / 1e9:.2f} GB, "
              f"K/V {r['kv_read_bytes'] / 1e9:.2f} GB, {r['tokens_run']:,} tokens run", flush=True)
    plot_budget(budget, out / "ch05_budget.png")
    for name in WAY_LABELS:                  # the figure's data, not quoted: kept out
        del budget[name]["running_per_step"], budget[name]["tokens_so_far"]
    return {"memory_budget": budget}


def run_latency(served_model: kvlab.Model, quick: bool, out: Path) -> dict:
    served = latency(served_model, (4.0, 16.0) if quick else (1.0, 4.0, 16.0),
                     n_requests=3 if quick else 10, num_blocks=64)
    for r in served["runs"]:
        print(f"{r['rate']:>6g}/s {r['memory']:>10} {r['budget']:>4}: "
              f"{r['tokens_per_s']:7.0f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f}"
              f" p99 {r['ttft_p99_ms']:7.1f}  TPOT p50 {r['tpot_p50_ms']:5.1f}"
              f" p99 {r['tpot_p99_ms']:5.1f} ms", flush=True)
    plot_latency(served, out / "ch05_latency.png")
    return {"latency": served}


def run_preemption(bundled: kvlab.Model, quick: bool) -> dict:
    preempt = preemption(bundled, contexts=(64, 256) if quick else (64, 256, 1024),
                         rounds=3 if quick else 9, engine_rounds=1 if quick else 3)
    for r in preempt["sequences"]:
        print(f"{r['tokens']:>5} tokens: swap {1e6 * r['swap_s']:7.0f} us, recompute "
              f"{1e3 * r['recompute_s']:7.2f} ms: {r['recompute_over_swap']:.0f}x")
    for r in preempt["engine"]["runs"]:
        print(f"engine, {r['preemption']:>9}: {r['seconds']:.2f} s, {r['preemptions']} preemptions, "
              f"{r['recomputed_tokens']} tokens recomputed, {r['swapped_out_bytes']:,} B swapped out")
    return {"preemption": preempt}


def setup(models: dict, quick: bool, section_runs: dict, load_before, started: float) -> dict:
    return {**machine(), "threads": kvlab.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version(),
            "shared_machine": "a shared 2-core virtual machine: ratios are taken within "
                              "rounds run in turn, sections 2 and 3 in CPU seconds",
            "quick": quick, "nice": os.nice(0),
            "models": {name: {"params": m.n_params, "weights_bytes": m.weights_nbytes,
                              "weight_format": m.weight_format, "activations": m.activations,
                              "n_layers": m.config.n_layers, "n_kv_heads": m.config.n_kv_heads,
                              "head_dim": m.config.head_dim} for name, m in models.items()},
            # when, and under what load: the machine is shared
            "section_runs": {str(n): section_runs[n] for n in sorted(section_runs)},
            "load_average_before_after": [load_before, os.getloadavg()],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the throughput runs (the memory budget's: --budget-rounds)")
    parser.add_argument("--budget-rounds", type=int, default=2)
    parser.add_argument("--sections", default="1,2,3,4,5",
                        help="which to run (1 equality, 2 throughput, 3 memory budget, "
                             "4 latency, 5 preemption); the others keep --out's ch05.json's")
    args = parser.parse_args()
    sections = chosen_sections(parser, args.sections, SECTION_KEYS)
    quick = args.quick
    if quick:                                 # every section, shorter
        sections = sorted(SECTION_KEYS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result, section_runs = earlier_sections(out, "ch05.json", SECTION_KEYS, sections)
    kvlab.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()

    bundled = kvlab.load()
    formats = ({k: FORMATS[k] for k in ("Q4_1, int8 activations", "float32")} if quick
               else FORMATS)
    models = {name: smollm2(**options) for name, options in formats.items()}
    q8 = models.get("Q8_0, int8 activations") or next(iter(models.values()))
    served_model = short_context(q8, 128 if quick else 256)
    runs = {1: lambda: {"equality": equality_check(bundled)},
            2: lambda: run_throughput(models, quick, args.rounds, out),
            3: lambda: run_budget(served_model, quick, args.budget_rounds, out),
            4: lambda: run_latency(served_model, quick, out),
            5: lambda: run_preemption(bundled, quick)}
    for n in sections:
        since = time.perf_counter()
        result.update(runs[n]())
        section_runs[n] = (f"{datetime.datetime.now().isoformat(timespec='minutes')}, "
                           f"{time.perf_counter() - since:.1f} s, load average "
                           f"{os.getloadavg()[0]:.1f} at its end" + (" (--quick)" if quick else ""))
        print(f"section {n}: {section_runs[n]}", flush=True)
    print("engine vs generate:", result["equality"], flush=True)

    result = {"setup": setup({**models, "bundled": bundled}, quick, section_runs, load_before,
                             started),
              "facts": FACTS, "llama2_7b_arithmetic": llama2_7b_arithmetic(),
              **{key: result[key] for n in SECTION_KEYS for key in SECTION_KEYS[n]}}
    (out / "ch05.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out} in {result['setup']['seconds']} s (sections {sections})")


if __name__ == "__main__":
    main()
