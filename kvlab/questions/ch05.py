"""Chapter 5, "Batching and scheduling": the Check yourself questions whose answer is a
number, worked out with the kit (and the data-sheet facts of the chapter's ch05.json)."""
from __future__ import annotations

from . import Number, figures
from ..config import ModelConfig
from ..measure import weights_bytes
import kvlab


def _weights_per_token_at_batch_32() -> float:
    """Question 1: Llama 2 7B's fp16 weights, read once per step, shared by 32 tokens."""
    return weights_bytes(ModelConfig.llama2_7b(), "fp16") / 32


def _h100_ridge() -> float:
    """Question 2: the H100's FLOPs per byte at its ridge, from the data sheet's dense bf16
    FLOP/s and its memory bandwidth."""
    facts = figures("ch05.json")["facts"]
    return facts["h100_bf16_dense_flops"]["value"] / facts["h100_hbm_bytes_per_s"]["value"]


def _static_mean_batch() -> float:
    """Question 5: serve the 16 requests (15 of 20 tokens, one of 400) as one static batch
    with kvlab.Engine and average the batch size over its steps."""
    model = kvlab.load()
    engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=64, block_size=16))
    for n in [20] * 15 + [400]:
        engine.add_request([1], kvlab.SamplingParams(max_new_tokens=n, stop_at_eos=False))
    engine.run(progress=False)
    return sum(m.batch_size for m in engine.metrics) / len(engine.metrics)


NUMBERS = {
    1: Number(expected=_weights_per_token_at_batch_32, unit="bytes per generated token",
              rel_tol=0.01,
              hint="the step reads every weight once (6.74 billion parameters x 2 bytes) "
                   "and makes one token for each of the 32 sequences"),
    2: Number(expected=_h100_ridge, unit="FLOPs per byte", rel_tol=0.02,
              hint="divide the dense bf16 FLOP/s (989 TFLOP/s: the data sheet's 1,979 is "
                   "'with sparsity') by the memory bandwidth (3.35 TB/s)"),
    5: Number(expected=_static_mean_batch, unit="sequences per step", rel_tol=0.01,
              hint="the batch runs until its longest request is done; add up the sequences "
                   "in every step and divide by the number of steps"),
}
