"""Figures and numbers for chapter 5, "Batching and scheduling".

    python chapters/figures/ch05.py [--out DIR] [--threads N]

Writes ch05_throughput.png, ch05_budget.png, ch05_latency.png and ch05.json (every number
the chapter quotes, with the setup). Four measurements, all through kvlab.Engine:

1. The engine's outputs equal kvlab.generate, token for token: greedy and sampled
   requests (n=2) on a pool small enough to force preemptions.
2. Decode throughput against batch size: B requests of 16-token prompts and 8 new
   tokens each, B = 1 .. 64, on the bundled model, stories260K (where present) and random
   weights shaped like stories15M. Decode tokens/s is B / (the fastest decode step's
   time) over a few rounds run round-robin: the machine is shared, and other processes
   only ever add time to a step. The core's counters give the weight and K/V bytes and
   the FLOPs per token.
3. One KV memory budget (16 contiguous caches of 512 positions, fp32), served four ways:
   static or continuous batching, on contiguous reservations (a pool of one 512-position
   block per request) or on a paged pool of 16-position blocks, on 96 requests of
   long-tailed lengths (the workload of benchmarks/bench_engine.py); 3 rounds in turn,
   medians and spreads of the wall time; then the same on the stories15M shape (3 rounds).
4. Latency under a Poisson load (kvlab.serving, what `kvlab serve-bench` runs): time to
   first token and time per output token, p50 and p99, against throughput, at four request
   rates, paged and contiguous, for two max_batch_tokens; medians of 3 rounds.
5. Preemption by swapping against recompute (benchmarks/bench_swap.py): one sequence of
   64 to 1,024 tokens swapped out and in, or recomputed; and the Engine in both modes.

Runs in about 4 minutes on the 2-core development machine (one core thread by default:
on a shared machine a single thread is far less disturbed by other processes).
"""
from __future__ import annotations

