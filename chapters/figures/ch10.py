"""Figures and numbers for chapter 10, "Choosing weight codes: RTN, AWQ, GPTQ".

    python chapters/figures/ch10.py [--out DIR] [--threads N] [--sections 1,2,3,4] [--quick]

Writes ch10_outliers.png, ch10_methods.png and ch10.json (every number the chapter quotes,
with the setup; "facts": those it quotes from elsewhere, with their sources; "quoted":
numbers the prose prints whole). The real model is SmolLM2-135M-Instruct
(kvlab.load("smollm2-135m")): its file stores Q4_1 matrices and a Q8_0 embedding and holds
no float weights, so "the float model" is the file's values in float32, as in chapter 6.
The evaluation text is the opening of Tiny Shakespeare (common.english_text()), the
calibration text a stretch from its middle that the evaluation never reads. The sections
can be run separately (--sections): the ones not run keep their numbers from the
ch10.json already in DIR. Sections:

1. Activation outliers: the calibration inputs of every layer matrix of SmolLM2
   (kvlab.weight_quantization.calibrate), mean |x| per input channel; per layer and input,
   the largest channel over the median one.
2. The methods on SmolLM2: round to nearest, AWQ and GPTQ
   (kvlab.weight_quantization.quantize_weights), each into Q8_0, Q4_0 and Q4_1 (the 210
   layer matrices; the embedding stays the file's Q8_0), against the float model with
   float32 activations (kvlab.accuracy.compare_models): perplexity, KL, top-1 agreement,
   bytes, and the seconds each method took; AWQ's alpha per layer; each 4-bit model's
   greedy answer to a chat question (the weights load and generate).
3. The same on the bundled model (kvlab/assets/shakespeare-1m.bin, trained in float32 by
   this project: a true float reference), on its held-out text.
4. Decode speed per format on SmolLM2 (int8 activations, the kit's default for block
   formats): each format's weights (round to nearest's; AWQ's and GPTQ's are the same
   bytes) and the file, interleaved rounds of the decode timing of
   benchmarks/bench_real_model.py (medians and spreads).

The full run takes about 20-40 minutes on the shared 2-core machine (GPTQ's column loop
and AWQ's grid, three formats each); --quick about two minutes, on the bundled model.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvlab  # noqa: E402
from common import (chosen_sections, earlier_sections, english_text,  # noqa: E402
                    machine, shared_folder, smollm2, spread)
from kvlab import accuracy, chat  # noqa: E402
from kvlab import weight_quantization as wq  # noqa: E402
from kvlab.model import Model  # noqa: E402

HERE = Path(__file__).resolve().parent
FORMATS = ("q8_0", "q4_0", "q4_1")
METHODS = ("rtn", "awq", "gptq")
LABELS = {"rtn": "round to nearest", "awq": "AWQ scales", "gptq": "GPTQ"}
INPUTS = ("attn", "wo", "ffn", "w2")
INPUT_LABELS = {"attn": "wq/wk/wv input", "wo": "wo input", "ffn": "w1/w3 input",
                "w2": "w2 input"}
QUESTION = "What is the capital of France?"
DECODE_ROUNDS = 9
FACTS = {
    "awq": {
        "value": {"alpha_grid": 20, "salient_share": 0.01},
        "source": "Lin et al., AWQ, 2024 (arXiv:2306.00978): scales s = s_X ** alpha from the "
                  "average activation magnitude per input channel, alpha searched on a grid of "
                  "20 in [0, 1); protecting 1 % of salient weight channels, chosen by "
                  "activation, recovers most of the loss"},
    "gptq": {
        "value": {"block": 128, "damp": 0.01},
        "source": "Frantar et al., GPTQ, 2023 (arXiv:2210.17323): columns in a fixed order, "
                  "the inverse Hessian through its Cholesky factor, lazy batch updates of "
                  "128 columns, dampening of 1 % of the mean diagonal"},
    "outliers": {
        "value": {"threshold": 6.0},
        "source": "Dettmers et al., LLM.int8(), 2022 (arXiv:2208.07339): hidden-state "
                  "features of magnitude up to 20x the rest appear in a few dimensions of "
                  "every layer in models from 6.7B parameters on; a magnitude of 6 "
                  "separates them"},
}
# SmolLM2's methods per format: its file is Q4_1 already, so Q4_1's round to nearest gives
# the file back (KL 0: the rows say so) and AWQ and GPTQ can only return it too (AWQ's
# alpha 0 has no error, GPTQ has no error to feed back; tests/test_weight_quantization.py);
# Q8_0's AWQ and GPTQ are measured on the bundled model only (section 3), for time
SMOLLM2_METHODS = {"q8_0": ("rtn",), "q4_0": METHODS, "q4_1": ("rtn",)}
SECTION_KEYS = {
    1: ["outliers"],
    2: ["methods_smollm2", "alphas_smollm2", "answers_smollm2"],
    3: ["methods_bundled"],
    4: ["decode"],
}


# ---- text ----------------------------------------------------------------------------------

def calibration_text(n_chars: int = 20_000):
    """A stretch of Tiny Shakespeare from its middle (characters 500,000 on), which the
    evaluation (its opening) never reads; the kit's README where the file is not here."""
    shared = shared_folder()
    if shared is not None and (shared / "data" / "tinyshakespeare.txt").is_file():
        text = (shared / "data" / "tinyshakespeare.txt").read_text()
        return text[500_000:500_000 + n_chars], "tinyshakespeare.txt from character 500,000"
    readme = (HERE.parents[1] / "README.md").read_text()
    return readme[-n_chars:], "the end of README.md (tinyshakespeare.txt was not found)"


