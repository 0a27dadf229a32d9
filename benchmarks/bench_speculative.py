"""Speculative decoding against plain greedy decoding, side by side (issue 20).

For each text (one where prompt lookup helps: repetitive; one where it helps less: fresh
prose) and each drafter, runs plain decoding and speculative decoding in turn, several
rounds, and reports the best wall time of each, their ratio, the acceptance rate and the
forward passes saved. The outputs are checked identical every time. Prints a table and
writes JSON (benchmarks/results/speculative.json unless --out says otherwise).

    python benchmarks/bench_speculative.py [--model PATH] [--new-tokens 200] [--rounds 3]
                                           [--only generate|engine|passes]

Plain decoding here is generate(fast=False), the same Python loop per token that
speculation runs per pass, so the ratio measures passes saved, not the C token loop
(generate's default, fast=True, which runs every decode step in C).

Speculation pays when a pass over 1 + k tokens costs little more than a pass over one,
which is when a pass is bound by reading the weights. The second table says how much a
pass costs against the tokens it runs, on the model given or (--shape 110m) on random
weights of the Llama-2-style 110M shape, at a context of 256.

The third table is the batching engine (kvlab.Engine) with and without speculation (prompt
lookup), in turn: B greedy requests whose prompts repeat themselves, generated tokens per
second of wall time (best of the rounds), the engine's steps (one forward call each) and
the drafts kept; the outputs are checked identical every time.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import kvlab
from kvlab.speculative import DraftModel, PromptLookup

TEXTS = {
    "repetitive": "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 3 + "ROMEO:\n",
    "fresh": "KING HENRY:\nNow, lords, the field is ours, and yet the day\n",
}


def timed(work):
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def pass_costs(model, rounds: int, context: int = 256, sizes=(1, 2, 3, 5, 9)) -> dict:
    """Best milliseconds of one forward pass over n new tokens after `context` cached ones
    (the drafts are cut off again after each, as speculation does)."""
    cache = model.new_cache(context + max(sizes))
    model.prefill([t % model.config.vocab_size for t in range(1, context + 1)], cache)
    costs = {}
    for n in sizes:
        best = float("inf")
        for _ in range(max(3, rounds)):
            start = time.perf_counter()
            model.forward([7 + i for i in range(n)], cache, all_logits=True)
            best = min(best, time.perf_counter() - start)
            cache.truncate(context)
        costs[n] = best * 1000
    return costs


def engine_rows(model, rounds: int, new_tokens: int, k: int, batches=(1, 8)) -> list:
    """The engine with and without speculation, side by side (see the module text)."""
    text = TEXTS["repetitive"]
    rows = []
    for batch in batches:
        prompts = [text[7 * i:] for i in range(batch)]        # a different start each
        blocks = batch * -(-(len(text) + new_tokens) // 16) + 8
        best, runs = {}, {}
        for _ in range(rounds):                # in turn, so both meet the same machine
            for name, speculate in (("plain", None), ("speculative", PromptLookup())):
                engine = kvlab.Engine(model, num_blocks=blocks, speculate=speculate,
                                      draft_tokens=k)
                for prompt in prompts:
                    engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens,
                                                                    stop_at_eos=False))
                seconds, outputs = timed(lambda: engine.run(progress=False))
                runs[name] = engine, {rid: o.outputs[0].tokens for rid, o in outputs.items()}
                best[name] = min(best.get(name, float("inf")), seconds)
            assert runs["plain"][1] == runs["speculative"][1], "speculation changed the output"
        plain, spec = runs["plain"][0], runs["speculative"][0]
        s = spec.speculation
        rows.append({"batch": batch, "k": k, "new_tokens": new_tokens,
                     "plain_tok_s": batch * new_tokens / best["plain"],
                     "speculative_tok_s": batch * new_tokens / best["speculative"],
                     "speedup": best["plain"] / best["speculative"],
                     "steps_plain": len(plain.metrics), "steps_speculative": len(spec.metrics),
                     "acceptance": s.acceptance_rate, "passes_saved": s.passes_saved})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "speculative.json"))
    parser.add_argument("--shape", choices=["110m"], default=None,
                        help="also time passes on random weights of this shape")
    parser.add_argument("--only", choices=["generate", "engine", "passes"], default=None,
                        help="run one of the three parts")
    args = parser.parse_args()
    parts = [args.only] if args.only else ["generate", "passes", "engine"]
    model = kvlab.load(args.model)
    drafters = {"prompt lookup": lambda: PromptLookup(),
                "first 2 layers": lambda: DraftModel.first_layers(model, 2)}
    if args.model is None:
        drafters["MHA model (same size)"] = lambda: DraftModel(kvlab.load(kvlab.MHA_MODEL))
    rows = []
    texts = TEXTS if "generate" in parts else {}
    for text_name, text in texts.items():
        for drafter_name, make in drafters.items():
            drafter = make()
            best_plain = best_spec = float("inf")
            for _ in range(args.rounds):          # in turn, so both meet the same machine
                t_plain, plain = timed(lambda: kvlab.generate(model, text, args.new_tokens,
                                                              fast=False))
                t_spec, spec = timed(lambda: kvlab.generate(
                    model, text, args.new_tokens, speculate=drafter,
                    draft_tokens=args.draft_tokens))
                assert spec.tokens == plain.tokens, "speculation changed the output"
                best_plain, best_spec = min(best_plain, t_plain), min(best_spec, t_spec)
            s = spec.speculation
            rows.append({"text": text_name, "drafter": drafter_name, "k": args.draft_tokens,
                         "plain_s": best_plain, "speculative_s": best_spec,
                         "speedup": best_plain / best_spec, "acceptance": s.acceptance_rate,
                         "passes": 1 + s.verify_passes, "passes_plain": s.tokens,
                         "passes_saved": s.passes_saved, "draft_passes": s.draft_passes})
    print(f"{model!r}, {args.new_tokens} new tokens, k = {args.draft_tokens}, best of "
          f"{args.rounds} rounds in turn")
    if rows:
        print_generate_rows(rows)
    costs = {repr(model): pass_costs(model, args.rounds)} if "passes" in parts else {}
    if "passes" in parts and args.shape == "110m":
        config = kvlab.ModelConfig(dim=768, hidden_dim=2048, n_layers=12, n_heads=12,
                                   n_kv_heads=12, head_dim=64, vocab_size=32000,
                                   max_seq_len=1024, name="110M shape, random weights")
        big = kvlab.Model(config, kvlab.Weights.random(config, seed=0))
        costs[repr(big)] = pass_costs(big, args.rounds)
    if costs:
        print("\nthe cost of one pass against the new tokens it runs (context 256), "
              "relative to one token")
    for name, by_n in costs.items():
        print(f"  {name}")
        print("    " + "  ".join(f"{n} tok: {ms:.2f} ms ({ms / by_n[1]:.2f}x)"
                                  for n, ms in by_n.items()))
    engine = engine_rows(model, args.rounds, args.new_tokens, args.draft_tokens) \
        if "engine" in parts else []
    if engine:
        print(f"\nkvlab.Engine, greedy, repetitive prompts, prompt lookup (k = {args.draft_tokens})"
              f" against none")
        print(f"{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}"
              f"{'steps':>14}{'accept':>8}")
        for r in engine:
            print(f"{r['batch']:>6}{r['plain_tok_s']:>13,.0f}{r['speculative_tok_s']:>12,.0f}"
                  f"{r['speedup']:>8.2f}x{r['steps_speculative']:>6} of {r['steps_plain']:<4}"
                  f"{r['acceptance']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": repr(model), "rows": rows,
                               "pass_ms_by_new_tokens": costs, "engine_rows": engine},
                              indent=2))
    print(f"wrote {out}")


def print_generate_rows(rows: list) -> None:
    print(f"{'text':<11}{'drafter':<23}{'accept':>7}{'passes':>12}{'draft':>7}"
          f"{'plain s':>9}{'spec s':>8}{'speedup':>9}")
    for r in rows:
        print(f"{r['text']:<11}{r['drafter']:<23}{r['acceptance']:>7.2f}"
              f"{r['passes']:>5} of {r['passes_plain']:<4}{r['draft_passes']:>7}"
              f"{r['plain_s']:>9.3f}{r['speculative_s']:>8.3f}{r['speedup']:>8.2f}x")


if __name__ == "__main__":
    main()
