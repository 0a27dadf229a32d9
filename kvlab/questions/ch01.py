"""Chapter 1, "Autoregressive decoding and the KV cache": the Check yourself questions whose
answer is a number, worked out with kvlab.measure (and, for the SmolLM2 run, the prompt
length chapters/figures/ch01.json recorded)."""
from __future__ import annotations

from .. import measure
from ..config import ModelConfig
from . import Number, figures


def _saving_at_99() -> float:
    return measure.per_token_saving(ModelConfig.llama2_7b(), 99)


def _uncached_tokens_smollm2() -> float:
    """Tokens the uncached 48-token SmolLM2 run pushes through the model: every step runs
    the whole sequence so far."""
    run = figures("ch01.json")["timing_48"]["smollm2"]
    config = ModelConfig(**figures("ch02.json")["smollm2"]["config"])
    return measure.generation_counts(config, run["prompt_tokens"], run["new_tokens"],
                                     use_cache=False).tokens


NUMBERS = {
    4: Number(expected=_saving_at_99, unit="(fraction of the step's FLOPs)", rel_tol=0.001,
              hint="the uncached step at position 99 runs 100 tokens, the cached one 1; "
                   "answer as a fraction (0.9, not 90), or use "
                   "kvlab.measure.per_token_saving(kvlab.ModelConfig.llama2_7b(), 99)"),
    6: Number(expected=_uncached_tokens_smollm2, unit="tokens", rel_tol=0.001, whole=True,
              hint="the first uncached step runs the prompt, each later one a token more: "
                   "prompt + (prompt + 1) + ... + (prompt + 47)"),
}
