"""GPU benchmarks of kvlab's CUDA backend: decode attention against the memory, paged against
contiguous, and whole decode steps against Hugging Face transformers (needs a GPU; run it
through benchmarks/gpu_check.sh, which builds and tests first).

  copy        a device-to-device copy: bytes read + written per second, the yardstick
  attention   decode attention alone, one layer shaped like Llama 3 8B's (32 query heads,
              8 KV heads of head_dim 128), batch 1 to 64, contexts 1K to 32K, each format:
              bytes of K and V read per second, and as a share of the copy's bandwidth
  paged       the same fp16 attention over a paged pool (blocks of 16 scattered at random
              over the pool) against one contiguous cache per sequence
  end to end  greedy decode tokens/s at batch 1, kvlab on the GPU against transformers'
              eager Llama on torch CUDA with the same weights (float32 both; skipped when
              torch has no CUDA), for stories260K and a random 0.5B-parameter Llama shape

Timings are CUDA-event medians (attention, copy) or wall clock over a decode loop that
feeds each token back through the host (end to end, both sides alike). Every attention
configuration reads at least 512 MiB of distinct K/V per timing, rotating over parts of a
large store, so that the 50 MB L2 cache cannot serve it. One format's attention is checked
against NumPy before it is timed. Writes everything as JSON (--json) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

import kvlab  # noqa: E402  (the installed kvlab, or the checkout's on PYTHONPATH: gpu_check.sh)
from kvlab import quant, reference  # noqa: E402

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128          # Llama 3 8B's attention
BATCHES = [1, 4, 16, 64]
CONTEXTS = [1024, 4096, 16384, 32768]
ROTATE_BYTES = 512 << 20
TARGET_SECONDS = 0.02                               # per timed repeat
REPEATS = 5


def copy_bandwidth(ext, nbytes: int = 2 << 30) -> dict:
    seconds = median(ext.time_copy(nbytes, 10))
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


def row_bytes(fmt: quant.CacheFormat) -> int:
    """Bytes of K and V one position of one layer takes (codes and scales)."""
    return fmt.row_bytes(N_KV_HEADS, HEAD_DIM)


def check_attention(store, fmt: quant.CacheFormat, rng) -> float:
    """GPU attention of 2 queries against float64 NumPy on the same stored values."""
    half = store.slots // 2                           # two contiguous caches of `half` slots
    seen = np.array([min(4096 + 7, half), min(1000, half - 3)], np.int32)
    starts = [0, half]
    q = rng.standard_normal((2, N_HEADS, HEAD_DIM)).astype(np.float32)
    tables = np.array([[0], [1]], np.int32)
    out = store.attend(0, q, tables, half, np.array([0, 1], np.int32), seen)
    worst = 0.0
    for i in range(2):
        slots = np.arange(starts[i], starts[i] + seen[i], dtype=np.int64)
        kc, ks, vc, vs = store.read(slots)
        keys = kvlab.cuda._dequantized(kc, ks, fmt.key, fmt.key_group)[0].astype(np.float64)
        values = kvlab.cuda._dequantized(vc, vs, fmt.value, fmt.value_group)[0].astype(np.float64)
        want = reference.attention(q[i:i + 1].astype(np.float64), keys, values,
                                   np.array([seen[i] - 1]))[0]
        worst = max(worst, float(np.linalg.norm(out[i] - want) / np.linalg.norm(want)))
    return worst


def time_attention(store, batch: int, context: int, block_size: int, scattered: bool,
                   bytes_per_call: int, rng) -> float:
    """Median seconds of one attention call for `batch` sequences of `context` positions."""
    slots = store.slots
    blocks_per_seq = context // block_size
    blocks_in_store = slots // block_size
    rotations = max(1, min(math.ceil(ROTATE_BYTES / bytes_per_call),
                           blocks_in_store // (batch * blocks_per_seq)))
    n_blocks = rotations * batch * blocks_per_seq
    ids = rng.permutation(blocks_in_store)[:n_blocks] if scattered else np.arange(n_blocks)
    tables = ids.astype(np.int32).reshape(rotations, batch, blocks_per_seq)
    q = rng.standard_normal((batch, N_HEADS, HEAD_DIM)).astype(np.float32)
    estimate = bytes_per_call / 3e12 + 5e-6
    inner = int(min(200, max(1, TARGET_SECONDS / estimate)))
    seconds = store.time_attention(q, tables, block_size, np.arange(batch, dtype=np.int32),
                                   np.full(batch, context, np.int32), inner if REPEATS > 1 else 1,
                                   REPEATS)
    return median(seconds)


def attention_benchmarks(ext, copy_bw: float, formats, rows=None, save=lambda: None) -> list:
    """Every format, batch and context; each row appended to `rows` as it is measured, and
    save() called after each, so that a run cut short keeps what it measured."""
    rng = np.random.default_rng(0)
    slots = max(BATCHES) * max(CONTEXTS)
    rows = [] if rows is None else rows
    for name in formats:
        fmt = quant.CacheFormat.make(HEAD_DIM, name)
        store = ext.KVStore(1, N_KV_HEADS, HEAD_DIM, slots, fmt.key, fmt.value, fmt.key_group,
                            fmt.value_group)
        store.fill_random(1234)
        error = check_attention(store, fmt, rng)
        print(f"  {name}: store of {store.nbytes / 2**30:.1f} GiB, attention vs NumPy: "
              f"relative error {error:.1e}", flush=True)
        for batch in BATCHES:
            for context in CONTEXTS:
                nbytes = batch * context * row_bytes(fmt)
                row = {"format": name, "batch": batch, "context": context, "bytes": nbytes,
                       "check_relative_error": error}
                layouts = [("contiguous", context, False)]
                if name == "fp16":
                    layouts.append(("paged", 16, True))
                for layout, block_size, scattered in layouts:
                    seconds = time_attention(store, batch, context, block_size, scattered, nbytes, rng)
                    row[f"{layout}_seconds"] = seconds
                    row[f"{layout}_bytes_per_s"] = nbytes / seconds
                    row[f"{layout}_share_of_copy"] = nbytes / seconds / copy_bw
                if "paged_seconds" in row:
                    row["paged_over_contiguous"] = row["paged_seconds"] / row["contiguous_seconds"]
                rows.append(row)
                save()
        del store
    return rows


# ---- end to end ---------------------------------------------------------------------------

def random_llama(seed: int = 0, **shape) -> kvlab.Model:
    """A 0.5B-parameter Llama shape (TinyLlama's width, 8 layers) with random weights."""
    sizes = dict(dim=2048, hidden_dim=5632, n_layers=8, n_heads=32, n_kv_heads=4,
                 vocab_size=32000)
    sizes.update(shape)
    config = kvlab.ModelConfig(**sizes, max_seq_len=2048, rope_interleaved=False,
                               tied_embeddings=False, norm_eps=1e-5, name="random 0.5B")
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in kvlab.Weights.expected_shapes(config).items():
        if name.endswith("norm"):
            arrays[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            arrays[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return kvlab.Model(config, kvlab.Weights(**arrays), source="random")


def hf_from_kvlab(model: kvlab.Model, torch, transformers, device: str = "cuda"):
    """transformers' LlamaForCausalLM (eager attention, float32, on the GPU) holding the
    same weights. Only for models whose RoPE rotates halves (Hugging Face's layout); for
    llama2.c's interleaved pairs the rows of Wq and Wk are permuted to match."""
    c, w = model.config, model.weights
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=False, attn_implementation="eager")
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(hf_config)
    hf.eval()

    def halves(matrix, heads):
        """rows of each head from (x0, x1, x2, x3 ...) pairs to (x0, x2 ..., x1, x3 ...)"""
        if not c.rope_interleaved:
            return matrix
        m = matrix.reshape(heads, c.head_dim // 2, 2, -1)
        return np.ascontiguousarray(m.transpose(0, 2, 1, 3).reshape(matrix.shape))

    state = {"model.embed_tokens.weight": w.token_embedding, "model.norm.weight": w.final_norm,
             "lm_head.weight": w.classifier}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": halves(w.wq[i], c.n_heads),
            p + "self_attn.k_proj.weight": halves(w.wk[i], c.n_kv_heads),
            p + "self_attn.v_proj.weight": w.wv[i], p + "self_attn.o_proj.weight": w.wo[i],
            p + "mlp.gate_proj.weight": w.w1[i], p + "mlp.up_proj.weight": w.w3[i],
            p + "mlp.down_proj.weight": w.w2[i], p + "input_layernorm.weight": w.attn_norm[i],
            p + "post_attention_layernorm.weight": w.ffn_norm[i]})
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, array in state.items():
            params[name].copy_(torch.tensor(np.asarray(array)))
    return hf


def decode_kvlab(model, prompt, n_new):
    cache = model.new_cache(len(prompt) + n_new + 1)
    token = int(model.prefill(prompt, cache).argmax())
    first = model.decode(token, cache)              # warm-up step (and the logits to compare)
    out, token = [token], int(first.argmax())
    start = time.perf_counter()
    for _ in range(n_new):
        out.append(token)
        token = int(model.decode(token, cache).argmax())
    return n_new / (time.perf_counter() - start), first, out


def decode_hf(hf, prompt, n_new, torch, device: str = "cuda"):
    wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        result = hf(input_ids=torch.tensor([[int(t) for t in prompt]], device=device), use_cache=True)
        past, token = result.past_key_values, int(result.logits[0, -1].argmax())
        result = hf(input_ids=torch.tensor([[token]], device=device), past_key_values=past,
                    use_cache=True)
        first = result.logits[0, -1].float().cpu().numpy()
        past, out, token = result.past_key_values, [token], int(result.logits[0, -1].argmax())
        wait()
        start = time.perf_counter()
        for _ in range(n_new):
            out.append(token)
            result = hf(input_ids=torch.tensor([[token]], device=device), past_key_values=past,
                        use_cache=True)
            past, token = result.past_key_values, int(result.logits[0, -1].argmax())
        wait()
    return n_new / (time.perf_counter() - start), first, out


def end_to_end(models, n_prompt=32, n_new=128, rows=None, save=lambda: None) -> list:
    try:
        import torch
        import transformers
        hf_reason = None if torch.cuda.is_available() else "torch has no CUDA"
    except ImportError as error:
        torch = transformers = None
        hf_reason = f"no torch/transformers ({error})"
    rows = [] if rows is None else rows
    for label, make in models:
        row = {"model": label}
        try:
            cpu = make()
            gpu = cpu.to("cuda")
            row["params"] = cpu.n_params
            prompt = list(np.random.default_rng(1).integers(3, cpu.config.vocab_size, n_prompt))
            decode_kvlab(gpu, prompt, 8)           # warm-up: scratch, module load
            row["kvlab_tokens_per_s"], kv_first, kv_ids = decode_kvlab(gpu, prompt, n_new)
            if hf_reason is None:
                hf = hf_from_kvlab(cpu, torch, transformers)
                decode_hf(hf, prompt, 8, torch)
                row["hf_eager_tokens_per_s"], hf_first, hf_ids = decode_hf(hf, prompt, n_new, torch)
                row["speedup"] = row["kvlab_tokens_per_s"] / row["hf_eager_tokens_per_s"]
                row["first_step_logits_relative_difference"] = float(
                    np.linalg.norm(kv_first - hf_first) / np.linalg.norm(hf_first))
                row["same_greedy_tokens"] = int(np.sum(np.array(kv_ids) == np.array(hf_ids)))
                del hf
                torch.cuda.empty_cache()
            else:
                row["hf_skipped"] = hf_reason
        except Exception as error:    # one model's failure must not lose the other results
            row["error"] = f"{type(error).__name__}: {error}"
        print(f"  {row}", flush=True)
        rows.append(row)
        save()
    return rows


def shared_models() -> Path:
    override = os.environ.get("KVLAB_SHARED")
    if override:
        base = Path(override).expanduser()
        return base / "models" if (base / "models").is_dir() else base
    return Path(__file__).resolve().parents[2] / "shared" / "models"


def print_tables(results: dict) -> None:
    copy = results["copy"]["bytes_per_s"]
    print(f"\ndevice: {results['device']['name']}; device-to-device copy {copy / 1e12:.2f} TB/s "
          "(read + written)")
    print("\ndecode attention, one Llama 3 8B layer: TB/s of K/V read (share of the copy's)")
    print(f"{'format':6} {'batch':>5} " + " ".join(f"{c // 1024:>12}K" for c in CONTEXTS))
    for fmt in results["formats"]:
        for batch in BATCHES:
            cells = []
            for context in CONTEXTS:
                r = next(r for r in results["attention"]
                         if r["format"] == fmt and r["batch"] == batch and r["context"] == context)
                cells.append(f"{r['contiguous_bytes_per_s'] / 1e12:6.2f} ({r['contiguous_share_of_copy']:4.0%})")
            print(f"{fmt:6} {batch:5} " + " ".join(f"{c:>13}" for c in cells))
    print("\npaged (blocks of 16, scattered) over contiguous, fp16 attention time")
    print(f"{'batch':>5} " + " ".join(f"{c // 1024:>7}K" for c in CONTEXTS))
    for batch in BATCHES:
        cells = [next(r["paged_over_contiguous"] for r in results["attention"]
                      if r["format"] == "fp16" and r["batch"] == batch and r["context"] == c)
                 for c in CONTEXTS]
        print(f"{batch:5} " + " ".join(f"{x:8.3f}" for x in cells))
    print("\nend to end, greedy decode at batch 1, tokens/s")
    print(f"{'model':14} {'params':>12} {'kvlab':>9} {'HF eager':>9} {'speedup':>8} {'logits diff':>11}")
    for r in results["end_to_end"]:
        if "error" in r:
            print(f"{r['model']:14} error: {r['error']}")
            continue
        hf = r.get("hf_eager_tokens_per_s")
        print(f"{r['model']:14} {r.get('params', 0):12,} {r['kvlab_tokens_per_s']:9.1f} "
              + (f"{hf:9.1f} {r['speedup']:7.2f}x {r['first_step_logits_relative_difference']:11.1e}"
                 if hf else f"  (transformers skipped: {r.get('hf_skipped')})"))
    targets = results["targets"]
    print(f"\ntargets: attention >= 85 % of copy at batch >= 16, context >= 4K: "
          f"worst {targets['worst_share_fp16']:.0%} (fp16), {targets['worst_share_bf16']:.0%} "
          f"(bf16); paged at most 5 % slower: worst "
          f"{targets['worst_paged_over_contiguous']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu.json")
    parser.add_argument("--formats", default="fp16,fp32,bf16,int8")
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes: checks that the script runs, measures nothing")
    args = parser.parse_args()
    global BATCHES, CONTEXTS, N_HEADS, N_KV_HEADS, ROTATE_BYTES, REPEATS
    copy_bytes, n_new, random_shape = 2 << 30, 128, {}
    if args.quick:
        BATCHES, CONTEXTS, N_HEADS, N_KV_HEADS, ROTATE_BYTES = [1, 2], [256, 512], 8, 2, 1
        REPEATS = 1
        copy_bytes, n_new = 1 << 20, 4
        random_shape = dict(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                            vocab_size=300)
    ext = kvlab.cuda.extension()
    started = time.perf_counter()
    results = {"device": kvlab.cuda.device_info(), "python": platform.python_version(),
               "formats": args.formats.split(","), "complete": False,
               "shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM}}
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """The JSON as far as it goes (a run killed by a time limit keeps what it measured)."""
        results["seconds"] = time.perf_counter() - started
        partial = args.json.with_suffix(".partial")
        partial.write_text(json.dumps(results, indent=1))
        partial.replace(args.json)

    print(f"device: {results['device']}", flush=True)
    results["copy"] = copy_bandwidth(ext, copy_bytes)
    save()
    print(f"copy: {results['copy']['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    print("attention:", flush=True)
    results["attention"] = []
    attention_benchmarks(ext, results["copy"]["bytes_per_s"], results["formats"],
                         results["attention"], save)
    big = [r for r in results["attention"] if r["batch"] >= 16 and r["context"] >= 4096]
    results["targets"] = {   # >= 85 % of the copy (fp16, bf16), paged <= 1.05x contiguous
        **{f"worst_share_{name}": min((r["contiguous_share_of_copy"] for r in big
                                       if r["format"] == name), default=float("nan"))
           for name in ("fp16", "bf16")},
        "worst_paged_over_contiguous": max((r["paged_over_contiguous"] for r in big
                                            if "paged_over_contiguous" in r), default=float("nan")),
    }
    save()
    models = []
    stories = shared_models() / "stories260K"
    if (stories / "stories260K.bin").exists():
        models.append(("stories260K", lambda: kvlab.load(stories / "stories260K.bin",
                                                         tokenizer=stories / "tok512.bin")))
    models.append(("random 0.5B", lambda: random_llama(**random_shape)))
    results["end_to_end"] = []
    if not args.skip_end_to_end:
        print("end to end:", flush=True)
        end_to_end(models, n_new=n_new, rows=results["end_to_end"], save=save)
    results["complete"] = True
    save()
    print_tables(results)
    print(f"\nwrote {args.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
