"""CPU speed: kvlab against the memory system, Hugging Face transformers and kvlab.reference.

In one run, on the same weights and the same thread count:
  1. the machine's roofs: memory read bandwidth measured by the core's own threads
     (kvlab.measure.memory_bandwidth: a read-only sum and STREAM's triad), and NumPy's
     float32 matrix product as the arithmetic roof;
  2. decode and prefill tokens/s of kvlab, transformers eager (torch CPU) and kvlab.reference
     on the bundled model, stories260K (if ../shared/models is present), and random weights
     in llama2.c format shaped like stories15M and stories110M. kvlab's decode is timed in
     several windows, each right after a bandwidth measurement, and its effective bandwidth
     (bytes a decode step reads x tokens/s) is a fraction of the bandwidth measured next to
     it: the median over the windows is reported, so one noisy moment of a shared machine
     moves neither figure much;
  3. the ceiling of prefill/decode on this machine: prefill at the arithmetic roof against
     decode at the bandwidth roof, (roof FLOP/s / prefill FLOPs per token) / (read bandwidth
     / bytes per decode step);
  4. decode attention alone (one layer: 32 query heads, 8 KV heads of head_dim 128) from 1K
     to 64K tokens of context, as bytes of K/V read per second against the bandwidth
     measured just before; copies of the cache are cycled through so that every call reads
     from memory, not from the L3 cache. Beside it, the same walk through K and V with no
     arithmetic (kvlab.measure.attention_walk_bandwidth): the ceiling of that access
     pattern, which reads less than the probe's eight runs side by side.

    python benchmarks/bench_cpu.py [--threads N] [--windows 5] [--window-tokens 16]
                                   [--prefill-tokens 256] [--skip-transformers] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from statistics import median
from pathlib import Path

import numpy as np

import kvlab
from kvlab import measure, reference
from kvlab.loaders.huggingface import save_hf_llama
from kvlab.loaders.llama2c import save_llama2c_v1

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVLAB_SHARED", REPO.parent / "shared"))
N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128      # one layer of Llama 3 8B, for attention alone
SHAPES = {
    "stories15M shape": dict(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6),
    "stories110M shape": dict(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12),
}


def models(workdir: Path):
    """(name, kvlab model) pairs; random shapes are written as llama2.c files and loaded
    back (memory-mapped, as a real checkpoint would be)."""
    yield "shakespeare-1m (default)", kvlab.load()
    stories = SHARED / "models" / "stories260K"
    if (stories / "stories260K.bin").is_file():
        yield "stories260K", kvlab.load(stories / "stories260K.bin", stories / "tok512.bin")
    for name, shape in SHAPES.items():
        config = kvlab.ModelConfig(vocab_size=32000, max_seq_len=1024, name=name, **shape)
        path = workdir / (name.split()[0] + ".bin")
        save_llama2c_v1(path, config, kvlab.Weights.random(config, seed=0))
        yield name, kvlab.load(path)


def best_of(repeats, run):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    """Bytes/s a plain read gets from memory now (arrays of 256 MiB, best of 3 passes)."""
    return measure.memory_bandwidth(1 << 28, 3)["read_bytes_per_s"]


def numpy_matmul_flops() -> float:
    """FLOP/s of NumPy's float32 1024 x 1024 matrix product (OpenBLAS, every core): the
    arithmetic roof this machine offers to a well-tuned library."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a
    return 2 * 1024 ** 3 / best_of(5, lambda: a @ a)


PROMPT_START = 16   # decode is timed after a prefill of this many prompt tokens


def decode_cache_length(windows, window_tokens):
    """Positions kvlab_speed's cache holds at the end: the prompt's start, then per window
    4 untimed steps and window_tokens timed ones."""
    return PROMPT_START + windows * (4 + window_tokens)


