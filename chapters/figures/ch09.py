"""Figures and numbers for chapter 9, "Speculative decoding and the cache".

    python chapters/figures/ch09.py [--out DIR] [--threads N] [--rounds R] [--quick]

Writes ch09_pass_cost.png, ch09_step.png, ch09_acceptance.png, ch09_position.png and
ch09.json (every number the chapter quotes, with the setup and a table of facts quoted from
papers). The measurements are on SmolLM2-135M-Instruct (kvlab.load("smollm2-135m"), Q4_1
weights), except the two that show a mechanism and need no trained model, on the bundled
model:

1. What one forward pass over the cache costs against the number of new tokens it runs
   (context 256; the tokens are cut off again after each pass, as speculation does): the
   median of several interleaved runs, each size relative to the same run's one-token
   pass, and what the core counted (weight bytes, FLOPs); then a pass of the model's own
   first L layers (self-speculation) against a pass of the whole model, in turn.
2. Greedy speculation gives exactly plain decoding's tokens: prompt lookup and the model's
   first layers on SmolLM2's chat tasks, k = 1, 2, 4 and 8, fp32 and int8 caches; every
   drafter of the kit on the bundled model; and a loop written out by hand over a paged
   pool (bundled model), whose truncates release blocks.
3. One real speculative step of SmolLM2, drawn (ch09_step.png).
4. The rejection rule of speculative sampling keeps the model's distribution (bundled
   model): one position's output distribution worked out exactly, and seeded draws through
   the kit's own verify_drafts.
5. Acceptance against speedup on SmolLM2, k = 4: a drafter whose acceptance is set by hand
   (it drafts the plain run's own tokens, each spoiled with probability 1 - alpha,
   independently, as the papers' formula assumes); prompt lookup on chat tasks that copy
   from the prompt (repeat a paragraph, rewrite it, summarize it, comment code) and on one
   that does not (a story); self-speculation with the model's first L layers. Each is timed
   against plain decoding (generate's C loop and the same Python loop) in alternating
   rounds; a speedup is the median of the per-round ratios. Acceptance by draft position
   is drawn in ch09_position.png.

--quick runs the same code with fewer rounds, fewer tokens and fewer configurations (the
tests run it); its numbers are not the chapter's. The full run takes a few minutes on the
shared 2-core machine (one core thread by default: a single thread is far less disturbed
by other processes; see chapters/appendix_measuring.md).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
import common  # noqa: E402  (chapters/figures/common.py puts benchmarks/ on the path)
from common import spread  # noqa: E402
from bench_speculative import TEXTS  # noqa: E402  (the benchmark's own two texts)
from kvlab import chat  # noqa: E402
from kvlab.reference import probabilities  # noqa: E402
from kvlab.sampling import sample  # noqa: E402
from kvlab.speculative import DraftModel, PromptLookup, _draw, verify_drafts  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = [1, 2, 3, 4, 5, 7, 9, 12, 16]      # new tokens per pass: k drafts + 1
K = 4                                      # drafts per pass in the timed runs
ALPHAS = [0.0, 0.5, 0.8, 0.9, 1.0]         # the oracle's set acceptance
FIRST_LAYERS = [8, 15, 22, 28]             # self-speculation: SmolLM2's first L of 30 layers

PARAGRAPH = ("The KV cache stores the keys and values of every token the model has already "
             "seen, so that each new token computes only its own. Without it, every step "
             "would recompute attention over the whole prefix, and generation would slow "
             "down as the text grows. The price is memory: the cache grows by the same "
             "number of bytes with every token, for every request.")
CODE = '''def mean_and_spread(values):
    n = len(values)
    mean = sum(values) / n
    spread = max(values) - min(values)
    return mean, spread
'''
# SmolLM2's chat tasks: four whose answer copies from the prompt, one that copies nothing
TASKS = {
    "repeat a paragraph": "Repeat this paragraph word for word:\n\n" + PARAGRAPH,
    "past tense": "Rewrite this paragraph in the past tense:\n\n" + PARAGRAPH,
    "summary": "Summarize this paragraph in two sentences:\n\n" + PARAGRAPH,
    "comment code": "Add a comment above each line of this Python function:\n\n" + CODE,
    "a story": "Write a short story about a cat.",
}
SAMPLED = {"temperature": 0.8, "top_k": 40, "seed": 1}
LOOKUP_3 = "prompt lookup, 3-token match"  # PromptLookup(ngram=3, min_ngram=3)

# Facts the chapter quotes from papers and data sheets, with their sources.
FACTS = {
    "leviathan": {"speedup": [2, 3], "model": "T5-XXL (11B)",
                  "source": "Leviathan et al. 2023, arXiv:2211.17192, abstract"},
    "chen": {"speedup": [2, 2.5], "model": "Chinchilla 70B with a 4B draft model",
             "source": "Chen et al. 2023, arXiv:2302.01318, abstract"},
    "prompt_lookup": {"speedup": [2, 4], "model": "Mistral-7B-Instruct, greedy, one A100",
                      "source": "Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding"},
    "magicdec": {"speedup_llama2_7b_32k": 2.0, "speedup_llama3_1_8b": 1.84,
                 "batch_sizes": [32, 256], "hardware": "8 NVIDIA A100",
                 "drafter": "a draft model with a sparse (StreamingLLM) KV cache",
                 "source": "Chen, Tiwari, Sadhukhan et al. 2024 (MagicDec), "
                           "arXiv:2408.11049 (v3), abstract"},
    "layerskip": {"source": "Elhoushi et al. 2024, arXiv:2404.16710: trained with layer "
                            "dropout and an early-exit loss so that early layers draft"},
}


def messages(task: str) -> list:
    return [{"role": "user", "content": TASKS[task]}]


def chat_ids(model: kvlab.Model, task: str) -> list:
    """The task as SmolLM2's chat template lays it out, in token ids."""
    return list(chat.prompt(model, messages(task))[1])

