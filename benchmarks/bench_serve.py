"""Serving measured in latency: the Engine under Poisson arrivals, at several request rates.

    python benchmarks/bench_serve.py [--rates 50,200,400] [--requests 40] [--budgets 64,256]
                                     [--memory paged,contiguous] [--json out.json]
                                     [--plot out.png]

kvlab.serving's sweep (also `kvlab serve-bench`): requests arrive as a Poisson process at
each rate (prompts cut from the bundled model's text, 16-95 new tokens each), and one
Engine serves them in real time, each request's latency counted from its arrival. Per rate
and per max_batch_tokens (chunked prefill's budget: a bigger budget finishes prompts
sooner, a smaller one keeps decode steps short) it prints throughput (generated tokens a
second), TTFT and TPOT p50/p99, and end-to-end p50/p99, on a paged pool and on contiguous
caches of the same bytes. Greedy, fp32 cache.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvlab
from kvlab import serving
from kvlab.cli import check_writable


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="50,200,400", help="requests a second, comma-separated")
    parser.add_argument("--requests", type=int, default=40, help="requests per run")
    parser.add_argument("--budgets", default="64,256", help="max_batch_tokens values")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", default="paged,contiguous",
                        help="paged and/or contiguous, comma-separated")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of throughput and latency against the request rate")
    args = parser.parse_args(argv)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:                 # refused now, not after every run (as kvlab serve-bench does)
            try:
                check_writable(path, option)
            except ValueError as error:
                parser.error(str(error))
    model = kvlab.load()
    rows = serving.sweep(model, [float(r) for r in args.rates.split(",")],
                         [int(b) for b in args.budgets.split(",")], args.requests, args.seed,
                         memories=args.memory.split(","))
    if args.plot:
        serving.plot(rows, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": "bundled", "threads": kvlab.get_num_threads(),
                                               "requests_per_run": args.requests, "runs": rows},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
