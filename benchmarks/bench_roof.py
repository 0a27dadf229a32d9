"""Batched decode of the course's model as a share of this CPU's compute roof (issue 37).

    python benchmarks/bench_roof.py [--rounds 3] [--json out.json]

A decode step of one sequence reads every weight for one token: it is bound by memory
(kvlab.measure.memory_bandwidth). A step of many sequences uses each weight once per
sequence and turns toward the compute roof, which kvlab.measure.compute_roof measures: the
widest float32 multiply-add, the widest int8 dot product, and the int8 product's own
sequence (each block's 32 byte products summed exactly from eight sums of four, made
float, scaled, multiply-added: what kvlab's int8 rule costs at best). This times SmolLM2-135M (kvlab.fetch("smollm2-135m"), its Q4_1 file
loaded as Q8_0) decoding batches of 1, 4 and 16 sequences with forward_batch, three ways
(Q8_0 with int8 activations, Q8_0 with float32 activations, float32 weights), on one thread
in CPU seconds (benchmarks/products_timing.py's measure), and reports the multiply-adds of
the weight matrices per CPU second (kvlab.measure.forward_counts' projection and MLP
work, the classifier included) beside the roof of the instructions each way runs on.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvlab
from kvlab.measure import compute_roof, forward_counts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from products_timing import BATCHES, STEPS, batch_decode_seconds, smollm2_variants  # noqa: E402

ROOF_OF = {   # each way's instructions: which of compute_roof's rates bounds it
    "q8_0_int8": ("int8_product_ops_per_s_1_thread", "int8_ops_per_s_1_thread"),
    "q8_0_fp32act": ("f32_flops_per_s_1_thread",),
    "fp32": ("f32_flops_per_s_1_thread",),
}


def weight_macs_per_token(config) -> int:
    """Multiply-adds of the weight matrices for one token (classifier included): the
    projections' and MLP's FLOPs over two (attention's own work left out)."""
    counts = forward_counts(config, 1, 0, all_logits=True)
    return (counts.flops_projections + counts.flops_mlp + counts.flops_logits) // 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kvlab.set_num_threads(1)
    roof = compute_roof(5)
    variants = smollm2_variants()
    if not variants:
        return 0
    macs = weight_macs_per_token(next(iter(variants.values())).config)
    rows = []
    print(f"roof, one thread: f32 {roof['f32_flops_per_s_1_thread'] / 1e9:.0f} GFLOP/s "
          f"({roof['f32_instruction']}); int8 {roof['int8_ops_per_s_1_thread'] / 1e9:.0f} Gop/s "
          f"({roof['int8_instruction']}), int8 product sequence "
          f"{roof['int8_product_ops_per_s_1_thread'] / 1e9:.0f} Gop/s")
    for name, model in variants.items():
        batch_decode_seconds(model, 1)
        for batch in BATCHES:
            seconds = min(batch_decode_seconds(model, batch) for _ in range(args.rounds))
            tokens_per_s = batch * STEPS / seconds
            ops_per_s = 2 * macs * tokens_per_s
            shares = {key: ops_per_s / roof[key] for key in ROOF_OF[name]}
            rows.append({"variant": name, "batch": batch, "tok_per_cpu_s": tokens_per_s,
                         "weight_ops_per_s": ops_per_s, "share_of_roof": shares})
            print(f"{name:<14} batch {batch:>2}: {tokens_per_s:7.1f} tok per CPU s, "
                  f"{ops_per_s / 1e9:6.1f} Gop/s, " +
                  ", ".join(f"{100 * v:.0f}% of {k.replace('_per_s_1_thread', '')}"
                            for k, v in shares.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"roof": roof, "macs_per_token": macs,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