# ---- 1. the cost of a pass against its new tokens -----------------------------------------

def pass_costs(model: kvlab.Model, reps: int, context: int = 256) -> dict:
    """Milliseconds of model.forward(n new tokens, all_logits=True) after `context` cached
    ones, for every n in SIZES, `reps` times in turn (every size meets the same noise)."""
    cache = model.new_cache(context + max(SIZES))
    model.prefill([t % model.config.vocab_size for t in range(1, context + 1)], cache)
    new = [7 + i for i in range(max(SIZES))]
    model.forward(new[:4], cache, all_logits=True)          # warm up
    cache.truncate(context)
    times = {n: [] for n in SIZES}
    for _ in range(reps):
        for n in SIZES:
            start = time.perf_counter()
            model.forward(new[:n], cache, all_logits=True)
            times[n].append(1000 * (time.perf_counter() - start))
            cache.truncate(context)
    counted = {}
    for n in SIZES:
        with model.counting() as counts:
            model.forward(new[:n], cache, all_logits=True)
        cache.truncate(context)
        counted[n] = {"weight_bytes": counts.weight_bytes, "flops": counts.flops,
                      "kv_read_bytes": counts.kv_read_bytes}
    one = np.array(times[1])
    rows = []
    for n in SIZES:
        s, ms = spread(times[n]), np.array(times[n])
        # this size's time over the one-token pass of the same run (both met the same load)
        relative = spread(ms / one)
        rows.append({"new_tokens": n, "ms": s, "relative": relative,
                     "relative_to_one": relative["median"],
                     "ms_per_token": s["median"] / n, **counted[n],
                     "flops_per_weight_byte": counted[n]["flops"] / counted[n]["weight_bytes"],
                     # what the passes achieved (times in ms)
                     "weight_gb_per_s": spread(counted[n]["weight_bytes"] / ms / 1e6),
                     "gflop_per_s": spread(counted[n]["flops"] / ms / 1e6)})
    return {"model": model.config.name, "params": model.n_params,
            "params_millions": model.n_params / 1e6, "weights_bytes": model.weights_nbytes,
            "weights_mb": model.weights_nbytes / 1e6, "context": context, "reps": reps,
            "threads": kvlab.get_num_threads(),
            "rows": rows}


def relative_cost(table: dict, n: int) -> float:
    """A pass over n new tokens in units of a pass over one (interpolated between sizes)."""
    sizes = [r["new_tokens"] for r in table["rows"]]
    return float(np.interp(n, sizes, [r["relative_to_one"] for r in table["rows"]]))


def draft_pass_costs(model: kvlab.Model, drafters: dict, reps: int, context: int = 256) -> dict:
    """A one-token pass of each drafter's model over its own cache of `context` positions,
    in turn with one of the model's, `reps` times: {name: spread of the drafter's time over
    the model's, run by run}, and the model's own one-token ms."""
    models = {"model": model, **drafters}
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(context + 1)
        m.prefill([t % m.config.vocab_size for t in range(1, context + 1)], caches[name])
    times = {name: [] for name in models}
    for _ in range(reps):
        for name, m in models.items():
            start = time.perf_counter()
            m.forward([7], caches[name])
            times[name].append(1000 * (time.perf_counter() - start))
            caches[name].truncate(context)
    model_ms = np.array(times["model"])
    out = {name: spread(np.array(times[name]) / model_ms) for name in drafters}
    out["model_one_token_ms"] = spread(model_ms)
    return out



# ---- 2. greedy speculation gives plain decoding's tokens ------------------------------------

def exactness(smol: kvlab.Model, model: kvlab.Model, mha: kvlab.Model, tasks: list,
              ks: list, new_tokens: int) -> dict:
    """Token lists of plain and speculative greedy generation, compared: SmolLM2 on chat
    tasks (prompt lookup with fp32 and int8 caches, its first 15 layers), and the bundled
    model with every drafter of the kit."""
    runs = []

    def compare(m, prompt_name, prompt, drafter_name, make, k, dtype, **kw):
        plain = kvlab.generate(m, prompt, new_tokens, dtype=dtype, **kw).tokens
        out = kvlab.generate(m, prompt, new_tokens, speculate=make(), draft_tokens=k,
                             dtype=dtype, **kw)
        runs.append({"model": m.config.name, "prompt": prompt_name, "drafter": drafter_name,
                     "k": k, "cache": dtype, "identical": out.tokens == plain})

    for task in tasks:
        ids = chat_ids(smol, task)
        for k in ks:
            for dtype in ("fp32", "int8"):
                compare(smol, task, ids, "prompt lookup", PromptLookup, k, dtype)
        compare(smol, task, ids, "first 15 layers",
                lambda: DraftModel.first_layers(smol, 15), K, "fp32")
    small = {"prompt lookup": PromptLookup,
             "first 2 layers": lambda: DraftModel.first_layers(model, 2),
             "MHA model (same size)": lambda: DraftModel(mha)}
    for prompt_name, prompt in TEXTS.items():
        for drafter_name, make in small.items():
            for k in ks:
                compare(model, prompt_name, prompt, drafter_name, make, k, "fp32",
                        stop_at_eos=False)
    return {"runs": len(runs), "identical": sum(r["identical"] for r in runs),
            "all_identical": all(r["identical"] for r in runs), "new_tokens": new_tokens,
            "runs_smollm2": sum(r["model"] == smol.config.name for r in runs),
            "each_run": runs}


