"""kvlab against llama.cpp on the same GGUF files in CPU seconds on one thread (issue 37).

    python benchmarks/bench_llama_cpu.py --llama-dir LLAMA_CPP/build/bin --gguf DIR
                                         [--rounds 3] [--parts prefill,batch] [--json out.json]

On a machine shared with other jobs, tokens per wall second measure the neighbours as much
as the engine (issue 37's two-thread figures moved by 1.5x between runs). This compares
the two engines by the CPU time their work takes on one thread, which the neighbours move
far less:
  * kvlab: time.process_time around the work alone (the model already loaded);
  * llama.cpp: the CPU time (user + system, from the child's rusage) of one llama-bench or
    llama-batched-bench run with more work less that of the same run with less work, so
    that loading the model and warming up cancel out.
What is timed:
  * prefill: a 256-token prompt on llama2.c's stories15M and stories110M shapes (random
    weights, seed 0, as benchmarks/bench_weights.py makes them), written to DIR as F32 and
    Q8_0 GGUF files and loaded by both engines (kvlab runs Q8_0 with int8 activations, its
    default, and with float32 activations);
  * batch: SmolLM2-135M (the course's Q4_1 file, kvlab.fetch("smollm2-135m"), requantized
    to Q8_0 by kvlab and written to DIR so that both engines read the same bytes) decoding
    batches of 1, 4 and 16 sequences after 16-token prompts; kvlab's forward_batch steps
    against llama-batched-bench's generation phase (-npp 16, the steps' CPU time from two
    runs of -ntg 16 and -ntg 48).
llama.cpp is built by hand from a source package (not part of CI); the benchmark needs
its llama-bench and llama-batched-bench in --llama-dir. --no-repack runs llama.cpp without
its repacked weights (--repack 0, --no-repack), which on a CPU with AMX are its AMX
kernels: on the development VM (a Sapphire Rapids guest) those crashed with SIGSEGV in
ggml_backend_amx_mul_mat on every Q8_0 file, so its figures there are without them.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvlab
from kvlab.loaders import save_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from products_timing import BATCHES, STEPS, batch_decode_seconds  # noqa: E402

SHAPES = {   # llama2.c's stories models: dim, hidden_dim, n_layers, n_heads (vocab 32,000)
    "15m": (288, 768, 6, 6),
    "110m": (768, 2048, 12, 12),
}
PROMPT = 256
LLAMA_STEPS = (16, 48)   # llama-batched-bench's two runs: the difference is 32 steps


def run_cpu_seconds(command: list) -> float:
    """user + system CPU seconds of one run of command, read from the process's children
    totals before and after (the run is the only child in between)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def llama_prefill_cpu(args, path: Path, reps: int = 4) -> float:
    """CPU seconds of one 256-token prefill by llama-bench on one thread."""
    bench = str(args.llama_dir / "llama-bench")
    base = [bench, "-m", str(path), "-t", "1", "-p", str(PROMPT), "-n", "0"]
    base += ["--repack", "0"] if args.no_repack else []
    more = run_cpu_seconds(base + ["-r", str(1 + reps)])
    less = run_cpu_seconds(base + ["-r", "1"])
    return (more - less) / reps


def llama_batch_cpu(args, path: Path, batch: int) -> float:
    """CPU seconds of one decode step of `batch` sequences by llama-batched-bench, one thread."""
    bench = str(args.llama_dir / "llama-batched-bench")
    seconds = []
    for steps in LLAMA_STEPS:
        seconds.append(run_cpu_seconds([bench, "-m", str(path), "-t", "1", "-tb", "1",
                                        "-c", str(batch * (16 + max(LLAMA_STEPS)) + 64),
                                        "-npp", "16", "-ntg", str(steps), "-npl", str(batch)]
                                       + (["--no-repack"] if args.no_repack else [])))
    return (seconds[1] - seconds[0]) / (LLAMA_STEPS[1] - LLAMA_STEPS[0])


def kvlab_prefill_cpu(model) -> float:
    tokens = (np.arange(PROMPT, dtype=np.int32) * 7919 + 1) % model.config.vocab_size
    cache = model.new_cache(PROMPT)
    start = time.process_time()
    model.prefill(tokens, cache)
    return time.process_time() - start


def kvlab_batch_cpu(model, batch: int) -> float:
    """CPU seconds of one forward_batch decode step of `batch` sequences (16-token prompts)."""
    return batch_decode_seconds(model, batch) / STEPS