import argparse
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
from common import machine, spread  # noqa: E402  (chapters/figures/common.py puts benchmarks/ on the path)
from bench_engine import workload  # noqa: E402  (the benchmark's own long-tailed requests)
import bench_swap  # noqa: E402  (swapping against recompute, as the benchmark measures it)

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("KVLAB_SHARED", HERE.parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260K"
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def stories15m_shape() -> kvlab.Model:
    """Random weights in the shape of llama2.c's stories15M (15.2 M parameters)."""
    config = kvlab.ModelConfig(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6,
                               vocab_size=32000, max_seq_len=512, name="random stories15M shape")
    return kvlab.Model(config, kvlab.Weights.random(config, seed=0))


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

def throughput_run(model: kvlab.Model, batch: int, new_tokens: int = 8,
                   prompt_len: int = 16) -> dict:
    rng = np.random.default_rng(batch)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 4
    pool = model.new_paged_pool(num_blocks=blocks, block_size=16, max_seqs=batch)
    engine = kvlab.Engine(model, pool, max_batch_tokens=max(256, batch * prompt_len))
    for _ in range(batch):
        prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
        engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
    decode_seconds, weight_bytes, kv_bytes, flops, decode_tokens = [], 0, 0, 0, 0
    start = time.perf_counter()
    while engine.has_work:
        with model.counting() as counts:
            step = engine.step()
        if step.prefill_tokens == 0 and step.decode_tokens:
            decode_seconds.append(step.seconds)
            weight_bytes += counts.weight_bytes
            kv_bytes += counts.kv_read_bytes
            flops += counts.flops
            decode_tokens += step.decode_tokens
    total = time.perf_counter() - start
    return {"decode_tokens_per_s": batch / min(decode_seconds),
            "end_to_end_tokens_per_s": batch * new_tokens / total,
            "weight_bytes_per_token": weight_bytes / decode_tokens,
            "kv_read_bytes_per_token": kv_bytes / decode_tokens,
            "flops_per_token": flops / decode_tokens}


def throughput(models, rounds: int) -> list:
    best = {}
    # round-robin: every size sees the same noise; small models are cheap, so more rounds
    def rounds_for(model):
        return rounds if model.n_params > 5_000_000 else 2 * rounds
    for r in range(2 * rounds):
        for model in [m for m in models if r < rounds_for(m)]:
            throughput_run(model, 1, new_tokens=4)          # warm up (pages, threads)
            for batch in BATCHES:
                row = throughput_run(model, batch)
                key = (model.config.name, batch)
                old = best.get(key)
                if old is None:
                    best[key] = row
                else:
                    for name in ("decode_tokens_per_s", "end_to_end_tokens_per_s"):
                        old[name] = max(old[name], row[name])
    rows = []
    for model in models:
        base = best[(model.config.name, 1)]["decode_tokens_per_s"]
        for batch in BATCHES:
            row = best[(model.config.name, batch)]
            # what a decode step achieved: weight bytes streamed and arithmetic per second
            row["weight_gb_per_s"] = row["decode_tokens_per_s"] * row["weight_bytes_per_token"] / 1e9
            row["gflop_per_s"] = row["decode_tokens_per_s"] * row["flops_per_token"] / 1e9
            rows.append({"model": model.config.name, "rounds": rounds_for(model),
                         "params": model.n_params,
                         "weights_bytes": model.weights_nbytes, "batch": batch,
                         **{k: round(v, 2) for k, v in row.items()},
                         "speedup_vs_batch1": round(row["decode_tokens_per_s"] / base, 2)})
    return rows


# ---- 3. one memory budget: static or continuous, contiguous or paged ---------------------

# The four ways to serve, each (scheduling, memory): the two effects apart and together.
WAYS = (("static", "contiguous"), ("continuous", "contiguous"),
        ("static", "paged"), ("continuous", "paged"))


def serve(model, pool, groups) -> dict:
    """Every request to the end, a group at a time: each group runs until its slowest
    request is done before the next starts (one group of all of them: continuous)."""
    running, made, generated, preemptions = [], [], 0, 0
    start = time.perf_counter()
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
    seconds = time.perf_counter() - start
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


def memory_budget(model: kvlab.Model, n_requests: int = 96, n_static: int = 16,
                  rounds: int = 3) -> dict:
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
    for name, run in results.items():
        run["seconds"] = spread(times[name])
        run["tokens_per_s"] = run["tokens"] / run["seconds"]["median"]
    base = results["static_contiguous"]
    for run in results.values():
        run["steps_vs_static_contiguous"] = base["steps"] / run["steps"]
        run["speedup_vs_static_contiguous"] = base["seconds"]["median"] / run["seconds"]["median"]
    return {"model": model.config.name, "max_len": max_len, "budget_bytes": budget,
            "contiguous_blocks": n_static, "paged_blocks": paged_blocks, "rounds": rounds,
            "requests": n_requests, "tokens": sum(p.max_new_tokens for _, p in requests),
            "mean_new_tokens": float(np.mean([p.max_new_tokens for _, p in requests])),
            "max_new_tokens": max(p.max_new_tokens for _, p in requests), **results}


# ---- 4. latency under a Poisson load: what a user waits for ---------------------------

LATENCY_RATES = (50.0, 100.0, 200.0, 400.0)
LATENCY_BUDGETS = (64, 512)
LATENCY_STATS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                 "e2e_p50_ms", "e2e_p99_ms")