def paged_by_hand(model: kvlab.Model, prompt: str, n_new: int = 100, k: int = K,
                  block_size: int = 4) -> dict:
    """The speculative loop written out over a paged pool: prefill, then per pass the newest
    token and up to k prompt-lookup drafts in one forward over the sequence's blocks, the
    accepted prefix kept and the rest cut off with pool.truncate (which releases blocks)."""
    pool = model.new_paged_pool(num_blocks=64, block_size=block_size)
    seq = pool.new_sequence()
    ids = model.encode(prompt)
    drafter = PromptLookup()
    new = [sample(model.prefill(ids, seq))]
    passes, released, truncates_releasing = 0, 0, 0
    while len(new) < n_new:
        drafts = drafter.propose(ids + new, min(k, n_new - len(new) - 1))
        rows = model.forward([new[-1]] + drafts, seq, all_logits=True)
        passes += 1
        accepted = 0
        while accepted < len(drafts) and sample(rows[accepted]) == drafts[accepted]:
            accepted += 1
        before = pool.stats().blocks_used
        pool.truncate(seq, len(ids) + len(new) + accepted)
        freed = before - pool.stats().blocks_used
        released += freed
        truncates_releasing += freed > 0
        new += drafts[:accepted] + [sample(rows[accepted])]
    plain = kvlab.generate(model, prompt, n_new).tokens
    return {"prompt": prompt, "new_tokens": n_new, "k": k, "block_size": block_size,
            "passes": passes, "blocks_released": released,
            "passes_whose_truncate_released_a_block": truncates_releasing,
            "identical_to_plain": new == plain}



# ---- 3. one step, drawn ---------------------------------------------------------------------

def one_step(model: kvlab.Model, ids: list, k: int = K) -> dict:
    """The first pass of a greedy prompt-lookup run that keeps some drafts and refuses the
    rest, recorded from a contiguous cache."""
    ids = list(ids)
    cache = model.new_cache(len(ids) + 300)
    new = [sample(model.prefill(ids, cache))]
    drafter = PromptLookup()
    for _ in range(250):
        drafts = drafter.propose(ids + new, k)
        before = cache.length
        rows = model.forward([new[-1]] + drafts, cache, all_logits=True)
        after_verify = cache.length
        choices = [sample(r) for r in rows]
        accepted = 0
        while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
            accepted += 1
        cache.truncate(len(ids) + len(new) + accepted)
        if len(drafts) == k and 1 < accepted < k:
            return {"context": ids + new,
                    "context_text": model.decode_text((ids + new)[-12:]),
                    "drafts": drafts, "drafts_text": model.decode_text(drafts),
                    "choices": choices, "accepted": accepted, "own_token": choices[accepted],
                    "own_token_text": model.decode_text([choices[accepted]]),
                    "refused_text": model.decode_text([drafts[accepted]]),
                    "newest_text": model.decode_text([new[-1]]),
                    "cache_before": before, "cache_after_verify": after_verify,
                    "cache_after_truncate": cache.length}
        new += drafts[:accepted] + [choices[accepted]]
    raise RuntimeError("no pass kept some drafts and refused others")


# ---- 4. the rejection rule keeps the distribution -------------------------------------------

def rejection_rule(model: kvlab.Model, prompt: str, draws: int = 20000, seed: int = 0) -> dict:
    """At one position: p, the model's distribution (temperature 1), and q, the distribution
    of a drafter made of the model's first 2 layers. The rule's output distribution worked
    out exactly, and `draws` seeded runs of the kit's verify_drafts with one draft drawn from q."""
    ids = model.encode(prompt)
    p_logits = model.forward(ids)
    q_logits = DraftModel.first_layers(model, 2).model.forward(ids)
    p = probabilities(p_logits, 1.0, None, None)
    q = probabilities(q_logits, 1.0, None, None)
    kept = np.minimum(p, q)                               # q(x) min(1, p(x)/q(x))
    residual = np.maximum(p - q, 0.0)
    exact = kept + (1 - kept.sum()) * residual / residual.sum()
    rng = np.random.default_rng(seed)
    rows = np.stack([p_logits, p_logits])                # the bonus row is never used here
    counts = np.zeros_like(p)
    for _ in range(draws):
        x = _draw(q, rng)
        accepted, token = verify_drafts(rows, [x], [q], (1.0, None, None, rng))
        counts[x if accepted else token] += 1
    empirical = counts / draws
    plain = np.bincount([_draw(p, rng) for _ in range(draws)], minlength=p.size) / draws

    def tv(a, b):
        return float(0.5 * np.abs(a - b).sum())
    return {"prompt": prompt, "temperature": 1.0, "draws": draws, "seed": seed,
            "draft_acceptance_probability": float(kept.sum()),
            "tv_q_vs_p": tv(q, p), "exact_rule_max_error": float(np.abs(exact - p).max()),
            "tv_rule_draws_vs_p": tv(empirical, p), "tv_plain_draws_vs_p": tv(plain, p),
            "most_likely": {"token": int(np.argmax(p)),
                            "text": model.decode_text([int(np.argmax(p))]),
                            "p": float(p.max()), "q": float(q[np.argmax(p)]),
                            "rule_draws": float(empirical[np.argmax(p)])}}