# ---- 1. outliers ---------------------------------------------------------------------------

def outliers(calibration: wq.Calibration) -> dict:
    """Per input and layer: mean |x| per channel, its largest over its median, the channel
    that holds it, and how many channels exceed 10x the median; every channel's mean |x|
    only for the layer plotted (the one whose attention input has the loudest channel), so
    that the JSON holds what the chapter and its figure show, not 30 layers of channels."""
    magnitudes = {name: np.abs(getattr(calibration, name)).mean(axis=1)   # (n_layers, in_dim)
                  for name in INPUTS}
    ratios = {name: m.max(axis=1) / np.median(m, axis=1) for name, m in magnitudes.items()}
    layer = int(np.argmax(ratios["attn"]))
    table = {"plotted_layer": layer}
    for name, magnitude in magnitudes.items():
        median = np.median(magnitude, axis=1)
        table[name] = {
            "ratio_max_over_median": ratios[name].tolist(),
            "top_channel": magnitude.argmax(axis=1).tolist(),
            "channels_over_10x_median": (magnitude > 10 * median[:, None]).sum(axis=1).tolist(),
            "in_dim": int(magnitude.shape[-1]),
            "largest_abs": float(np.abs(getattr(calibration, name)).max()),
            "plotted_layer_magnitude": magnitude[layer].tolist()}
    return table