def latency(model, n_requests: int = 60, rounds: int = 3) -> dict:
    """kvlab.serving's sweep (what `kvlab serve-bench` runs): requests arrive as a Poisson
    process at each rate and one Engine serves them in real time, on a paged pool or on
    contiguous caches of the same bytes, with two token budgets (max_batch_tokens). Each
    round runs every configuration once; each statistic is the median over the rounds, with
    its spread."""
    runs = {}
    for round_ in range(rounds):
        rows = kvlab.serving.sweep(model, LATENCY_RATES, LATENCY_BUDGETS, n_requests, seed=0,
                                   out=lambda line: None, memories=("paged", "contiguous"))
        for row in rows:
            runs.setdefault((row["rate"], row["memory"], row["budget"]), []).append(row)
    table = []
    for (rate, memory, budget), rows in runs.items():
        entry = {"rate": rate, "memory": memory, "budget": budget, "requests": n_requests,
                 "steps": spread([r["steps"] for r in rows])}
        for stat in LATENCY_STATS:
            entry[stat] = spread([r[stat] for r in rows])
        table.append(entry)
    return {"rates": list(LATENCY_RATES), "budgets": list(LATENCY_BUDGETS),
            "requests_per_run": n_requests, "rounds": rounds, "runs": table}


def plot_latency(result: dict, path: Path) -> None:
    """kvlab.serving.plot of the medians over the rounds."""
    rows = [{**{k: v for k, v in r.items() if not isinstance(v, dict)},
             **{stat: r[stat]["median"] for stat in LATENCY_STATS}} for r in result["runs"]]
    kvlab.serving.plot(rows, path, title=f"Poisson arrivals, {result['requests_per_run']} "
                                         f"requests a run, medians of {result['rounds']} runs")


# ---- 5. preemption: swapping against recompute ------------------------------------------

def preemption(model, contexts=(64, 256, 1024), rounds: int = 9) -> dict:
    """benchmarks/bench_swap.py's two measurements: one sequence swapped out and in against
    recomputed, for several lengths (the bundled model's context raised to fit); and the
    Engine on a workload too large for its pool, preempting by recompute and by swapping,
    with the same tokens."""
    long = bench_swap.long_context(model, max(contexts) + 1)   # and one more step after
    sequences = [bench_swap.bench_one_sequence(long, n, "fp32", rounds) for n in contexts]
    return {"sequences": sequences, "engine": bench_swap.bench_engine(model, 16, 3)}


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