def prefill_files(folder: Path) -> dict:
    """{shape: {"f32": path, "q8_0": path}}: the random weights written once."""
    files = {}
    for shape, (dim, hidden, n_layers, n_heads) in SHAPES.items():
        config = kvlab.ModelConfig(dim=dim, hidden_dim=hidden, n_layers=n_layers,
                                   n_heads=n_heads, n_kv_heads=n_heads, vocab_size=32000,
                                   max_seq_len=1024, name=f"random {shape}")
        weights = kvlab.Weights.random(config, seed=0, scale=0.05)
        files[shape] = {}
        for fmt, ggml in (("fp32", "f32"), ("q8_0", "q8_0")):
            path = folder / f"random-{shape}-{ggml}.gguf"
            if not path.exists():
                save_gguf(path, config, weights.converted(fmt), placeholder_vocabulary=True)
            files[shape][ggml] = path
    return files


def smollm2_file(folder: Path) -> Path:
    path = folder / "smollm2-135m-q8_0.gguf"
    if not path.exists():
        model = kvlab.load(kvlab.fetch("smollm2-135m"), weights="q8_0")
        save_gguf(path, model.config, model.weights, placeholder_vocabulary=True,
                  name="SmolLM2-135M requantized to Q8_0 by kvlab")
    return path


def compare_prefill(args, folder: Path) -> list:
    rows = []
    for shape, files in prefill_files(folder).items():
        for ggml, path in files.items():
            variants = {"": kvlab.load(path)}
            if ggml == "q8_0":
                variants[" x fp32 activations"] = kvlab.load(path, activations="fp32")
            llama = min(llama_prefill_cpu(args, path) for _ in range(args.rounds))
            for suffix, model in variants.items():
                kvlab_prefill_cpu(model)   # the first pass touches the weights' pages
                ours = min(kvlab_prefill_cpu(model) for _ in range(args.rounds))
                rows.append({"file": path.name, "variant": ggml + suffix,
                             "activations": model.activations,
                             "kvlab_tok_per_cpu_s": PROMPT / ours,
                             "llama_cpp_tok_per_cpu_s": PROMPT / llama,
                             "ratio": llama / ours})
                print(f"prefill {PROMPT} {shape:>4} {ggml + suffix:<24} kvlab {PROMPT / ours:8.1f} "
                      f"llama.cpp {PROMPT / llama:8.1f} tok per CPU s ({llama / ours:.2f}x)",
                      flush=True)
    return rows


def compare_batches(args, folder: Path) -> list:
    path = smollm2_file(folder)
    model = kvlab.load(path)
    kvlab_batch_cpu(model, 1)
    rows = []
    for batch in BATCHES:
        ours = min(kvlab_batch_cpu(model, batch) for _ in range(args.rounds))
        llama = min(llama_batch_cpu(args, path, batch) for _ in range(args.rounds))
        rows.append({"file": path.name, "batch": batch, "kvlab_tok_per_cpu_s": batch / ours,
                     "llama_cpp_tok_per_cpu_s": batch / llama, "ratio": llama / ours})
        print(f"decode batch {batch:>2} (Q8_0 SmolLM2) kvlab {batch / ours:8.1f} llama.cpp "
              f"{batch / llama:8.1f} tok per CPU s ({llama / ours:.2f}x)", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-dir", type=Path, required=True,
                        help="the folder with llama-bench and llama-batched-bench")
    parser.add_argument("--gguf", type=Path, required=True, help="where the GGUF files go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="prefill,batch")
    parser.add_argument("--no-repack", action="store_true",
                        help="llama.cpp without repacked weights (its AMX kernels)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for tool in ("llama-bench", "llama-batched-bench"):
        if not (args.llama_dir / tool).is_file():
            parser.error(f"no {tool} in {args.llama_dir}")
    args.gguf.mkdir(parents=True, exist_ok=True)
    kvlab.set_num_threads(1)
    parts = args.parts.split(",")
    result = {"threads": 1, "rounds": args.rounds, "build": kvlab._kvlab.BUILD,
              "llama_cpp_repack": not args.no_repack,
              "prefill": compare_prefill(args, args.gguf) if "prefill" in parts else [],
              "batch": compare_batches(args, args.gguf) if "batch" in parts else []}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
