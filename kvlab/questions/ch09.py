"""Chapter 9, speculative decoding: the Check yourself questions whose answer is a number.
Each expected answer is worked out with the kit (a real verification pass, a model
config's shape) or read from the chapter's measurements (chapters/figures/ch09.json)."""
from __future__ import annotations

from . import Number, figures
import kvlab
from ..config import ModelConfig
from ..measure import kv_bytes_per_token


def _rows_of_logits() -> float:
    """Q1: a real verification of the newest token and 4 drafts on the bundled model."""
    model = kvlab.load()
    cache = model.new_cache(64)
    model.prefill(model.encode("ROMEO:\n"), cache)
    newest_and_drafts = model.encode("But soft, what light")[:5]     # 1 + 4 tokens
    return float(len(model.forward(newest_and_drafts, cache, all_logits=True)))


def _tokens_per_pass(a: float, k: int) -> float:
    """1 + a + ... + a^k: each draft kept with chance a, given the ones before it were."""
    return sum(a ** i for i in range(k + 1))


def _best_speedup() -> float:
    """Q3: a = 4/5, a pass over k + 1 tokens costs 1 + k/5 one-token passes; the speedup of
    the fastest of k = 2, 4, 8."""
    return max(_tokens_per_pass(4 / 5, k) / (1 + k / 5) for k in (2, 4, 8))


def _break_even() -> float:
    """Q7: the acceptance a at which k = 4 drafts pay for SmolLM2's measured 5-token pass."""
    cost = next(r["relative_to_one"] for r in figures("ch09.json")["pass_cost"]["rows"]
                if r["new_tokens"] == 5)
    low, high = 0.0, 1.0                        # tokens per pass rises with a: bisect
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _tokens_per_pass(mid, 4) < cost else (low, mid)
    return high


def _verify_intensity() -> float:
    """Q8: decode attention's FLOPs per byte of K/V read for Llama 3 8B with an fp16 cache
    (chapter 7.1: 2 * kv_mul / b), when a verification brings 5 query tokens per read."""
    config = ModelConfig.llama3_8b()
    kv_mul = config.n_heads // config.n_kv_heads
    values_per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim
    b = kv_bytes_per_token(config, "fp16") / values_per_token      # bytes per value
    return 5 * 2 * kv_mul / b


NUMBERS = {
    1: Number(expected=_rows_of_logits, unit="rows of logits", rel_tol=0.01,
              hint="every token of the pass gets a row: the newest token's row checks draft "
                   "0, and the last draft's row gives the token after it"),
    3: Number(expected=_best_speedup, unit="x", rel_tol=0.02,
              hint="tokens per pass (1 - a^(k+1)) / (1 - a), divided by the pass's cost "
                   "1 + k/5, for each k; give the largest"),
    7: Number(expected=_break_even, unit="acceptance a", rel_tol=0.02,
              hint="solve (1 - a^5) / (1 - a) = the 5-token pass's cost in one-token passes "
                   "(section 9.1's table) for a, e.g. by bisection"),
    8: Number(expected=_verify_intensity, unit="FLOPs per byte", rel_tol=0.01,
              hint="chapter 7.1: 2 * kv_mul / b FLOPs per byte for one query token per K/V "
                   "read (kv_mul = 32 / 8, b = 2); a verification reads each row once for "
                   "all 5 of its tokens"),
}
