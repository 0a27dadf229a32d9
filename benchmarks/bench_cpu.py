"""CPU speed: kvlab against the memory system, Hugging Face transformers and kvlab.reference.

In one run, on the same weights and the same thread count:
  1. memory bandwidth, measured by the core's own threads: a read-only sum and STREAM's
     triad (kvlab._kvlab.memory_bandwidth);
  2. decode and prefill tokens/s of kvlab, transformers eager (torch CPU) and kvlab.reference
     on the bundled model, stories260K (if ../shared/models is present), and random weights
     in llama2.c format shaped like stories15M and stories110M; kvlab's effective bandwidth
     (weight and KV bytes read per token x tokens/s) as a fraction of the measured read
     bandwidth;
  3. decode attention alone (one layer: 32 query heads, 8 KV heads of head_dim 128) from 1K
     to 64K tokens of context, as bytes of K/V read per second against the same bandwidth.

    python benchmarks/bench_cpu.py [--threads N] [--decode-tokens 32] [--prefill-tokens 256]
                                   [--skip-transformers] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab import reference
from kvlab._core import core
from kvlab.loaders.huggingface import save_hf_llama
from kvlab.loaders.llama2c import save_llama2c_v1

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVLAB_SHARED", REPO.parent / "shared"))
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


def kvlab_speed(model, prompt, n_decode):
    # torch's and OpenBLAS's worker threads spin for a while after their last call; on a
    # two-core machine they would steal kvlab's cores, so let them go to sleep first
    time.sleep(1.0)

    def prefill():
        model.prefill(prompt, model.new_cache(len(prompt) + 1))
    prefill_s = best_of(3, prefill) / len(prompt)
    cache = model.new_cache(16 + 4 + n_decode)
    model.prefill(prompt[:16], cache)
    token = int(prompt[16])
    for _ in range(4):            # first passes map the checkpoint's pages: not timed
        token = int(np.argmax(model.decode(token, cache)))
    start = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(model.decode(token, cache)))
    return prefill_s, (time.perf_counter() - start) / n_decode


def reference_speed(model, prompt, n_decode):
    config, weights = model.config, model.weights
    prefill_s = best_of(1, lambda: reference.forward(config, weights, prompt)) / len(prompt)
    cache = reference.ReferenceCache(config, 16 + n_decode)
    reference.forward(config, weights, prompt[:16], cache)
    start = time.perf_counter()
    token = int(prompt[16])
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
        out = hf(ids[:, :16], use_cache=True)
        past, token = out.past_key_values, torch.tensor([[int(prompt[16])]])
        for _ in range(4):        # warm up, as for kvlab
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(n_decode):
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = (time.perf_counter() - start) / n_decode
    return prefill_s, decode_s


def attention_rows(read_bw, contexts):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((32, 128), dtype=np.float32)
    rows = []
    for context in contexts:
        cache = kvlab.KVCache(1, 8, 128, context)
        block = 4096
        for first in range(0, context, block):
            n = min(block, context - first)
            rows_k = rng.standard_normal((n, 1, 8, 128), dtype=np.float32)
            cache.append(rows_k, rows_k)
        seconds = best_of(5, lambda: cache.attend(q))
        bytes_read = cache.nbytes
        rows.append({"context": context, "seconds": seconds, "bytes_per_s": bytes_read / seconds,
                     "fraction_of_read_bw": bytes_read / seconds / read_bw})
        del cache
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--decode-tokens", type=int, default=64)
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

    bandwidth = core.memory_bandwidth(1 << 29, 5)
    read_bw = bandwidth["read_bytes_per_s"]
    print(f"{os.cpu_count()} cores, {threads} threads; memory read {read_bw / 1e9:.2f} GB/s, "
          f"STREAM triad {bandwidth['triad_bytes_per_s'] / 1e9:.2f} GB/s\n")
    header = (f"{'model':<26}{'':<14}{'decode tok/s':>13}{'prefill tok/s':>14}"
              f"{'prefill/decode':>15}{'read bw used':>13}")
    print(header)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, model in models(workdir):
            c = model.config
            prompt = np.random.default_rng(1).integers(0, c.vocab_size, args.prefill_tokens).tolist()
            n_decode = args.decode_tokens
            engines = {"kvlab": lambda: kvlab_speed(model, prompt, n_decode),
                       "kvlab.reference": lambda: reference_speed(model, prompt[:64],
                                                                  max(4, n_decode // 4))}
            if not args.skip_transformers:
                engines["transformers eager"] = lambda: transformers_speed(model, prompt, n_decode,
                                                                          workdir)
            # bytes a decode step reads: every weight once (the classifier included) and the
            # cache so far (16 to 16 + n_decode positions, about 16 + n_decode / 2)
            kv_bytes = kvlab.kv_bytes_per_token(c, "fp32") * (20 + n_decode // 2)
            step_bytes = model.weights_nbytes + kv_bytes
            row = {"model": name, "params": c.n_params(), "step_bytes": step_bytes}
            for engine, run in engines.items():
                prefill_s, decode_s = run()
                row[engine] = {"decode_tokens_per_s": 1 / decode_s,
                               "prefill_tokens_per_s": 1 / prefill_s}
                used = step_bytes / decode_s / read_bw
                print(f"{name if engine == 'kvlab' else '':<26}{engine:<14}{1 / decode_s:>13,.1f}"
                      f"{1 / prefill_s:>14,.1f}{decode_s / prefill_s:>14.1f}x"
                      + (f"{100 * used:>12.0f}%" if engine == "kvlab" else ""))
            row["kvlab"]["read_bandwidth_fraction"] = step_bytes * row["kvlab"]["decode_tokens_per_s"] / read_bw
            if "transformers eager" in row:
                row["kvlab_vs_transformers_decode"] = (row["kvlab"]["decode_tokens_per_s"]
                                                       / row["transformers eager"]["decode_tokens_per_s"])
            results.append(row)

    contexts = [int(x) for x in args.contexts.split(",")]
    attention = attention_rows(read_bw, contexts)
    print("\ndecode attention alone (32 heads, 8 KV heads x 128, fp32), K and V read once per step")
    print(f"{'context':>8}{'ms':>9}{'GB/s':>8}{'of read bw':>12}")
    for row in attention:
        print(f"{row['context']:>8}{1e3 * row['seconds']:>9.2f}{row['bytes_per_s'] / 1e9:>8.2f}"
              f"{100 * row['fraction_of_read_bw']:>11.0f}%")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": os.cpu_count(), "threads": threads,
                               "bandwidth": bandwidth, "models": results,
                               "attention": attention}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