# ---- 5. acceptance against speedup --------------------------------------------------------

def tokens_per_pass(alpha, k):
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens per pass when each of k drafts is
    accepted with probability alpha, given the ones before it were (Leviathan et al.)."""
    alpha = np.asarray(alpha, dtype=float)
    k = np.asarray(k, dtype=float)
    safe = np.minimum(alpha, 1 - 1e-12)
    return np.where(alpha >= 1.0, k + 1, (1 - safe ** (k + 1)) / (1 - safe))


class Oracle:
    """Drafts the plain run's own next tokens, each one spoiled (replaced by another
    token) with probability 1 - alpha, independently: acceptance as the formula assumes."""

    def __init__(self, truth, alpha: float, vocab: int, seed: int = 0):
        self.truth, self.alpha, self.vocab = truth, alpha, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens, k, sampling=None):
        drafts = []
        for i in range(k):
            t = self.truth[min(len(tokens) + i, len(self.truth) - 1)]
            if self.rng.random() >= self.alpha:
                t = (t + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
            drafts.append(t)
        return drafts


class Recorder:
    """A drafter around another that notes each pass's drafts, so that what each pass
    kept can be read off the output afterwards."""

    def __init__(self, inner):
        self.inner, self.log, self.seconds = inner, [], 0.0

    @property
    def passes(self):
        return getattr(self.inner, "passes", 0)

    @property
    def last_probabilities(self):
        return getattr(self.inner, "last_probabilities", None)

    def check_compatible(self, target):
        if hasattr(self.inner, "check_compatible"):
            self.inner.check_compatible(target)

    def propose(self, tokens, k, sampling=None):
        start = time.perf_counter()
        drafts = list(self.inner.propose(tokens, k, sampling))[:k]
        self.seconds += time.perf_counter() - start
        self.log.append((len(tokens), drafts))
        return drafts


def what_passes_kept(log, full) -> dict:
    """Per pass: drafts proposed and kept (a refused draft never equals the token put in
    its place, greedy or sampled, so the kept ones are the prefix that matches the output)."""
    proposed, kept = [], []
    for position, drafts in log:
        a = 0
        while a < len(drafts) and position + a < len(full) and drafts[a] == full[position + a]:
            a += 1
        proposed.append(len(drafts))
        kept.append(a)
    proposed, kept = np.array(proposed), np.array(kept)
    refusals = int(np.sum(kept < proposed))
    accepted = int(kept.sum())
    alpha = accepted / (accepted + refusals) if accepted + refusals else 0.0
    return {"proposed": proposed, "kept": kept, "accepted": accepted, "refusals": refusals,
            "drafted": int(proposed.sum()), "alpha": alpha,
            "passes_without_drafts": int(np.sum(proposed == 0))}


def timed(work):
    start = time.perf_counter()
    out = work()
    return time.perf_counter() - start, out


def decode_seconds(out) -> float:
    """The time of a generate() call after its first token: the prompt's pass and the
    call's setup left out, since plain and speculative decoding pay them alike."""
    return float(np.sum(out.step_seconds[1:]))