def plot_outliers(table: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layer = table["plotted_layer"]
    for name in INPUTS:
        magnitude = np.sort(np.asarray(table[name]["plotted_layer_magnitude"]))[::-1]
        left.plot(np.arange(1, len(magnitude) + 1) / len(magnitude),
                  magnitude / np.median(magnitude), label=INPUT_LABELS[name])
        right.plot(table[name]["ratio_max_over_median"], marker=".", label=INPUT_LABELS[name])
    left.set(yscale="log", xscale="log", xlabel="share of input channels (largest first)",
             ylabel="mean |x| / the median channel's",
             title=f"SmolLM2, layer {layer}: channels by mean |x|")
    right.set(yscale="log", xlabel="layer", ylabel="largest channel / median channel",
              title="every layer: the largest channel's mean |x|")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---- 2, 3. the methods -----------------------------------------------------------------------

def run_methods(model, calibration, tokens, context: int, formats=FORMATS,
                embedding_format=None, alphas=wq.ALPHAS, methods=None) -> tuple:
    """Every method x format against the float model (methods: {format: its methods},
    default all): accuracy rows (with the seconds each method took and the format), the
    AWQ searches' alphas, and the models."""
    reference = Model(model.config, model.weights.float32(), model.tokenizer,
                      activations="fp32")
    models, seconds, chosen = {}, {}, {}
    for fmt in formats:
        for method in (methods or {}).get(fmt, METHODS):
            started = time.process_time()
            if method == "awq":
                folded, searches = wq.awq_fold(model.config, model.weights, calibration, fmt,
                                               alphas)
                weights = wq.quantize_weights(model.config, folded, fmt, "rtn",
                                              embedding_format=embedding_format)
                chosen[fmt] = {group: [s[group].alpha for s in searches]
                               for group in searches[0]}
            else:
                weights = wq.quantize_weights(model.config, model.weights, fmt, method,
                                              calibration, embedding_format=embedding_format)
            seconds[(method, fmt)] = time.process_time() - started
            models[(method, fmt)] = Model(model.config, weights, model.tokenizer,
                                          activations="fp32")
            print(f"  {fmt} {method}: {seconds[(method, fmt)]:.1f} s CPU", flush=True)
    named = {f"{method} {fmt}": m for (method, fmt), m in models.items()}
    exact, rows = accuracy.compare_models(reference, named, tokens, context)
    table = []
    for (method, fmt), row in zip(models, rows):
        table.append({**row.as_dict(), "method": method, "format": fmt,
                      "cpu_seconds": round(seconds[(method, fmt)], 1)})
        print(f"{fmt:<6}{method:<6}{row.weight_bytes:>12,} KL {row.kl:.3e} top-1 "
              f"{100 * row.top1:.2f} % ppl {row.perplexity:.3f} ({row.perplexity_change:+.2f} %)")
    return {"reference_perplexity": exact, "rows": table,
            "reference_bytes": reference.weights_nbytes}, chosen, models


def answers(model, models, fmt: str = "q4_0", max_new_tokens: int = 24) -> dict:
    """Each method's greedy answer to QUESTION in fmt with int8 activations, and the float
    model's: the quantized weights load into a Model and generate."""
    if getattr(model.tokenizer, "chat_template", None):
        _, ids = chat.prompt(model, [{"role": "user", "content": QUESTION}])
    else:                                   # the bundled model (--quick) is not a chat model
        ids = model.encode("ROMEO:\n")
    out = {"float32": kvlab.generate(model, ids, max_new_tokens=max_new_tokens).text}
    for method in METHODS:
        quantized = Model(model.config, models[(method, fmt)].weights, model.tokenizer)
        out[method] = kvlab.generate(quantized, ids, max_new_tokens=max_new_tokens).text
    return out


def plot_methods(smollm2_table: dict, bundled_table: dict, path: Path) -> None:
    """KL from the float model per format, a bar per method; a KL of 0 (the format's grid
    holds the float values already) is written as 0 at the floor, and a method not run in
    a format (SmolLM2's AWQ and GPTQ outside Q4_0) as "not run" in its bar's colour, so the
    legend never names a bar that is not there."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width, floor = 0.26, 1e-6
    for ax, table, title in ((axes[0], smollm2_table, "SmolLM2-135M (float: the file's values)"),
                             (axes[1], bundled_table, "bundled 1M model (trained in float32)")):
        rows = table["rows"]
        formats = [f for f in FORMATS if any(r["format"] == f for r in rows)]
        for i, method in enumerate(METHODS):
            kl = np.array([next((r["kl"] for r in rows if (r["method"], r["format"]) ==
                                 (method, f)), np.nan) for f in formats])
            x = np.arange(len(formats)) + (i - 1) * width
            bars = ax.bar(x, np.maximum(kl, floor), width, label=LABELS[method])
            for xi in x[kl == 0]:
                ax.text(xi, floor * 1.3, "0", ha="center", fontsize=8)
            for xi in x[np.isnan(kl)]:
                ax.text(xi, floor * 1.3, "not run", ha="center", va="bottom", rotation=90,
                        fontsize=7, color=bars.patches[0].get_facecolor())
        ax.set(yscale="log", xticks=np.arange(len(formats)), xticklabels=formats,
               ylabel="KL from the float model (nats)", title=title, ylim=(floor, None),
               xlim=(-0.5, len(formats) - 0.5))
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---- 4. decode speed -----------------------------------------------------------------------

def decode_tokens_per_second(model, steps: int) -> float:
    """bench_real_model.py's timing (a 16-token prompt of ids from 1000, then `steps`
    greedy steps in C, the median step), with ids the bundled model has too (--quick)."""
    prompt = (np.arange(16) + min(1000, model.config.vocab_size - 16)).astype(np.int32)
    cache = model.new_cache(len(prompt) + steps)
    first = int(np.argmax(model.prefill(prompt, cache)))
    _, seconds = model.decode_steps(first, cache, steps)
    return 1.0 / float(np.median(seconds))


def decode_speed(model, variants: dict, rounds: int, steps: int = 32) -> list:
    """Greedy decode tokens/s of each variant (name -> Weights), int8 activations, the
    variants in turn each round (the order alternating): medians and spreads."""
    models = {name: Model(model.config, weights, model.tokenizer)
              for name, weights in variants.items()}
    names = list(models)
    for name in names:
        decode_tokens_per_second(models[name], 4)        # warm up
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(decode_tokens_per_second(models[name], steps))
    return [{"weights": name, "weight_bytes": models[name].weights_nbytes,
             "formats": sorted(set(models[name].weights.formats.values())),
             "decode_tokens_per_s": spread(times[name])["median"],
             "spread": spread(times[name]), "rounds": times[name]} for name in names]


# ---- the run -------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--quick", action="store_true",
                        help="a short run that checks the script works (the tests run this):"
                             " the bundled model, few tokens; its numbers are not the chapter's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048, help="evaluation tokens")
    parser.add_argument("--calibration", type=int, default=512, help="calibration tokens")
    parser.add_argument("--grid", type=int, default=len(wq.ALPHAS),
                        help="AWQ's grid: alphas 0, 1/N, ..., (N-1)/N (the library's is 20)")
    parser.add_argument("--sections", default="1,2,3,4")
    args = parser.parse_args()
    sections = chosen_sections(parser, args.sections, SECTION_KEYS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:                          # every section, on the bundled model
        sections = sorted(SECTION_KEYS)
    result, section_runs = earlier_sections(out, "ch10.json", SECTION_KEYS, sections)
    kvlab.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    today = datetime.datetime.now().isoformat(timespec="minutes")

    def ran(n, since):
        section_runs[n] = (f"{today}, {round(time.perf_counter() - since, 1)} s"
                           + (" (--quick)" if args.quick else ""))

    model = kvlab.load() if args.quick else smollm2()
    text, text_source = english_text()
    cal_text, cal_source = calibration_text()
    n_tokens, n_calibration = (128, 64) if args.quick else (args.tokens, args.calibration)
    context = 64 if args.quick else 512
    tokens = np.asarray(model.encode(text), dtype=np.int64)[:n_tokens]
    cal_tokens = np.asarray(model.encode(cal_text), dtype=np.int64)[:n_calibration]
    # --quick: the bundled model, Q4_0 alone, a grid of two alphas
    formats, grid = ((("q4_0",), (0.0, 0.5)) if args.quick else
                     (FORMATS, tuple(i / args.grid for i in range(args.grid))))
    calibration = None
    if {1, 2} & set(sections):
        since = time.perf_counter()
        calibration = wq.calibrate(model.config, model.weights, cal_tokens)
        print(f"calibration: {len(cal_tokens)} tokens, {time.perf_counter() - since:.1f} s")

    if 1 in sections:
        since = time.perf_counter()
        result["outliers"] = outliers(calibration)
        plot_outliers(result["outliers"], out / "ch10_outliers.png")
        for name in INPUTS:
            ratios = result["outliers"][name]["ratio_max_over_median"]
            print(f"{name:<5} largest/median: {min(ratios):.1f} .. {max(ratios):.1f}")
        ran(1, since)

    if 2 in sections:
        since = time.perf_counter()
        table, alphas, models = run_methods(model, calibration, tokens, context, formats,
                                            alphas=grid, methods=SMOLLM2_METHODS)
        result["methods_smollm2"], result["alphas_smollm2"] = table, alphas
        result["answers_smollm2"] = answers(model, models)
        print(json.dumps(result["answers_smollm2"], indent=1, ensure_ascii=False))
        ran(2, since)

    if 3 in sections:
        since = time.perf_counter()
        bundled = kvlab.load()
        bundled_text = (accuracy.validation_tokens(bundled, str(shared_folder() / "data" /
                                                                "tinyshakespeare.txt"))
                        if shared_folder() is not None and not args.quick else
                        np.asarray(bundled.encode(text), dtype=np.int64))[:4 * n_tokens]
        bundled_cal = np.asarray(bundled.encode(cal_text), dtype=np.int64)[:4 * n_calibration]
        table, _, _ = run_methods(bundled, wq.calibrate(bundled.config, bundled.weights,
                                                        bundled_cal), bundled_text, context,
                                  formats, embedding_format="q8_0", alphas=grid)
        result["methods_bundled"] = table
        ran(3, since)

    if 2 in sections or 3 in sections:
        plot_methods(result["methods_smollm2"], result["methods_bundled"],
                     out / "ch10_methods.png")

    if 4 in sections:
        since = time.perf_counter()
        # the format sets the speed: AWQ's and GPTQ's weights are stored in the same
        # formats and bytes as round to nearest's (section 2's rows, the tests)
        variants = {f"rtn {fmt}": wq.quantize_weights(model.config, model.weights, fmt)
                    for fmt in formats}
        variants["the file (q4_1)"] = model.weights
        result["decode"] = decode_speed(model, variants, 2 if args.quick else DECODE_ROUNDS)
        for r in result["decode"]:
            print(f"{r['weights']:<16}{r['weight_bytes']:>12,} {r['decode_tokens_per_s']:7.1f} "
                  f"tok/s ({r['spread']['min']:.1f}-{r['spread']['max']:.1f})")
        ran(4, since)

    result = {
        "setup": {**machine(), "threads": kvlab.get_num_threads(), "machine": platform.machine(),
                  "model": model.config.name or model.source,
                  "text": text_source, "tokens": int(len(tokens)), "context": context,
                  "calibration_text": cal_source, "calibration_tokens": int(len(cal_tokens)),
                  "awq_alphas": list(grid), "awq_error_tokens": min(256, len(cal_tokens)), "gptq_damp": 0.01,
                  "accuracy": "float32 activations: each model's logits are the float32 "
                              "model's over its stored values (chapter 6); the reference is "
                              "the model's own weights in float32",
                  "decode": f"median of 32 greedy steps after 16 tokens, int8 activations, "
                            f"{DECODE_ROUNDS} interleaved rounds",
                  "quick": args.quick,
                  "section_runs": {str(n): section_runs[n] for n in sorted(section_runs)},
                  "load_average_before_after": [load_before, os.getloadavg()],
                  "seconds": round(time.perf_counter() - started, 1)},
        **{key: result[key] for n in SECTION_KEYS for key in SECTION_KEYS[n]},
        "facts": FACTS,
    }
    (out / "ch10.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {out / 'ch10.json'} in {result['setup']['seconds']} s (sections {sections})")


if __name__ == "__main__":
    main()
