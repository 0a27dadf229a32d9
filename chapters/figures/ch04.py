"""Figures and numbers for chapter 4, "Paged memory for the cache".

    python chapters/figures/ch04.py [--out DIR] [--quick]

Writes ch04_block_table.png, ch04_capacity.png and ch04.json (every number the chapter
quotes, with the setup; "facts": those it quotes from elsewhere, with their sources) into DIR (default: this script's folder). Runs in about 10 s on a
2-core machine.

1. A small pool (16 blocks of 4 positions) on the bundled model: a prompt, a fork, a
   copy-on-write, a freed sequence whose full blocks stay cached, and a prefix reuse,
   drawn from pool.ref_counts, pool.fill, pool.block_tokens and the block tables.
2. Capacity in one memory budget: the K/V memory of 16 contiguous caches of 512
   positions (the bundled model's context), filled by requests of long-tailed lengths in
   arrival order, as contiguous caches (each reserves 512 positions) and as one paged
   pool of the same bytes (blocks as needed). Both are real kvlab objects, filled with
   K/V rows through append (memory is the point here, not the values). Then the unused
   slots for block sizes 1 to 256 (pool.stats()).
3. Paged and contiguous give bit-identical logits (prefill and 48 decode steps, several
   block sizes, a forked child, a reused prefix).
4. Decode step time over a paged and a contiguous cache of the same content (a one-layer
   model whose decode step is nearly all attention; one thread; 31 rounds of 16 steps,
   the two in turn, so each pair meets the same load): the median and spread
   (common.spread) of each one's time per step and of the per-round ratio.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
import common  # noqa: E402  (chapters/figures/common.py)

COLORS = {"used": "#4c78a8", "shared": "#f58518", "cached": "#9ecae9", "free": "#eeeeee"}
# numbers the chapter quotes from elsewhere, with where they come from (written to the JSON
# as "facts")
FACTS = {
    "vllm_token_state_percent": {
        "value": [20.4, 38.2],
        "source": "Kwon et al. 2023, vLLM, arXiv:2309.06180, Figure 2 and the text on it: "
                  "in the serving systems it profiled, only 20.4% - 38.2% of the KV cache "
                  "memory held actual token states"},
    "paged_over_contiguous_before_fetch_ahead": {
        "value": 1.3965020552527743,
        "source": "this script's decode_timing at 8,192 positions (paged_over_contiguous_"
                  "median) as committed in chapters/figures/ch04.json at 4af9a04, before "
                  "commit d07361e made attention fetch ahead across blocks"},
    "vllm_default_block_size": {
        "value": 16,
        "source": "vLLM engine arguments, --block-size (docs.vllm.ai, engine_args): "
                  "default 16"},
}


def machine() -> dict:
    return {**common.machine(), "threads": kvlab.get_num_threads()}


# ---- 1. a pool you can see ------------------------------------------------------------

def table(seq) -> list:
    return [int(b) for b in seq.block_table]


def small_pool(model) -> tuple:
    pool = model.new_paged_pool(num_blocks=16, block_size=4)
    events = []
    a = pool.new_sequence()
    prompt = model.encode("ROMEO: O, she")
    model.prefill(prompt, a)
    events.append(f"A = prefill {len(prompt)} tokens: blocks {table(a)}")
    b = pool.fork(a)
    events.append(f"B = fork(A): shares {table(b)}, ref counts "
                  f"{[int(pool.ref_counts[i]) for i in b.block_table]}")
    needed = pool.blocks_needed(b, 1)
    model.decode(ord("d"), b)
    events.append(f"B decodes 'd': needs {needed} block (copy-on-write), table now "
                  f"{table(b)}")
    model.decode(ord("i"), a)
    events.append(f"A decodes 'i': its last block is its own again, written in place: "
                  f"{table(a)}")
    c = pool.new_sequence()
    other = model.encode("JULIET: Ay me")
    model.prefill(other, c)
    c_table = table(c)
    pool.free(c)
    events.append(f"C = prefill {len(other)} tokens in {c_table}, then free(C): full blocks "
                  f"cached {sorted(int(x) for x in pool.cached_blocks)}, the partial one freed")
    d = pool.new_sequence()
    reused = pool.reuse_prefix(d, prompt, len(prompt) - 1)
    model.prefill(prompt[reused:], d)
    events.append(f"D = reuse_prefix(prompt of A): {reused} tokens reused from "
                  f"{table(d)[:reused // 4]}, {len(prompt) - reused} computed")
    pool.check()
    names = {a.id: "A", b.id: "B", d.id: "D"}
    return pool, names, events


def draw_pool(pool, names: dict, path: Path) -> None:
    n, bs = pool.num_blocks, pool.block_size
    refs, fill, tokens = pool.ref_counts, pool.fill, pool.block_tokens
    cached = set(int(x) for x in pool.cached_blocks)
    seqs = pool.sequences()

    def kind(block: int) -> str:
        if refs[block] > 1:
            return "shared"
        if refs[block] == 1:
            return "used"
        return "cached" if block in cached else "free"

    fig, ax = plt.subplots(figsize=(10, 3.3), dpi=100)
    width = 1.0
    top = len(seqs) + 1.6
    for block in range(n):
        x = block * width
        k = kind(block)
        ax.add_patch(Rectangle((x + 0.04, top), width - 0.08, 1.1, color=COLORS[k]))
        fg = "white" if k in ("used", "shared") else "#333"
        ax.text(x + 0.5, top + 0.88, str(block), ha="center", fontsize=8, color=fg,
                weight="bold")
        text = "".join(chr(t) if 32 <= t < 127 else "?" for t in tokens[block, :fill[block]])
        if fill[block]:
            ax.text(x + 0.5, top + 0.52, repr(text)[1:-1] or " ", ha="center", fontsize=7,
                    color=fg, family="monospace")
        label = f"ref {refs[block]}" if refs[block] else k
        ax.text(x + 0.5, top + 0.16, label, ha="center", fontsize=6.5, color=fg)
    ax.text(-0.2, top + 0.55, "physical\nblocks", ha="right", va="center", fontsize=8)
    for row, seq in enumerate(seqs):
        y = top - 1.3 - row * 1.0
        ax.text(-0.2, y + 0.35, f"seq {names.get(seq.id, seq.id)}\n(length {seq.length})",
                ha="right", va="center", fontsize=8)
        for logical, block in enumerate(seq.block_table):
            x = logical * width
            k = kind(int(block))
            ax.add_patch(Rectangle((x + 0.04, y), width - 0.08, 0.7, color=COLORS[k]))
            ax.text(x + 0.5, y + 0.22, f"{block}", ha="center", fontsize=8, color="white",
                    weight="bold")
    ax.text(0, top - 0.35, "block tables: logical block i -> physical block id",
            fontsize=8, color="#555")
    for i, (k, col) in enumerate(COLORS.items()):
        ax.add_patch(Rectangle((8 + 2 * i, top - 1.3), 0.35, 0.35, color=col))
        ax.text(8.45 + 2 * i, top - 1.25, k, fontsize=8)
    ax.set_xlim(-2.3, n * width)
    ax.set_ylim(top - 1.3 - (len(seqs) - 1) * 1.0 - 0.15, top + 1.2)
    ax.axis("off")
    s = pool.stats()
    ax.set_title(f"{n} blocks x {bs} positions: {s.blocks_used} used, {s.blocks_cached} cached,"
                 f" {s.blocks_free} free; {s.tokens_stored} tokens stored, {s.slots_unused} "
                 f"slots unused; prefix hits {s.prefix_hits}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- 2. capacity in one budget ------------------------------------------------------------

def request_lengths(n: int, max_len: int, rng) -> np.ndarray:
    """Long-tailed lengths (prompt + answer), as in chat traffic: most short, a few long."""
    return np.clip(rng.lognormal(mean=4.6, sigma=0.8, size=n), 8, max_len).astype(int)


def tokens_of(request: int, n: int) -> np.ndarray:
    """Token ids of one request: different for every request. (The pool stores a full
    block once when another sequence already holds the same tokens after the same
    prefix, so requests made of identical ids would share their blocks.)"""
    return np.random.default_rng(1000 + request).integers(0, 256, n).astype(np.int32)


def fill_contiguous(model, lengths, budget: int, max_len: int) -> dict:
    c = model.config
    caches, allocated, stored = [], [0], [0]
    per_token = kvlab.kv_bytes_per_token(c, "fp32")
    for n in lengths:
        if allocated[-1] + kvlab.kv_cache_bytes(c, max_len, dtype="fp32") > budget:
            break
        cache = model.new_cache(max_len)
        rows = np.zeros((int(n), c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
        cache.append(rows, rows)
        caches.append(cache)
        allocated.append(allocated[-1] + cache.nbytes)
        stored.append(stored[-1] + int(n) * per_token)
    return {"admitted": len(caches), "allocated_bytes": allocated, "token_bytes": stored,
            "unused_percent": 100 * (1 - stored[-1] / allocated[-1])}


def fill_paged(model, lengths, budget: int, block_size: int) -> dict:
    c = model.config
    per_token = kvlab.kv_bytes_per_token(c, "fp32")
    num_blocks = budget // (block_size * per_token)
    pool = model.new_paged_pool(num_blocks, block_size, max_seqs=1024,
                                max_blocks_per_seq=-(-c.max_seq_len // block_size))
    allocated, stored, refused = [0], [0], None
    for i, n in enumerate(lengths):
        seq = pool.new_sequence()
        rows = np.zeros((int(n), c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
        try:
            pool.append(seq, tokens_of(i, int(n)), rows, rows)
        except kvlab.OutOfBlocks as error:
            refused = {"request": i, "length": int(n), "message": str(error)}
            pool.free(seq)
            break
        s = pool.stats()
        allocated.append(s.blocks_used * block_size * per_token)
        stored.append(s.tokens_stored * per_token)
    s = pool.stats()
    pool.check()
    return {"block_size": block_size, "num_blocks": num_blocks, "pool_nbytes": pool.nbytes,
            "admitted": s.n_sequences, "allocated_bytes": allocated, "token_bytes": stored,
            "blocks_used": s.blocks_used, "blocks_free": s.blocks_free,
            "slots_unused": s.slots_unused, "tokens_stored": s.tokens_stored,
            "fragmentation_percent": s.fragmentation_percent, "refused": refused}


def block_size_sweep(model, lengths) -> list:
    """Unused slots for one fixed set of requests, block size by block size."""
    c = model.config
    out = []
    for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        blocks = int(sum(-(-int(n) // bs) for n in lengths))
        pool = model.new_paged_pool(blocks, bs, max_seqs=len(lengths),
                                    max_blocks_per_seq=-(-c.max_seq_len // bs))
        for i, n in enumerate(lengths):
            rows = np.zeros((int(n), c.n_layers, c.n_kv_heads, c.head_dim), dtype=np.float32)
            pool.append(pool.new_sequence(), tokens_of(i, int(n)), rows, rows)
        s = pool.stats()
        formula = int(sum(-(-int(n) // bs) * bs - int(n) for n in lengths))
        out.append({"block_size": bs, "blocks_used": s.blocks_used,
                    "slots_unused": s.slots_unused, "slots_unused_formula": formula,
                    "fragmentation_percent": s.fragmentation_percent,
                    "table_entries": int(sum(-(-int(n) // bs) for n in lengths)),
                    # the mean unused slots per sequence if lengths fall evenly in a block
                    "expected_unused_per_sequence": (bs - 1) / 2})
    return out


def draw_capacity(contiguous, paged, sweep, contiguous_sweep_percent, budget, setup_line,
                  path: Path) -> None:
    mib = 2 ** 20
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    x_c = np.arange(len(contiguous["allocated_bytes"]))
    x_p = np.arange(len(paged["allocated_bytes"]))
    left.plot(x_c, np.array(contiguous["allocated_bytes"]) / mib, color="#e45756",
              label=f"contiguous, 512 reserved each: {contiguous['admitted']} requests")
    left.plot(x_p, np.array(paged["allocated_bytes"]) / mib, color="#4c78a8",
              label=f"paged, blocks of {paged['block_size']}: {paged['admitted']} requests")
    left.plot(x_p, np.array(paged["token_bytes"]) / mib, color="#54a24b", ls=":",
              label="bytes holding tokens")
    left.axhline(budget / mib, color="#333", lw=1, ls="--")
    left.text(1, budget / mib * 1.02, f"budget {budget / mib:g} MiB", fontsize=8)
    left.set_xlabel("requests admitted, in arrival order")
    left.set_ylabel("K/V memory allocated (MiB)")
    left.set_ylim(0, budget / mib * 1.15)
    left.legend(fontsize=7, loc="center right")
    left.set_title("one memory budget, requests of long-tailed lengths", fontsize=9)
    bs = [r["block_size"] for r in sweep]
    right.plot(bs, [r["fragmentation_percent"] for r in sweep], "o-", color="#4c78a8",
               label="paged: unused slots in used blocks")
    right.axhline(contiguous_sweep_percent, color="#e45756", ls="--",
                  label=f"contiguous (512 each): {contiguous_sweep_percent:.1f} %")
    right.set_xscale("log", base=2)
    right.set_xticks(bs, [str(b) for b in bs])
    right.set_xlabel("block size (positions)")
    right.set_ylabel("% of allocated slots holding nothing")
    right.set_ylim(0, 100)
    right.legend(fontsize=7, loc="upper left")
    right.set_title("the same requests, block size varied", fontsize=9)
    fig.text(0.5, 0.005, setup_line, ha="center", fontsize=7, color="#666")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- 3. the same bits --------------------------------------------------------------------

def greedy(model, prompt, cache, steps: int) -> np.ndarray:
    rows = [model.prefill(prompt, cache, all_logits=True)]
    token = int(rows[-1][-1].argmax())
    for _ in range(steps):
        logits = model.decode(token, cache)
        rows.append(logits[None])
        token = int(logits.argmax())
    return np.concatenate(rows)


def identical_logits(model) -> dict:
    prompt = model.encode("ROMEO:\nWhat light through yonder window breaks?\n")
    steps = 48
    reference_logits = greedy(model, prompt, model.new_cache(128), steps)
    out = {"prompt_tokens": len(prompt), "decode_steps": steps}
    for bs in (1, 4, 16, 64):
        pool = model.new_paged_pool(-(-128 // bs) + 1, bs)
        out[f"block_size_{bs}"] = bool(np.array_equal(
            greedy(model, prompt, pool.new_sequence(), steps), reference_logits))
    # a forked child continues exactly as a contiguous cache holding the same tokens
    pool = model.new_paged_pool(32, 16)
    parent = pool.new_sequence()
    model.prefill(prompt, parent)
    child = pool.fork(parent)
    continuation = model.encode(" It is the east")
    child_logits = model.prefill(continuation, child, all_logits=True)
    cache = model.new_cache(128)
    model.prefill(prompt, cache)
    out["forked_child_vs_contiguous"] = bool(np.array_equal(
        child_logits, model.prefill(continuation, cache, all_logits=True)))
    # a reused prefix gives the logits a full prefill gives
    pool.free(child)
    pool.free(parent)
    seq = pool.new_sequence()
    reused = pool.reuse_prefix(seq, prompt, len(prompt) - 1)
    tail = model.prefill(prompt[reused:], seq, all_logits=True)
    out["reused_prefix_tokens"] = reused
    out["reused_prefix_vs_full_prefill"] = bool(np.array_equal(
        tail, reference_logits[reused:len(prompt)]))
    return out


def prefix_sharing(model) -> dict:
    """Eight requests that start with the same 64-token instruction."""
    system = model.encode("You are a helpful assistant who answers in the style of the Bard. ")[:64]
    questions = ["Who is Romeo?", "Where is Verona?", "What is a sonnet?", "Why so sad?",
                 "Who wrote this?", "What is love?", "Is it morning?", "Where art thou?"]
    pool = model.new_paged_pool(num_blocks=128, block_size=16)
    computed, reused_total, total = 0, 0, 0
    for q in questions:
        tokens = system + model.encode(q)
        seq = pool.new_sequence()
        reused = pool.reuse_prefix(seq, tokens, len(tokens) - 1)
        model.prefill(tokens[reused:], seq)
        computed += len(tokens) - reused
        reused_total += reused
        total += len(tokens)
    s = pool.stats()
    return {"requests": len(questions), "shared_prefix_tokens": len(system),
            "prompt_tokens": total, "tokens_computed": computed, "tokens_reused": reused_total,
            "prefix_hits": s.prefix_hits, "prefix_misses": s.prefix_misses,
            "blocks_used": s.blocks_used, "blocks_without_sharing":
            sum(-(-len(system + model.encode(q)) // 16) for q in questions)}


# ---- 4. the block table costs (almost) nothing ----------------------------------------------

ROUNDS = 31


def decode_timing(rng, contexts=(1024, 8192), steps=16, repeats=ROUNDS) -> list:
    """One thread: on a shared machine a second OpenMP thread that gets descheduled makes
    the other wait, and that noise would swamp the difference being measured."""
    threads_before = kvlab.get_num_threads()
    kvlab.set_num_threads(1)
    out = []
    for context in contexts:
        config = kvlab.ModelConfig(dim=16, hidden_dim=16, n_layers=1, n_heads=8, n_kv_heads=2,
                                   head_dim=64, vocab_size=16, max_seq_len=context + steps + 1)
        model = kvlab.Model(config, kvlab.Weights.random(config, seed=0))
        shape = (context, 1, 2, 64)
        keys = rng.standard_normal(shape, dtype=np.float32)
        values = rng.standard_normal(shape, dtype=np.float32)
        cache = model.new_cache(context + steps)
        cache.append(keys, values)
        blocks = -(-(context + steps) // 16) + 2
        pool = model.new_paged_pool(blocks, 16, max_blocks_per_seq=blocks)
        base = pool.new_sequence()
        pool.append(base, np.zeros(context, dtype=np.int32), keys, values)

        def contiguous():
            for _ in range(steps):
                model.decode(1, cache)
            cache.truncate(context)

        def paged():
            child = pool.fork(base)     # shares every block; base stays as it was
            for _ in range(steps):
                model.decode(1, child)
            pool.free(child)

        times = {"contiguous": [], "paged": []}
        for _ in range(repeats):
            for name, run in (("contiguous", contiguous), ("paged", paged)):
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) / steps)
        ratios = np.array(times["paged"]) / np.array(times["contiguous"])
        out.append({"context": context, "block_size": 16, "steps_per_round": steps,
                    "rounds": repeats,
                    "contiguous_us": common.spread(1e6 * np.array(times["contiguous"])),
                    "paged_us": common.spread(1e6 * np.array(times["paged"])),
                    "paged_over_contiguous": common.spread(ratios), "threads": 1})
    kvlab.set_num_threads(threads_before)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this);"
                             " its numbers are not the chapter's")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    model = kvlab.load()
    c = model.config

    pool, names, events = small_pool(model)
    draw_pool(pool, names, out / "ch04_block_table.png")
    picture = {"events": events, "render": pool.render()}

    max_len = c.max_seq_len
    per_token = kvlab.kv_bytes_per_token(c, "fp32")
    budget = 16 * kvlab.kv_cache_bytes(c, max_len, dtype="fp32")
    lengths = request_lengths(400, max_len, rng)
    contiguous = fill_contiguous(model, lengths, budget, max_len)
    paged = fill_paged(model, lengths, budget, block_size=16)
    sweep_lengths = lengths[:64]
    sweep = block_size_sweep(model, sweep_lengths)
    contiguous_sweep_percent = 100 * (1 - sweep_lengths.sum() / (len(sweep_lengths) * max_len))

    setup = machine()
    setup["model"] = f"{c.name} (bundled): {c.n_layers} layers, {c.n_kv_heads} KV heads x {c.head_dim}, fp32"
    setup_line = (f"{c.name}: {per_token:,} B per token (fp32); lengths lognormal(4.6, 0.8) "
                  f"clipped to [8, {max_len}], seed 0")
    draw_capacity(contiguous, paged, sweep, contiguous_sweep_percent, budget, setup_line,
                  out / "ch04_capacity.png")

    identical = identical_logits(model)
    prefix = prefix_sharing(model)
    timing = decode_timing(rng, repeats=3 if args.quick else ROUNDS)   # --quick: 3 rounds

    admitted = lengths[:paged["admitted"]]
    capacity = {
        "bytes_per_token_fp32": per_token, "max_seq_len": max_len, "budget_bytes": budget,
        "budget_as": f"16 contiguous caches of {max_len} positions",
        "requests_generated": len(lengths),
        "length_mean": float(lengths.mean()), "length_median": float(np.median(lengths)),
        "length_p90": float(np.percentile(lengths, 90)), "length_max": int(lengths.max()),
        "share_at_most_p90": float(np.mean(lengths <= np.floor(np.percentile(lengths, 90)))),
        "length_min": int(lengths.min()),
        "contiguous_admitted": contiguous["admitted"],
        "contiguous_unused_percent": contiguous["unused_percent"],
        "contiguous_used_percent": 100 - contiguous["unused_percent"],
        "paged_admitted": paged["admitted"], "paged_block_size": paged["block_size"],
        "paged_num_blocks": paged["num_blocks"], "paged_pool_nbytes": paged["pool_nbytes"],
        "paged_blocks_used": paged["blocks_used"], "paged_blocks_free": paged["blocks_free"],
        "paged_tokens_stored": paged["tokens_stored"], "paged_slots_unused": paged["slots_unused"],
        "paged_fragmentation_percent": paged["fragmentation_percent"],
        "paged_refused": paged["refused"],
        "paged_admitted_mean_length": float(admitted.mean()),
        "admitted_ratio": paged["admitted"] / contiguous["admitted"],
        "sweep_requests": len(sweep_lengths),
        "sweep_mean_length": float(sweep_lengths.mean()),
        "sweep_contiguous_unused_percent": float(contiguous_sweep_percent),
        "block_size_sweep": sweep,
        "curves": {"contiguous_allocated": contiguous["allocated_bytes"],
                   "paged_allocated": paged["allocated_bytes"],
                   "paged_token_bytes": paged["token_bytes"]},
    }
    result = {"setup": setup, "pool_picture": picture, "capacity": capacity,
              "identical_logits": identical, "prefix_sharing": prefix,
              "decode_timing": timing, "facts": FACTS,
              "script_seconds": time.perf_counter() - started}
    (out / "ch04.json").write_text(json.dumps(result, indent=2))
    print(picture["render"])
    print("\n".join(events))
    brief = {k: v for k, v in capacity.items() if k not in ("curves", "block_size_sweep")}
    print(json.dumps({"capacity": brief, "identical": identical, "prefix": prefix,
                      "timing": timing}, indent=1))
    print(f"wrote {out}/ch04_*.png and ch04.json in {result['script_seconds']:.1f} s")


if __name__ == "__main__":
    main()