def speed_runs(configs: list, rounds: int, cost_table: dict, draft_cost: dict) -> list:
    """Every config: plain decoding (generate's C loop, fast=True, its default, and the
    same Python loop per token that speculation runs per pass, fast=False) and speculative
    decoding, run in turn in every round. Times are the decode part of each run (after the
    first token); a speedup is the median over the rounds of plain time / speculative time
    in the same round (neighbours in time meet the same load from other processes)."""
    times = {i: {"plain_python": [], "plain_c": [], "speculative": []} for i in range(len(configs))}
    drafter_ms = {i: [] for i in range(len(configs))}      # per round: drafting ms per pass
    outs = {}
    for _ in range(rounds):
        plains = {}                           # configs that differ only in the drafter share
        for i, c in enumerate(configs):       # their plain runs within a round
            m, prompt, n, kw = c["model"], c["prompt"], c["new_tokens"], c["sampling"]
            key = (str(prompt), n, str(kw))
            if key not in plains:
                plain = kvlab.generate(m, prompt, n, fast=False, **kw)
                fast = kvlab.generate(m, prompt, n, **kw)
                assert fast.tokens == plain.tokens
                plains[key] = (plain, decode_seconds(plain), decode_seconds(fast))
            plain, t_python, t_c = plains[key]
            times[i]["plain_python"].append(t_python)
            times[i]["plain_c"].append(t_c)
            drafter = Recorder(c["drafter"](plain.tokens))
            spec = kvlab.generate(m, prompt, n, speculate=drafter, draft_tokens=c["k"], **kw)
            times[i]["speculative"].append(decode_seconds(spec))
            drafter_ms[i].append(1000 * drafter.seconds / spec.speculation.verify_passes)
            if not kw:
                assert spec.tokens == plain.tokens, "speculation changed the greedy output"
            outs[i] = (spec, drafter)
    rows = []
    one_ms = cost_table["rows"][0]["ms"]["median"]
    for i, c in enumerate(configs):
        spec, drafter = outs[i]
        s = spec.speculation
        full = spec.prompt_tokens + spec.tokens
        kept = what_passes_kept(drafter.log, full)
        decoded = s.tokens - 1                     # tokens after the prompt's pass
        passes = s.verify_passes
        # the formula, pass by pass: a pass with n drafts yields (1 - a^(n+1)) / (1 - a)
        as_drafted = float(np.mean(tokens_per_pass(kept["alpha"], kept["proposed"])))
        # predicted time in units of one plain decode step: what each pass cost in the
        # table (1 + n new tokens), plus the drafter's own passes
        units = sum(relative_cost(cost_table, n + 1) for n in kept["proposed"])
        units += s.draft_passes * draft_cost.get(c["drafter_name"], 0.0)
        t = {name: spread(1000 * np.array(v)) for name, v in times[i].items()}
        per_round = [p / q for p, q in zip(times[i]["plain_python"], times[i]["speculative"])]
        per_round_c = [p / q for p, q in zip(times[i]["plain_c"], times[i]["speculative"])]
        rows.append({
            "model": c["model"].config.name, "text": c["text"], "drafter": c["drafter_name"],
            "completion_start": spec.completion[:80],
            "sampling": "greedy" if not c["sampling"] else (
                f"temperature {c['sampling']['temperature']}, top_k {c['sampling']['top_k']}"),
            "alpha_set": c.get("alpha"), "k": c["k"], "new_tokens": s.tokens,
            "decoded_tokens": decoded, "passes": passes, "tokens_per_pass": decoded / passes,
            "acceptance_rate_kit": s.acceptance_rate, "alpha_measured": kept["alpha"],
            "acceptance_by_position": s.acceptance_by_position,
            "proposed_at": list(s.proposed_at), "accepted_at": list(s.accepted_at),
            "drafted": kept["drafted"], "accepted": kept["accepted"],
            "refusals": kept["refusals"], "passes_without_drafts": kept["passes_without_drafts"],
            "draft_passes": s.draft_passes,
            "drafter_ms_per_pass": spread(drafter_ms[i]),
            "tokens_per_pass_formula_k": float(tokens_per_pass(kept["alpha"], c["k"])),
            "tokens_per_pass_formula_as_drafted": as_drafted,
            "speedup_predicted": decoded / units,
            "decode_ms": t,
            "plain_c_ms_per_token": t["plain_c"]["median"] / decoded,
            "plain_python_ms_per_token": t["plain_python"]["median"] / decoded,
            "speedup_vs_python_loop": float(np.median(per_round)),
            "speedup_vs_python_loop_rounds": spread(per_round),
            "speedup_vs_c_loop": float(np.median(per_round_c)),
            "speedup_vs_c_loop_rounds": spread(per_round_c),
        })
    return rows


# ---- figures -------------------------------------------------------------------------------