def kvlab_speed(model, prompt, windows, window_tokens):
    """Seconds per prefill token (best of 3), and for each decode window (seconds per
    token, read bandwidth measured just before it)."""
    # torch's and OpenBLAS's worker threads spin for a while after their last call; on a
    # two-core machine they would steal kvlab's cores, so let them go to sleep first
    time.sleep(1.0)

    def prefill():
        model.prefill(prompt, model.new_cache(len(prompt) + 1))
    prefill_s = best_of(3, prefill) / len(prompt)
    cache = model.new_cache(decode_cache_length(windows, window_tokens))
    model.prefill(prompt[:PROMPT_START], cache)
    token = int(prompt[PROMPT_START])
    samples = []
    for _ in range(windows):
        bandwidth = read_bandwidth()
        # untimed steps first: the probe evicted the weights from the caches (which a
        # small model's decode would otherwise read from there) and the first passes
        # map the checkpoint's pages
        token = int(model.decode_steps(token, cache, 4)[0][-1])
        # greedy steps with the token loop in C, as kvlab.generate runs them
        start = time.perf_counter()
        token = int(model.decode_steps(token, cache, window_tokens)[0][-1])
        samples.append(((time.perf_counter() - start) / window_tokens, bandwidth))
    return prefill_s, samples


def reference_speed(model, prompt, n_decode):
    config, weights = model.config, model.weights
    prefill_s = best_of(1, lambda: reference.forward(config, weights, prompt)) / len(prompt)
    cache = reference.ReferenceCache(config, PROMPT_START + n_decode)
    reference.forward(config, weights, prompt[:PROMPT_START], cache)
    start = time.perf_counter()
    token = int(prompt[PROMPT_START])
    for _ in range(n_decode):
        token = int(np.argmax(reference.forward(config, weights, [token], cache)[-1]))
    return prefill_s, (time.perf_counter() - start) / n_decode


