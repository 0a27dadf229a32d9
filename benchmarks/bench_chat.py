"""What a newcomer's `kvlab chat` costs: load, first answer, later turns over the kept cache.

    python benchmarks/bench_chat.py [--rounds 3] [--threads 2] [--json out.json]

For each activation kind (float32, as `kvlab chat` runs, and int8) and each round, in a
fresh Chat over the named model smollm2-135m (fetched once into the cache folder):
  * load: kvlab.load's seconds (the file read, the tokenizer built);
  * first turn: seconds from send() to the first token (the prefill of the template and the
    question) and to the whole answer;
  * second turn: the tokens reused from the cache and prefilled, and the seconds to its
    first token, against a fresh Chat sent the whole conversation at once (no reuse);
  * decode: the answers' tokens per second.
Medians over the rounds, the two kinds alternating. The issue's target: the first answer
within 2 s of the question. Skips (exit 0) where the model cannot be fetched.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import kvlab

QUESTIONS = ("What is the capital of France?", "And of Germany? Answer in one sentence.")
KINDS = {"fp32 activations": "fp32", "int8 activations": "int8"}


def one_round(path: Path, activations: str, max_new_tokens: int) -> dict:
    start = time.perf_counter()
    model = kvlab.load(path, activations=activations)
    load = time.perf_counter() - start
    chat = kvlab.Chat(model, max_seq_len=1024)
    first = chat.send(QUESTIONS[0], max_new_tokens)
    second = chat.send(QUESTIONS[1], max_new_tokens)
    # the same second turn with nothing to reuse: the whole conversation prefilled at once
    fresh = kvlab.Chat(model, max_seq_len=1024)
    fresh.messages = chat.messages[:2]
    no_reuse = fresh.send(QUESTIONS[1], max_new_tokens)
    decode = [t.tokens_per_second for t in (first, second) if len(t.tokens) > 1]
    return {"load_s": load, "first_token_s": first.first_token_seconds,
            "first_answer_s": first.seconds, "first_answer": first.reply,
            "second_reused": second.reused, "second_prefilled": second.prefilled,
            "second_first_token_s": second.first_token_seconds,
            "no_reuse_prefilled": no_reuse.prefilled,
            "no_reuse_first_token_s": no_reuse.first_token_seconds,
            "decode_tok_s": statistics.median(decode) if decode else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        path = kvlab.fetch("smollm2-135m")
    except kvlab.FetchError as error:
        print(f"skipped: {error}")
        return 0
    kvlab.set_num_threads(args.threads)
    runs = {name: [] for name in KINDS}
    for r in range(args.rounds):
        order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
        for name in order:
            runs[name].append(one_round(path, KINDS[name], args.max_new_tokens))
    medians = {name: {key: statistics.median(run[key] for run in rounds)
                      for key in rounds[0] if key != "first_answer"}
               for name, rounds in runs.items()}
    print(f"kvlab chat on {path.name}, {args.threads} threads, medians of {args.rounds} rounds")
    print(f"{'':18}{'load s':>8}{'1st token s':>12}{'1st answer s':>13}{'2nd: reused':>12}"
          f"{'prefilled':>10}{'1st token s':>12}{'no reuse s':>11}{'decode tok/s':>13}")
    for name, m in medians.items():
        print(f"{name:18}{m['load_s']:>8.2f}{m['first_token_s']:>12.3f}{m['first_answer_s']:>13.2f}"
              f"{m['second_reused']:>12.0f}{m['second_prefilled']:>10.0f}"
              f"{m['second_first_token_s']:>12.3f}{m['no_reuse_first_token_s']:>11.3f}"
              f"{m['decode_tok_s']:>13.1f}")
        print(f"{'':18}first answer: {runs[name][0]['first_answer']!r}")
    ok = all(m["first_answer_s"] <= 2.0 for m in medians.values())
    print(f"first answer within 2 s of the question: {'yes' if ok else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": path.name, "threads": args.threads,
                                               "rounds": runs, "medians": medians}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