def plot_throughput(rows, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        b = [r["batch"] for r in mine]
        left.plot(b, [r["decode_tokens_per_s"] for r in mine], "o-", label=name)
        if name.startswith("random"):
            right.plot(b, [r["weight_bytes_per_token"] / 1e6 for r in mine], "o-",
                       label="weights read per token")
            right.plot(b, [r["kv_read_bytes_per_token"] / 1e6 for r in mine], "s--",
                       label="K/V read per token (contexts of 17 to 23 tokens)")
            right.set_title(f"{name}: bytes per generated token\n(counted by the core)",
                            fontsize=10)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("requests decoded together (batch size)")
    left.set_ylabel("decode tokens/s")
    left.set_title("Decode throughput of kvlab.Engine", fontsize=10)
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


WAY_LABELS = {"static_contiguous": "static, contiguous", "continuous_contiguous": "continuous, contiguous",
              "static_paged": "static, paged", "continuous_paged": "continuous, paged"}


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
                   f"{budget['budget_bytes'] / 2**20:.0f} MiB ({budget['model']})", fontsize=10)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kvlab.set_num_threads(args.threads)
    started = time.perf_counter()

    model = kvlab.load()
    models = [model]
    stories = None
    if (STORIES / "stories260K.bin").exists():
        stories = kvlab.load(STORIES / "stories260K.bin", tokenizer=STORIES / "tok512.bin")
        models.append(stories)
    else:
        print(f"({STORIES} not found: stories260K skipped)")
    models.append(stories15m_shape())

    equal = equality_check(model)
    print("engine vs generate:", equal)
    rows = throughput(models, args.rounds)
    for r in rows:
        print(f"{r['model']:<26}{r['batch']:>4}{r['decode_tokens_per_s']:>10,.0f} tok/s"
              f"{r['speedup_vs_batch1']:>7.2f}x  weights {r['weight_bytes_per_token']:>12,.0f}"
              f" B/token  K/V {r['kv_read_bytes_per_token']:>9,.0f} B/token"
              f"  {r['weight_gb_per_s']:5.2f} GB/s {r['gflop_per_s']:5.1f} GFLOP/s")
    budget = memory_budget(model)
    # the same four ways on a model whose weights do not fit in the CPU's caches
    budget_15m = memory_budget(models[-1], rounds=3)
    for name in WAY_LABELS:
        r = budget_15m[name]
        print(f"{budget_15m['model']}, {name}: {r['steps']} steps, {r['seconds']['median']:.2f} s")
        del r["running_per_step"], r["tokens_so_far"]
    for name in WAY_LABELS:
        r = budget[name]
        print(f"{name}: {r['steps']} steps, running peak {r['peak_running']} mean "
              f"{r['mean_running']:.1f}, {r['seconds']['median']:.2f} s, "
              f"{r['tokens_per_s']:,.0f} tok/s, "
              f"{r['flops'] / 1e9:.1f} GFLOP, weights {r['weight_bytes'] / 1e9:.2f} GB, "
              f"K/V {r['kv_read_bytes'] / 1e9:.2f} GB, {r['tokens_run']:,} tokens run")

    served = latency(model)
    for r in served["runs"]:
        print(f"{r['rate']:>6g}/s {r['memory']:>10} {r['budget']:>4}: "
              f"{r['tokens_per_s']['median']:7.0f} tok/s  TTFT p50 {r['ttft_p50_ms']['median']:7.1f}"
              f" p99 {r['ttft_p99_ms']['median']:7.1f}  TPOT p50 {r['tpot_p50_ms']['median']:5.2f}"
              f" p99 {r['tpot_p99_ms']['median']:5.2f} ms")

    preempt = preemption(model)
    for r in preempt["sequences"]:
        print(f"{r['tokens']:>5} tokens: swap {1e6 * r['swap_s']:7.0f} us, recompute "
              f"{1e3 * r['recompute_s']:7.2f} ms: {r['recompute_over_swap']:.0f}x")
    for r in preempt["engine"]["runs"]:
        print(f"engine, {r['preemption']:>9}: {r['seconds']:.2f} s, {r['preemptions']} preemptions, "
              f"{r['recomputed_tokens']} tokens recomputed, {r['swapped_out_bytes']:,} B swapped out")

    plot_throughput(rows, out / "ch05_throughput.png")
    plot_latency(served, out / "ch05_latency.png")
    plot_budget(budget, out / "ch05_budget.png")

    for name in WAY_LABELS:                  # the figure's data, not quoted: kept out
        del budget[name]["running_per_step"], budget[name]["tokens_so_far"]
    result = {
        "setup": {**machine(), "threads": kvlab.get_num_threads(),
                  "machine": platform.machine(), "python": platform.python_version(),
                  "models": {m.config.name: {"params": m.n_params, "weights_bytes": m.weights_nbytes,
                                             "n_layers": m.config.n_layers,
                                             "n_kv_heads": m.config.n_kv_heads,
                                             "head_dim": m.config.head_dim}
                             for m in models},
                  "throughput_workload": "B requests, 16-token random prompts, 8 new tokens, "
                                         "greedy; decode tok/s = B / fastest decode step time, "
                                         f"best of {args.rounds} round-robin rounds ({2 * args.rounds} "
                                         "for the models under 5 M parameters)",
                  "seconds": None},
        "llama2_7b_arithmetic": llama2_7b_arithmetic(),
        "equality": equal,
        "throughput": rows,
        "memory_budget": budget,
        "memory_budget_15m": budget_15m,
        "latency": served,
        "preemption": preempt,
    }
    result["setup"]["seconds"] = round(time.perf_counter() - started, 1)
    (out / "ch05.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out} in {result['setup']['seconds']} s")


if __name__ == "__main__":
    main()