def transformers_speed(model, prompt, n_decode, workdir: Path):
    import torch
    import transformers
    folder = workdir / "hf"
    save_hf_llama(folder, model.config, model.weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        prefill_s = best_of(3, lambda: hf(ids, use_cache=False)) / len(prompt)
        out = hf(ids[:, :PROMPT_START], use_cache=True)
        past, token = out.past_key_values, torch.tensor([[int(prompt[PROMPT_START])]])
        for _ in range(4):        # warm up, as for kvlab
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(n_decode):
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = (time.perf_counter() - start) / n_decode
    return prefill_s, decode_s


def filled_cache(context, dtype, rows):
    """One layer's cache holding `context` positions of `rows`, stored as `dtype`."""
    cache = kvlab.KVCache(1, N_KV_HEADS, HEAD_DIM, context, key_format=dtype, value_format=dtype)
    for first in range(0, context, 4096):
        n = min(4096, context - first)
        cache.append(rows[first:first + n], rows[len(rows) - first - n:len(rows) - first])
    return cache


def time_attend(context, dtype, rows, q):
    """Best time of one cache.attend over `context` positions, and the bytes it reads.
    Enough copies of the cache are cycled through (64 MiB at least, twice the L3 cache)
    that each call reads its K and V from memory, not from a cache level where the
    previous call left them."""
    first = filled_cache(context, dtype, rows)
    copies = [first] + [filled_cache(context, dtype, rows)
                        for _ in range(-(-(64 << 20) // first.nbytes) - 1)]
    calls = max(16, 3 * len(copies))
    best = float("inf")
    for i in range(calls):
        cache = copies[i % len(copies)]
        start = time.perf_counter()
        cache.attend(q)
        best = min(best, time.perf_counter() - start)
    return best, first.nbytes


def attention_rows(contexts, rounds=3):
    """Per context, `rounds` rounds of: the read bandwidth, attention's walk alone, then
    attention itself, one right after the other; the medians of each figure and share."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((N_HEADS, HEAD_DIM), dtype=np.float32)
    kv_rows = rng.standard_normal((max(contexts), 1, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
    rows = []
    for context in contexts:
        samples = []
        for _ in range(rounds):
            bandwidth = read_bandwidth()
            walk = measure.attention_walk_bandwidth(context, N_KV_HEADS, HEAD_DIM)
            seconds, nbytes = time_attend(context, "fp32", kv_rows, q)
            samples.append((seconds, nbytes / seconds, bandwidth, walk))
        seconds, rate, bandwidth, walk = (median(column) for column in zip(*samples))
        rows.append({"context": context, "rounds": rounds, "seconds": seconds,
                     "bytes_per_s": rate, "read_bytes_per_s": bandwidth,
                     "fraction_of_read_bw": median([r / b for _, r, b, _ in samples]),
                     "walk_bytes_per_s": walk,
                     "fraction_of_walk": median([r / w for _, r, _, w in samples]),
                     "walk_fraction_of_read_bw": median([w / b for _, _, b, w in samples])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--windows", type=int, default=5, help="decode windows timed per model")
    parser.add_argument("--window-tokens", type=int, default=16, help="decode steps per window")
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "cpu.json"))
    args = parser.parse_args()
    if args.threads:
        kvlab.set_num_threads(args.threads)
    threads = kvlab.get_num_threads()
    if not args.skip_transformers:
        import torch
        torch.set_num_threads(threads)

    bandwidth = measure.memory_bandwidth(1 << 28, 5)
    matmul_flops = numpy_matmul_flops()
    print(f"{os.cpu_count()} cores, {threads} threads; memory read "
          f"{bandwidth['read_bytes_per_s'] / 1e9:.2f} GB/s, STREAM triad "
          f"{bandwidth['triad_bytes_per_s'] / 1e9:.2f} GB/s; NumPy float32 matrix product "
          f"{matmul_flops / 1e9:.0f} GFLOP/s\n")
    print(f"{'model':<26}{'':<19}{'decode tok/s':>13}{'prefill tok/s':>14}"
          f"{'prefill/decode':>15}{'(ceiling)':>10}{'read bw used':>13}")
    n_decode = args.windows * args.window_tokens
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, model in models(workdir):
            c = model.config
            prompt = np.random.default_rng(1).integers(0, c.vocab_size, args.prefill_tokens).tolist()
            # what a decode step reads (every weight once, the classifier included, and the
            # cache at its middle length), and a prefill's arithmetic per token
            middle = (PROMPT_START + decode_cache_length(args.windows, args.window_tokens)) // 2
            step_bytes = measure.forward_counts(c, 1, middle).bytes_moved
            prefill_flops = measure.forward_counts(c, len(prompt)).flops / len(prompt)
            row = {"model": name, "params": c.n_params(), "step_bytes": step_bytes,
                   "prefill_flops_per_token": prefill_flops}

            prefill_s, samples = kvlab_speed(model, prompt, args.windows, args.window_tokens)
            decode_s = median([seconds for seconds, _ in samples])
            used = median([step_bytes / seconds / bw for seconds, bw in samples])
            window_bw = median([bw for _, bw in samples])
            ceiling = (matmul_flops / prefill_flops) / (window_bw / step_bytes)
            row["kvlab"] = {"decode_tokens_per_s": 1 / decode_s, "prefill_tokens_per_s": 1 / prefill_s,
                            "read_bandwidth_fraction": used, "read_bytes_per_s": window_bw,
                            "prefill_decode_ceiling": ceiling,
                            "windows": [{"seconds_per_token": s_, "read_bytes_per_s": b_}
                                        for s_, b_ in samples]}
            print(f"{name:<26}{'kvlab':<19}{1 / decode_s:>13,.1f}{1 / prefill_s:>14,.1f}"
                  f"{decode_s / prefill_s:>14.1f}x{ceiling:>9.1f}x{100 * used:>12.0f}%")

            others = {"kvlab.reference": lambda: reference_speed(model, prompt[:64],
                                                                 max(4, n_decode // 4))}
            if not args.skip_transformers:
                others["transformers eager"] = lambda: transformers_speed(model, prompt, n_decode,
                                                                         workdir)
            for engine, run in others.items():
                prefill_s, decode_s = run()
                row[engine] = {"decode_tokens_per_s": 1 / decode_s,
                               "prefill_tokens_per_s": 1 / prefill_s}
                print(f"{'':<26}{engine:<19}{1 / decode_s:>13,.1f}{1 / prefill_s:>14,.1f}"
                      f"{decode_s / prefill_s:>14.1f}x")
            if "transformers eager" in row:
                row["kvlab_vs_transformers_decode"] = (row["kvlab"]["decode_tokens_per_s"]
                                                       / row["transformers eager"]["decode_tokens_per_s"])
            results.append(row)

    contexts = [int(x) for x in args.contexts.split(",")]
    attention = attention_rows(contexts)
    print(f"\ndecode attention alone ({N_HEADS} heads, {N_KV_HEADS} KV heads x {HEAD_DIM}, fp32), "
          "K and V read once per call, each call from memory; medians of 3 rounds")
    print(f"{'context':>8}{'ms':>9}{'GB/s':>8}{'read bw':>9}{'share':>8}"
          f"{'walk only':>11}{'share':>8}")
    for row in attention:
        print(f"{row['context']:>8}{1e3 * row['seconds']:>9.2f}{row['bytes_per_s'] / 1e9:>8.2f}"
              f"{row['read_bytes_per_s'] / 1e9:>9.2f}{100 * row['fraction_of_read_bw']:>7.0f}%"
              f"{row['walk_bytes_per_s'] / 1e9:>11.2f}{100 * row['fraction_of_walk']:>7.0f}%")

    targets = target_check(results, attention)
    print("\nissue 7's targets")
    for line in targets:
        print(f"  {line['target']:<58} {line['measured']:>8}  {'met' if line['met'] else 'not met'}")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": os.cpu_count(), "threads": threads,
                               "bandwidth": bandwidth, "numpy_matmul_flops_per_s": matmul_flops,
                               "models": results, "attention": attention, "targets": targets},
                              indent=2))
    print(f"\nwrote {out}")


def target_check(results, attention):
    """The issue's targets against this run's figures (those it has the rows for)."""
    by_name = {row["model"]: row for row in results}
    lines = []
    big, small = by_name.get("stories110M shape"), by_name.get("stories15M shape")
    if big:
        used = big["kvlab"]["read_bandwidth_fraction"]
        lines.append({"target": "decode, 110M shape: >= 85 % of read bandwidth",
                      "measured": f"{100 * used:.0f} %", "met": used >= 0.85})
        ratio = big["kvlab"]["prefill_tokens_per_s"] / big["kvlab"]["decode_tokens_per_s"]
        lines.append({"target": "prefill >= 20x decode per token, 110M shape "
                                f"(ceiling here {big['kvlab']['prefill_decode_ceiling']:.0f}x)",
                      "measured": f"{ratio:.1f}x", "met": ratio >= 20})
    long = [row for row in attention if row["context"] >= 16384]
    if long:
        share = min(row["fraction_of_read_bw"] for row in long)
        walk = min(row["walk_fraction_of_read_bw"] for row in long)
        lines.append({"target": "decode attention, 16K+ context: >= 85 % of read bandwidth "
                                f"(its walk alone reads {100 * walk:.0f} %)",
                      "measured": f"{100 * share:.0f} %", "met": share >= 0.85})
    if small and "kvlab_vs_transformers_decode" in small:
        speedup = small["kvlab_vs_transformers_decode"]
        lines.append({"target": "decode, 15M shape: >= 5x transformers eager",
                      "measured": f"{speedup:.1f}x", "met": speedup >= 5})
    return lines


if __name__ == "__main__":
    main()