def plot_pass_cost(table, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    n = [r["new_tokens"] for r in table["rows"]]
    med = np.array([r["relative_to_one"] for r in table["rows"]])
    lo = med - np.array([r["relative"]["min"] for r in table["rows"]])
    hi = np.array([r["relative"]["max"] for r in table["rows"]]) - med
    left.errorbar(n, med, yerr=[lo, hi], fmt="o-", capsize=3,
                  label=f"SmolLM2-135M ({table['threads']} thread), "
                        f"{table['rows'][0]['ms']['median']:.1f} ms for 1")
    left.plot(n, n, ":", color="grey", label="n times one token (no sharing)")
    left.axhline(1, color="grey", lw=0.8)
    left.set_xlabel("new tokens in the pass (k drafts + 1)")
    left.set_ylabel("time of the pass / time of a 1-token pass")
    left.set_title(f"One forward pass over the cache (context {table['context']}),\n"
                   "median and range of the runs", fontsize=10)
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    w = [r["weight_bytes"] / table["rows"][0]["weight_bytes"] for r in table["rows"]]
    f = [r["flops"] / table["rows"][0]["flops"] for r in table["rows"]]
    right.plot(n, w, "o-", label="weight bytes read")
    right.plot(n, f, "s-", label="FLOPs")
    right.plot(n, med, "^--", label="time (measured)")
    right.set_xlabel("new tokens in the pass")
    right.set_ylabel("relative to a 1-token pass")
    right.set_title("SmolLM2-135M: what the core counted per pass", fontsize=10)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_step(step: dict, model: kvlab.Model, path: Path) -> None:
    def char(t):
        text = model.decode_text([t]).replace("\n", "\u21b5").replace(" ", "\u2423")
        return text if len(text) <= 7 else text[:6] + "\u2026"
    context, drafts, choices = step["context"], step["drafts"], step["choices"]
    show, k, a = 6, len(drafts), step["accepted"]   # the context's last `show` positions
    width = 1.45
    colours = {"cached": "#c8d3e6", "newest": "#7aa6e0", "kept": "#9ed39e",
               "refused": "#f2a3a3", "own": "#ffd9a0", "empty": "#ffffff"}
    fig, ax = plt.subplots(figsize=(11, 4.0))

    def box(x, y, label, kind, dashed=False):
        ax.add_patch(plt.Rectangle((x * width, y), width * 0.94, 0.5,
                                   facecolor=colours[kind],
                                   edgecolor="black" if kind != "empty" else "#999999",
                                   ls="--" if dashed else "-"))
        ax.text(x * width + width * 0.47, y + 0.25, label, ha="center", va="center",
                fontsize=9, family="monospace")

    rows = [
        (2.4, f"before the pass: the cache holds {step['cache_before']} positions; the newest "
              f"token and {k} drafts are not in it yet"),
        (1.2, "model.forward([newest] + drafts, cache, all_logits=True): "
              f"{step['cache_after_verify']} positions, and {k + 1} rows of logits"),
        (0.0, f"cache.truncate({step['cache_after_truncate']}): the refused drafts' positions "
              f"are free again"),
    ]
    for r, (y, title) in enumerate(rows):
        ax.text(-0.3, y + 0.62, title, fontsize=9, ha="left")
        for i in range(show - 1):
            box(i, y, char(context[len(context) - show + i]), "cached")
        box(show - 1, y, char(context[-1]), "empty" if r == 0 else "newest", dashed=r == 0)
        for j, d in enumerate(drafts):
            x = show + j
            if r == 0:
                box(x, y, char(d), "empty", dashed=True)
            elif r == 1:
                box(x, y, char(d), "kept" if j < a else "refused")
            elif j < a:
                box(x, y, char(d), "kept")
            elif j == a:
                box(x, y, char(step["own_token"]), "own", dashed=True)
            else:
                box(x, y, "", "empty")
        if r == 1:
            for j in range(k + 1):
                ax.text((show - 1 + j) * width + width * 0.47, y - 0.2, char(choices[j]),
                        ha="center", fontsize=8, family="monospace", color="#444444")
            ax.text((show + k) * width + 0.1, y - 0.2, "\u2190 the model's arg-max of each row",
                    fontsize=8, color="#444444")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colours[c], edgecolor="black")
               for c in ("cached", "newest", "kept", "refused", "own")]
    ax.legend(handles, ["K/V cached earlier", "newest token (K/V written by the pass)",
                        "draft kept", "draft refused", "the model's own token (next pass)"],
              fontsize=8, loc="lower center", bbox_to_anchor=(0.5, -0.12), ncol=5,
              frameon=False)
    ax.set_xlim(-0.4, (show + k) * width + 4.5)
    ax.set_ylim(-0.45, 3.2)
    ax.axis("off")
    ax.set_title(f"One speculative step of SmolLM2-135M (greedy, prompt lookup, k = {k})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def colour(row) -> str:
    """One colour per task for prompt lookup (both variants), one per L for the layers."""
    if row["drafter"].startswith("first"):
        return f"C{5 + FIRST_LAYERS.index(int(row['drafter'].split()[1])) % 5}"
    return f"C{list(TASKS).index(row['text'])}" if row["sampling"] == "greedy" else "C9"


def label(row) -> str:
    sampled = "" if row["sampling"] == "greedy" else ", sampled"
    return f"{row['drafter']}: {row['text']}{sampled}"


def plot_acceptance(oracle_rows, real_rows, table, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 6.4))
    a = np.linspace(0, 1, 101)
    for k, style in ((1, ":"), (2, "-."), (4, "-"), (8, "--")):
        left.plot(a, tokens_per_pass(a, k), style, color="grey", lw=1,
                  label=f"(1 - a^(k+1)) / (1 - a), k = {k}")
    left.plot([r["alpha_measured"] for r in oracle_rows],
              [r["tokens_per_pass"] for r in oracle_rows], "o", color="C0", mfc="none", ms=8,
              label=f"set acceptance, k = {K}")
    handles = []
    for i, row in enumerate(real_rows):
        marker = ("*" if row["drafter"] == "prompt lookup" else
                  "P" if row["drafter"] == LOOKUP_3 else "^")
        left.plot(row["alpha_measured"], row["tokens_per_pass"], marker, ms=10,
                  color=colour(row))
        handles += right.plot(row["alpha_measured"], row["speedup_vs_c_loop"], marker, ms=10,
                              color=colour(row), label=label(row))
    left.set_xlabel("a: the chance a draft is accepted, given the ones before it were")
    left.set_ylabel("tokens per forward pass of the model")
    left.set_title("Tokens per pass: the papers' formula and the kit", fontsize=10)
    left.legend(fontsize=7, loc="upper left")
    left.grid(alpha=0.3)
    own = right.plot(a, tokens_per_pass(a, K) / relative_cost(table, K + 1), "-", color="C0",
                     lw=1, label=f"formula / cost of a {K + 1}-token pass")
    speedup = np.array([r["speedup_vs_c_loop"] for r in oracle_rows])
    low = np.array([r["speedup_vs_c_loop_rounds"]["min"] for r in oracle_rows])
    high = np.array([r["speedup_vs_c_loop_rounds"]["max"] for r in oracle_rows])
    own.append(right.errorbar([r["alpha_measured"] for r in oracle_rows], speedup,
                              yerr=[speedup - low, high - speedup], fmt="o", color="C0",
                              mfc="none", ms=8, capsize=3, label="set acceptance, measured"))
    right.axhline(1, color="black", lw=0.8)
    right.set_xlabel("a (measured)")
    right.set_ylabel("speedup: plain decode time / speculative decode time")
    right.set_title(f"SmolLM2-135M, k = {K}, against generate's default loop\n"
                    "(medians and ranges over the rounds)", fontsize=10)
    right.legend(handles=own, fontsize=7, loc="upper left")
    right.grid(alpha=0.3)
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=3, frameon=False,
               title="the kit's drafters (stars: prompt lookup, pluses: after a 3-token "
                     "match only, triangles: first L layers)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_position(real_rows, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for i, row in enumerate(real_rows):
        ax = left if row["drafter"].startswith("prompt lookup") else right
        rates = row["acceptance_by_position"]
        style = {"prompt lookup": "*-", LOOKUP_3: "P--"}.get(row["drafter"], "^-")
        ax.plot(range(1, len(rates) + 1), rates, style, color=colour(row), label=label(row))
    for ax, title in ((left, "prompt lookup"), (right, "self-speculation: the first L of 30 layers")):
        ax.set_xlabel("draft position in the pass")
        ax.set_xticks(range(1, K + 1))
        ax.set_title(f"SmolLM2-135M, {title}, k = {K}", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    left.set_ylabel("share of the drafts at that position kept")
    left.set_ylim(0, 1.02)
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
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the timed runs")
    args = parser.parse_args()
    quick = args.quick
    rounds = 2 if quick else args.rounds
    pass_reps = 3 if quick else 25
    new_tokens = 24 if quick else 120          # per timed run (the self-speculation runs: 80)
    self_tokens = 16 if quick else 60
    first_layers = [15] if quick else FIRST_LAYERS
    alphas = [0.0, 1.0] if quick else ALPHAS
    tasks = ["repeat a paragraph", "a story"] if quick else list(TASKS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kvlab.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    sections = {}

    def clock(name):
        sections[name] = round(time.perf_counter() - started - sum(sections.values()), 1)

    smol = common.smollm2()
    model = kvlab.load()
    mha = kvlab.load(kvlab.MHA_MODEL)
    clock("load")

    # 1. pass costs
    table = pass_costs(smol, pass_reps)
    print(table["model"], "  ".join(f"{r['new_tokens']}: {r['ms']['median']:.2f} ms "
                                    f"({r['relative_to_one']:.2f}x)" for r in table["rows"]))
    drafter_models = {f"first {n} layers": DraftModel.first_layers(smol, n).model
                      for n in first_layers}
    draft_costs = draft_pass_costs(smol, drafter_models, pass_reps)
    draft_cost = {name: s["median"] for name, s in draft_costs.items()
                  if name != "model_one_token_ms"}
    print("draft pass / model pass:", draft_cost)
    clock("pass costs")

    # 2. same tokens
    exact = exactness(smol, model, mha, tasks[:1] if quick else tasks[:3],
                      [4] if quick else [1, 2, 4, 8], 16 if quick else 40)
    print(f"greedy: {exact['identical']} of {exact['runs']} runs identical to plain decoding")
    paged = paged_by_hand(model, TEXTS["fresh"])
    print("paged, by hand:", paged)
    clock("exactness")

    # 3. one step
    step = one_step(smol, chat_ids(smol, "past tense"))
    print("one step:", {k: v for k, v in step.items() if k != "context"})

    # 4. the rejection rule
    rule = rejection_rule(model, "ROMEO:\nBut soft, what light through yonder ",
                          draws=2000 if quick else 20000)
    print("rejection rule:", rule)
    clock("step and rule")

    # 5. acceptance against speedup, on SmolLM2
    configs = []
    story = chat_ids(smol, "a story")
    for alpha in alphas:
        configs.append({"prompt": story, "new_tokens": new_tokens, "sampling": {},
                        "text": "a story, set acceptance", "alpha": alpha,
                        "drafter_name": "oracle",
                        "drafter": lambda truth, alpha=alpha: Oracle(
                            story + truth, alpha, smol.config.vocab_size, seed=1)})
    for task in tasks:
        configs.append({"prompt": chat_ids(smol, task), "new_tokens": new_tokens,
                        "sampling": {}, "text": task, "drafter_name": "prompt lookup",
                        "drafter": lambda truth: PromptLookup()})
        # drafts only after a match of 3 tokens: fewer drafts, each more likely kept
        configs.append({"prompt": chat_ids(smol, task), "new_tokens": new_tokens,
                        "sampling": {}, "text": task, "drafter_name": LOOKUP_3,
                        "drafter": lambda truth: PromptLookup(ngram=3, min_ngram=3)})
    if not quick:
        configs.append({"prompt": chat_ids(smol, "summary"), "new_tokens": new_tokens,
                        "sampling": SAMPLED, "text": "summary",
                        "drafter_name": "prompt lookup", "drafter": lambda truth: PromptLookup()})
    self_task = "past tense" if not quick else tasks[0]
    for n in first_layers:
        configs.append({"prompt": chat_ids(smol, self_task), "new_tokens": self_tokens,
                        "sampling": {}, "text": self_task, "drafter_name": f"first {n} layers",
                        "drafter": lambda truth, n=n: DraftModel.first_layers(smol, n)})
    for c in configs:
        c.update(model=smol, k=K)
    rows = speed_runs(configs, rounds, table, draft_cost)
    clock("speed")
    oracle_rows = [r for r in rows if r["drafter"] == "oracle"]
    real_rows = [r for r in rows if r["drafter"] != "oracle"]
    for r in rows:
        print(f"{r['drafter']:<18}{r['text']:<26}{r['sampling'][:8]:<9}"
              f"a {r['alpha_measured']:.2f} kit {r['acceptance_rate_kit']:.2f}  "
              f"tok/pass {r['tokens_per_pass']:.2f} (formula {r['tokens_per_pass_formula_k']:.2f})"
              f"  by position {[round(x, 2) for x in r['acceptance_by_position']]}  "
              f"vs C {r['speedup_vs_c_loop']:.2f}x "
              f"[{r['speedup_vs_c_loop_rounds']['min']:.2f}-"
              f"{r['speedup_vs_c_loop_rounds']['max']:.2f}], vs Python "
              f"{r['speedup_vs_python_loop']:.2f}x, predicted {r['speedup_predicted']:.2f}x  "
              f"drafting {r['drafter_ms_per_pass']['median']:.3f} ms/pass")

    plot_pass_cost(table, out / "ch09_pass_cost.png")
    plot_step(step, smol, out / "ch09_step.png")
    plot_acceptance(oracle_rows, real_rows, table, out / "ch09_acceptance.png")
    plot_position(real_rows, out / "ch09_position.png")

    ch07 = json.loads((HERE / "ch07.json").read_text())
    cost = relative_cost(table, K + 1)
    grid = np.linspace(0, 1, 10001)

    def break_even(c):     # the acceptance above which k = 4 beats plain decoding
        beats = tokens_per_pass(grid, K) >= c
        return float(grid[np.argmax(beats)]) if beats.any() else None
    five = next(r for r in table["rows"] if r["new_tokens"] == K + 1)["relative"]
    summary = {
        # the most a pass of k drafts can give: k + 1 tokens for the price of that pass
        "best_speedup_k4": (K + 1) / cost,
        "best_speedup_k4_middle_half": [(K + 1) / five["q3"], (K + 1) / five["q1"]],
        # the acceptance above which k = 4 beats plain decoding, drafts costing nothing
        "break_even_alpha_k4": break_even(cost),
        "break_even_alpha_k4_middle_half": [break_even(five["q1"]), break_even(five["q3"])],
        "one_token_pass_ms": table["rows"][0]["ms"]["median"],
        "plain_c_ms_per_token": float(np.median([r["plain_c_ms_per_token"] for r in rows])),
        "plain_python_ms_per_token": float(np.median([r["plain_python_ms_per_token"]
                                                      for r in rows])),
        "largest_deviation_from_prediction": float(max(
            abs(r["speedup_vs_python_loop"] / r["speedup_predicted"] - 1) for r in oracle_rows)),
        "prompt_lookup_ms_per_pass": [f(r["drafter_ms_per_pass"]["median"] for r in real_rows
                                        if r["drafter"].startswith("prompt lookup"))
                                      for f in (min, max)],
    }
    result = {
        "setup": {**common.machine(), "threads": kvlab.get_num_threads(),
                  "machine_note": "a shared 2-core virtual machine, quiet during the final "
                                  "run (load average about 1); ratios are taken run by run",
                  "quick": quick, "rounds": rounds, "pass_reps": pass_reps, "k": K,
                  "new_tokens": new_tokens, "self_speculation_new_tokens": self_tokens,
                  "load_average_before_after": [list(load_before), list(os.getloadavg())],
                  "models": {m.config.name: {"params": m.n_params,
                                             "params_millions": m.n_params / 1e6,
                                             "weights_bytes": m.weights_nbytes,
                                             "weights_mb": m.weights_nbytes / 1e6,
                                             "n_layers": m.config.n_layers}
                             for m in (smol, model, mha)},
                  "smollm2_weights": "Q4_1 GGUF, int8 activations (kvlab.load's defaults)",
                  "tasks": TASKS, "sampled": SAMPLED,
                  "timing": "decode time of generate() calls (the steps after the first "
                            "token); every configuration runs plain (fast=True, generate's "
                            "default C loop, and fast=False, the Python loop) and speculative "
                            "in turn, in each round; speedups: the median of the per-round "
                            "ratios, with their range",
                  "seconds": None},
        "facts": FACTS,
        "pass_cost": table,
        "draft_pass_cost_relative": draft_costs,
        "exactness": exact,
        "paged_by_hand": paged,
        "step": {k: v for k, v in step.items() if k != "context"},
        "rejection_rule": rule,
        "oracle": oracle_rows,
        "drafters": real_rows,
        "summary": summary,
        "ridge_from_ch07": {"cpu_flops_per_byte": ch07["intensity_flops_per_byte"]["cpu_ridge"],
                            "cpu_read_gb_per_s": ch07["cpu"]["read_bytes_per_s"] / 1e9,
                            "cpu_threads": ch07["setup"]["kvlab_threads"],
                            "h200_flops_per_byte": ch07["intensity_flops_per_byte"]["h200_ridge"]},
    }
    clock("plots")
    result["setup"]["seconds"] = round(time.perf_counter() - started, 1)
    result["setup"]["seconds_by_part"] = sections
    print(sections)
    (out / "ch09.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out} in {result['setup']['seconds']} s")


if __name__ == "__main__":
    main()
