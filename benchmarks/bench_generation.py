"""Generation speed: kvlab's C core with and without the KV cache, against kvlab.reference.

For each model (the bundled default, and stories260K when ../shared/models has it) it
generates N tokens greedily four ways, side by side in one run:
  C cached, C uncached, NumPy reference cached, NumPy reference uncached
and prints tokens/s plus the ratios (uncached/cached time, reference/C time). Timing on
a shared machine is noisy: compare the ratios, which are measured in the same run.

    python benchmarks/bench_generation.py [--tokens 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab import reference

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"


def reference_generate(model, prompt_ids, n_new, use_cache):
    """Greedy generation with the NumPy reference forward pass; returns (tokens, seconds)."""
    ids, new = list(prompt_ids), []
    start = time.perf_counter()
    cache = reference.ReferenceCache(model.config, len(ids) + n_new) if use_cache else None
    logits = reference.forward(model.config, model.weights, ids, cache)[-1]
    for _ in range(n_new):
        token = int(np.argmax(logits))
        new.append(token)
        if len(new) == n_new:
            break
        if use_cache:
            logits = reference.forward(model.config, model.weights, [token], cache)[-1]
        else:
            logits = reference.forward(model.config, model.weights, ids + new)[-1]
    return new, time.perf_counter() - start


def bench_model(label, model, prompt, n_new, repeats):
    ids = model.encode(prompt)
    kvlab.generate(model, ids, 4)   # warm up
    rows = {}
    for use_cache in (True, False):
        best = min((kvlab.generate(model, ids, n_new, use_cache=use_cache, stop_at_eos=False)
                    for _ in range(repeats)), key=lambda g: g.seconds)
        rows["c_cached" if use_cache else "c_uncached"] = (best.tokens, best.seconds)
    for use_cache in (True, False):
        rows["ref_cached" if use_cache else "ref_uncached"] = reference_generate(
            model, ids, n_new, use_cache)
    result = {"model": label, "params": model.n_params, "new_tokens": n_new,
              "prompt_tokens": len(ids), "threads": kvlab.get_num_threads()}
    for key, (tokens, seconds) in rows.items():
        result[f"{key}_seconds"] = seconds
        result[f"{key}_tokens_per_s"] = len(tokens) / seconds
    result["same_tokens_c_cached_vs_uncached"] = rows["c_cached"][0] == rows["c_uncached"][0]
    result["same_tokens_c_vs_reference"] = rows["c_cached"][0] == rows["ref_cached"][0]
    result["cache_speedup_c"] = rows["c_uncached"][1] / rows["c_cached"][1]
    result["cache_speedup_reference"] = rows["ref_uncached"][1] / rows["ref_cached"][1]
    result["c_over_reference_cached"] = rows["ref_cached"][1] / rows["c_cached"][1]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/generation.json")
    args = parser.parse_args()

    models = [("default (shakespeare-1m)", kvlab.load(), "ROMEO:\n")]
    if (SHARED / "stories260K" / "stories260K.bin").exists():
        models.append(("stories260K", kvlab.load(SHARED / "stories260K" / "stories260K.bin",
                                                 tokenizer=SHARED / "stories260K" / "tok512.bin"),
                       "Once upon a time"))
    results = [bench_model(label, m, prompt, args.tokens, args.repeats)
               for label, m, prompt in models]

    header = (f"{'model':26}{'C cached':>11}{'C uncached':>12}{'ref cached':>12}"
              f"{'ref uncached':>14}{'cache x (C)':>13}{'C/ref x':>9}{'same':>6}")
    print(f"tokens/s, {args.tokens} new tokens, greedy, {kvlab.get_num_threads()} threads")
    print(header)
    for r in results:
        print(f"{r['model']:26}{r['c_cached_tokens_per_s']:>11,.0f}{r['c_uncached_tokens_per_s']:>12,.0f}"
              f"{r['ref_cached_tokens_per_s']:>12,.0f}{r['ref_uncached_tokens_per_s']:>14,.1f}"
              f"{r['cache_speedup_c']:>12.1f}x{r['c_over_reference_cached']:>8.1f}x"
              f"{'yes' if r['same_tokens_c_cached_vs_uncached'] else 'NO':>6}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
