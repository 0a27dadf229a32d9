"""What a cache format costs in accuracy, measured on real text.

Quantizing the cache saves memory; this module measures what it costs. For one model
and one token sequence, each format's cache is compared with the fp32 cache:

  - reconstruction error of K and V, per layer: the fp32 run's keys and values written
    into a cache of the format and read back (`cache.dequantized()`), as a relative
    root-mean-square error, ||stored - exact|| / ||exact||;
  - next-token distributions, teacher-forced over the text: the mean KL divergence
    KL(p_fp32 || p_format) in nats, and how often the most likely token is the same;
  - perplexity of the text, exp(mean negative log-likelihood of each next token), and
    its change against fp32 in percent.

The text is cut into windows of `context` tokens, each run from an empty cache with one
prefill (which gives the same logits as decoding token by token, bit for bit, in every
format). For the default model the text is the validation split of Tiny Shakespeare,
which it was not trained on; stories260K is evaluated on text it generated itself.

    report = kvlab.accuracy.evaluate(model, tokens)
    print(report.table())

Storing the weights in fewer bytes (kvlab.weight_formats) costs accuracy as well, and the
two add up: evaluate_weights() runs every combination of a weight format and a cache
format against float32 weights with an fp32 cache, on the same windows.

    report = kvlab.accuracy.evaluate_weights(model, tokens)
    print(report.table())

Keeping fewer positions (kvlab.cache_policy) costs accuracy too: evaluate_budgets() runs
each window's first half as a prompt and scores the second half, teacher-forced, with a
cache that keeps only `budget` rows under each policy, against the full cache.

    report = kvlab.accuracy.evaluate_budgets(model, tokens, budgets=(16, 32, 64))
    print(report.table())
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from ._text import signed
from .cache_policy import CachePolicy, make_policy
from .generate import generate
from .measure import kv_bytes_per_token
from .model import Model
from .next_token_metrics import kl_divergence, log_softmax, perplexity  # noqa: F401 (re-exported)
from .weight_formats import BLOCK_FORMATS, FORMATS

# The formats evaluate() compares by default: each a format name or new_cache() options.
DEFAULT_FORMATS = (
    "fp32", "fp16", "bf16", "fp8", "int8", "int4",
    {"dtype": "int4", "window": 32},
    {"key_format": "int8", "value_format": "int4"},
)

FormatSpec = Union[str, Dict]


def _options(spec: FormatSpec) -> dict:
    return {"dtype": spec} if isinstance(spec, str) else dict(spec)


@dataclasses.dataclass
class FormatAccuracy:
    """One format's costs against the fp32 cache."""
    name: str
    bytes_per_token: int          # over all layers, K and V, scales and zero points included
    key_error: List[float]        # relative RMS error of the stored keys, per layer
    value_error: List[float]      # the same for the values
    kl: float                     # mean KL(p_fp32 || p_format) over predicted positions, nats
    top1: float                   # fraction of positions whose argmax agrees with fp32
    perplexity: float
    perplexity_change: float      # percent, against the fp32 cache

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AccuracyReport:
    """evaluate()'s result: one FormatAccuracy per format, and what was measured."""
    model: str
    n_tokens: int                 # tokens evaluated (all windows together)
    context: int                  # tokens per window
    formats: List[FormatAccuracy]

    def __getitem__(self, name: str) -> FormatAccuracy:
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise KeyError(f"no format {name!r} in this report; have {[f.name for f in self.formats]}")

    def table(self) -> str:
        head = (f"{'format':<22}{'bytes/token':>12}{'K error':>10}{'V error':>10}"
                f"{'KL (nats)':>12}{'top-1':>8}{'perplexity':>12}{'change':>9}")
        lines = [f"{self.model}: {self.n_tokens:,} tokens in windows of {self.context}", head]
        for f in self.formats:
            lines.append(f"{f.name:<22}{f.bytes_per_token:>12,}{max(f.key_error):>10.2e}"
                         f"{max(f.value_error):>10.2e}{f.kl:>12.2e}{100 * f.top1:>7.2f}%"
                         f"{f.perplexity:>12.4f}{signed(f.perplexity_change, 3):>8}%")
        lines.append("K/V error: the worst layer's relative RMS error; change: perplexity "
                     "against the fp32 cache")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"model": self.model, "n_tokens": self.n_tokens, "context": self.context,
                "formats": [f.as_dict() for f in self.formats]}

    def save_json(self, path: str) -> None:
        with open(path, "w") as out:
            json.dump(self.as_dict(), out, indent=2)


class _Totals:
    """Running sums for one format across windows."""

    def __init__(self, n_layers: int):
        self.key_error = np.zeros(n_layers)     # sums of squared errors per layer
        self.value_error = np.zeros(n_layers)
        self.kl = 0.0
        self.agree = 0
        self.nll = 0.0

    def score(self, p: np.ndarray, reference: np.ndarray, log_q: np.ndarray,
              targets: np.ndarray) -> None:
        """Add one window: KL(p || q) summed over its positions (p = exp(reference), the
        reference's log-probabilities), how many top tokens agree, and the text's negative
        log-likelihood under q."""
        self.kl += float((p * (reference - log_q)).sum())
        self.agree += int((log_q.argmax(axis=-1) == reference.argmax(axis=-1)).sum())
        self.nll -= log_q[np.arange(len(targets)), targets].sum()


def _checked_text(config, tokens: Sequence[int], context: Optional[int]) -> tuple:
    """tokens as an array and the window length (default: the context, at most 512),
    ValueError for what cannot be scored."""
    tokens = np.asarray(tokens)
    context = context or min(512, config.max_seq_len)
    if not 2 <= context <= config.max_seq_len:
        raise ValueError(f"context must be between 2 and the model's {config.max_seq_len} tokens")
    if tokens.ndim != 1 or len(tokens) < 2:
        raise ValueError("tokens must be a 1-D sequence of at least 2 token ids")
    return tokens, context


def evaluate(model, tokens: Sequence[int], formats: Sequence[FormatSpec] = DEFAULT_FORMATS,
             context: Optional[int] = None, progress: bool = False) -> AccuracyReport:
    """Compare cache formats against the fp32 cache on `tokens` (see the module text).
    formats: format names or dicts of new_cache() options. context: tokens per window
    (default: the model's context, at most 512)."""
    config = model.config
    tokens, context = _checked_text(config, tokens, context)
    specs = [_options(spec) for spec in formats]
    fmts = [model.cache_format(**spec) for spec in specs]    # checks every spec up front
    windows = [tokens[i:i + context] for i in range(0, len(tokens) - 1, context)]
    windows = [w for w in windows if len(w) >= 2]

    exact = _Totals(config.n_layers)
    totals = [_Totals(config.n_layers) for _ in specs]
    key_norm, value_norm = np.zeros(config.n_layers), np.zeros(config.n_layers)
    n_predicted = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(windows) * (len(specs) + 1), desc="cache formats", unit="run")
    for window in windows:
        targets = window[1:]
        reference_cache = model.new_cache(len(window))
        reference = log_softmax(model.prefill(window, reference_cache, all_logits=True))[:-1]
        p = np.exp(reference)
        exact.nll -= reference[np.arange(len(targets)), targets].sum()
        keys, values = reference_cache.keys.copy(), reference_cache.values.copy()
        key_norm += (keys.astype(np.float64) ** 2).sum(axis=(1, 2, 3))
        value_norm += (values.astype(np.float64) ** 2).sum(axis=(1, 2, 3))
        n_predicted += len(targets)
        if bar is not None:
            bar.update(1)
        for spec, fmt, total in zip(specs, fmts, totals):
            options = {**spec, "window": min(fmt.window, len(window))}
            # the same K and V, stored in this format and read back
            stored = model.new_cache(len(window), **options)
            stored.append(np.ascontiguousarray(keys.transpose(1, 0, 2, 3)),
                          np.ascontiguousarray(values.transpose(1, 0, 2, 3)))
            stored_keys, stored_values = stored.dequantized()
            total.key_error += ((stored_keys - keys).astype(np.float64) ** 2).sum(axis=(1, 2, 3))
            total.value_error += ((stored_values - values).astype(np.float64) ** 2).sum(axis=(1, 2, 3))
            # the model run on a cache of this format
            log_q = log_softmax(model.prefill(window, model.new_cache(len(window), **options),
                                               all_logits=True))[:-1]
            total.score(p, reference, log_q, targets)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    exact_perplexity = float(np.exp(exact.nll / n_predicted))
    results = []
    for fmt, total in zip(fmts, totals):
        format_perplexity = float(np.exp(total.nll / n_predicted))
        results.append(FormatAccuracy(
            name=fmt.name,
            bytes_per_token=kv_bytes_per_token(config, fmt),
            key_error=np.sqrt(total.key_error / np.maximum(key_norm, 1e-30)).tolist(),
            value_error=np.sqrt(total.value_error / np.maximum(value_norm, 1e-30)).tolist(),
            kl=total.kl / n_predicted,
            top1=total.agree / n_predicted,
            perplexity=format_perplexity,
            perplexity_change=100.0 * (format_perplexity / exact_perplexity - 1.0)))
    return AccuracyReport(model=config.name or model.source, n_tokens=n_predicted + len(windows),
                          context=context, formats=results)


def validation_tokens(model, path: str, n_tokens: Optional[int] = None) -> np.ndarray:
    """The held-out part of the text file the bundled model was trained on (its model
    card, assets/*.json, records the split), encoded as the model's tokens. The file is
    read from disk, never downloaded: Tiny Shakespeare lives in ../shared/data here."""
    from pathlib import Path
    card = Path(model.source).with_suffix(".json")
    if not card.is_file():
        raise FileNotFoundError(f"{card}: no model card with a data split beside the model")
    first, last = json.loads(card.read_text())["split"]["validation"]
    data = Path(path).read_bytes()
    if len(data) < last:
        raise ValueError(f"{path} has {len(data):,} bytes; the model card's validation split "
                         f"ends at byte {last:,}: is it the file the model was trained on?")
    text = data[first:last].decode("utf-8", errors="replace")
    ids = np.asarray(model.encode(text), dtype=np.int64)
    return ids[:n_tokens] if n_tokens else ids


def generated_tokens(model, n_tokens: int, prompt: Union[str, Sequence[int]] = "Once upon a time",
                     seed: int = 0, temperature: float = 1.0) -> np.ndarray:
    """Text the model wrote itself (sampled with an fp32 cache): for models without a
    held-out split of their training data, such as stories260K."""
    ids: List[int] = []
    step = 0
    while len(ids) < n_tokens:
        want = min(n_tokens - len(ids), model.config.max_seq_len - 16)
        out = generate(model, prompt, max_new_tokens=want, temperature=temperature,
                       seed=seed + step, stop_at_eos=False)
        ids.extend(out.prompt_tokens + out.tokens)
        step += 1
    return np.asarray(ids[:n_tokens], dtype=np.int64)


# ---- keeping fewer positions ------------------------------------------------------------

@dataclasses.dataclass
class BudgetAccuracy:
    """One policy at one budget, against the full cache, on the second halves of the windows."""
    policy: str
    budget: int                   # rows the cache keeps
    mean_rows: float              # rows each scored position attended to, on average
    kl: float                     # mean KL(p_full || p_policy), nats
    top1: float                   # fraction of positions whose argmax agrees with the full cache
    perplexity: float
    perplexity_change: float      # percent, against the full cache

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BudgetReport:
    """evaluate_budgets()'s result."""
    model: str
    context: int                  # tokens per window: the first half prompt, the rest scored
    n_scored: int                 # positions scored, all windows together
    full_perplexity: float
    results: List[BudgetAccuracy]

    def of(self, policy: str) -> List[BudgetAccuracy]:
        return [r for r in self.results if r.policy == policy]

    def table(self) -> str:
        lines = [f"{self.model}: {self.n_scored:,} positions scored (second halves of windows of "
                 f"{self.context}); full cache perplexity {self.full_perplexity:.4f}",
                 f"{'policy':<8}{'budget':>8}{'rows read':>11}{'KL (nats)':>12}{'top-1':>8}"
                 f"{'perplexity':>12}{'change':>10}"]
        for r in self.results:
            lines.append(f"{r.policy:<8}{r.budget:>8}{r.mean_rows:>11.1f}{r.kl:>12.2e}"
                         f"{100 * r.top1:>7.2f}%{r.perplexity:>12.4f}"
                         f"{signed(r.perplexity_change, 2):>9}%")
        lines.append("rows read: the mean rows a scored position attended to (SnapKV compresses "
                     "the prompt only: later tokens add rows)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"model": self.model, "context": self.context, "n_scored": self.n_scored,
                "full_perplexity": self.full_perplexity,
                "results": [r.as_dict() for r in self.results]}


def _rows_seen(policy: CachePolicy, prompt: int, n_scored: int) -> float:
    """Mean rows the queries that predict the n_scored tokens after the prompt attend to:
    the prompt's last query, then each continuation query but the last. A bounded policy
    holds at most its budget; SnapKV's prompt was whole for the prompt's own queries, then
    compressed, and every later token adds a row."""
    queries = np.arange(prompt - 1, prompt - 1 + n_scored)     # positions of the queries
    if policy.bounded:
        return float(np.minimum(queries + 1, policy.budget).mean())
    kept = min(prompt, policy.budget)
    return float(np.where(queries < prompt, queries + 1, kept + queries - prompt + 1).mean())


def _scored_logits(model, policy: CachePolicy, window: np.ndarray, prompt: int) -> np.ndarray:
    """The logits that predict window[prompt:], with the policy's cache: the prompt's last
    row, then every continuation row but the last."""
    cache = (policy.new_cache(model) if policy.bounded
             else policy.new_cache(model, max_seq_len=len(window)))
    last = policy.forward(model, window[:prompt], cache)
    if len(window) - 1 == prompt:          # one token scored: the prompt's last row alone
        return last[None]
    rest = policy.forward(model, window[prompt:-1], cache, all_logits=True)
    return np.concatenate([last[None], rest])


def evaluate_budgets(model, tokens: Sequence[int], budgets: Sequence[int] = (16, 32, 64),
                     policies: Sequence[str] = ("window", "sinks", "h2o", "snapkv"),
                     context: Optional[int] = None, progress: bool = False) -> BudgetReport:
    """Perplexity, KL and top-1 agreement of each policy at each budget against the full
    cache (see the module text). context: tokens per window (default: the model's context,
    at most 256); its first half is the prompt, and a budget should be below it."""
    tokens = np.asarray(tokens)
    config = model.config
    context = context or min(256, config.max_seq_len)
    if not 4 <= context <= config.max_seq_len:
        raise ValueError(f"context must be between 4 and the model's {config.max_seq_len} tokens")
    if tokens.ndim != 1 or len(tokens) < context:
        raise ValueError(f"tokens must be a 1-D sequence of at least one window ({context} ids)")
    runs = [(name, int(budget), make_policy(name, int(budget)))
            for name in policies for budget in budgets]          # checks every one up front
    prompt = context // 2
    windows = [tokens[i:i + context] for i in range(0, len(tokens) - context + 1, context)]
    # the KL, agreement and NLL sums of _Totals; no per-layer K/V errors here (1 layer of 0s)
    totals = {(name, budget): _Totals(1) for name, budget, _ in runs}
    full_nll, n_scored = 0.0, 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(windows) * (len(runs) + 1), desc="cache budgets", unit="run")
    for window in windows:
        targets = window[prompt:]
        full = log_softmax(model.forward(window, model.new_cache(len(window)),
                                         all_logits=True))[prompt - 1:-1]
        p = np.exp(full)
        full_nll -= full[np.arange(len(targets)), targets].sum()
        n_scored += len(targets)
        if bar is not None:
            bar.update(1)
        for name, budget, policy in runs:
            total = totals[(name, budget)]
            log_q = log_softmax(_scored_logits(model, policy, window, prompt))
            total.score(p, full, log_q, targets)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    full_perplexity = float(np.exp(full_nll / n_scored))
    results = []
    for name, budget, _ in runs:
        total = totals[(name, budget)]
        ppl = float(np.exp(total.nll / n_scored))
        results.append(BudgetAccuracy(policy=name, budget=budget,
                                      mean_rows=_rows_seen(make_policy(name, budget), prompt,
                                                           context - prompt),
                                      kl=total.kl / n_scored,
                                      top1=total.agree / n_scored, perplexity=ppl,
                                      perplexity_change=100.0 * (ppl / full_perplexity - 1.0)))
    return BudgetReport(model=config.name or model.source, context=context, n_scored=n_scored,
                        full_perplexity=full_perplexity, results=results)


# ---- weights in fewer bytes, and with the cache's -------------------------------------

# The weight formats evaluate_weights() compares by default: a kvlab.weight_formats format,
# "q8_0 x int8" for Q8_0 with its activations in int8 too (the Model default for Q8_0).
# q4_0 and q4_1 take the same suffixes ("q4_1 x int8", "q4_0 x fp32") but are not run by
# default (chapter 6's figures compare these five).
DEFAULT_WEIGHT_VARIANTS = ("fp32", "fp16", "bf16", "q8_0 x fp32", "q8_0 x int8")
DEFAULT_CACHE_FORMATS = ("fp32", "int8", "int4")


@dataclasses.dataclass
class CombinationAccuracy:
    """One weight format with one cache format, against float32 weights and an fp32 cache."""
    weights: str                  # e.g. "q8_0 x int8": the format, then the activations
    cache: str                    # the cache format's name
    weight_bytes: int             # the model's weights in this format
    cache_bytes_per_token: int    # K and V of one position over all layers, as stored
    kl: float                     # mean KL(p_exact || p_this), nats
    top1: float
    perplexity: float
    perplexity_change: float      # percent, against float32 weights with an fp32 cache

    def bytes_read(self, context: int) -> int:
        """What one decode step reads at `context` cached positions: every weight once,
        and every position's K and V."""
        return self.weight_bytes + context * self.cache_bytes_per_token

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CombinationReport:
    """evaluate_weights()'s result: one CombinationAccuracy per weight and cache format."""
    model: str
    n_tokens: int
    context: int
    exact_perplexity: float       # float32 weights, fp32 cache
    results: List[CombinationAccuracy]

    def __getitem__(self, key: tuple) -> CombinationAccuracy:
        weights, cache = key
        for r in self.results:
            if (r.weights, r.cache) == (weights, cache):
                return r
        raise KeyError(f"no ({weights!r}, {cache!r}) in this report")

    def table(self) -> str:
        head = (f"{'weights':<14}{'cache':<8}{'weight bytes':>14}{'KV B/token':>12}"
                f"{'read at ' + str(self.context):>14}{'KL (nats)':>12}{'top-1':>8}"
                f"{'perplexity':>12}{'change':>9}")
        lines = [f"{self.model}: {self.n_tokens:,} tokens in windows of {self.context}; "
                 f"float32 weights with an fp32 cache: perplexity {self.exact_perplexity:.4f}",
                 head]
        for r in self.results:
            lines.append(f"{r.weights:<14}{r.cache:<8}{r.weight_bytes:>14,}"
                         f"{r.cache_bytes_per_token:>12,}{r.bytes_read(self.context):>14,}"
                         f"{r.kl:>12.2e}{100 * r.top1:>7.2f}%{r.perplexity:>12.4f}"
                         f"{signed(r.perplexity_change, 3):>8}%")
        lines.append(f"read at {self.context}: bytes one decode step reads with "
                     f"{self.context} positions cached (the weights, then K and V)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"model": self.model, "n_tokens": self.n_tokens, "context": self.context,
                "exact_perplexity": self.exact_perplexity,
                "results": [r.as_dict() for r in self.results]}

    def save_json(self, path: str) -> None:
        with open(path, "w") as out:
            json.dump(self.as_dict(), out, indent=2)


def _weight_variant(model, variant: str):
    """The model with its matrices stored as `variant` says ("fp16", "q8_0 x int8" ...)."""
    fmt, _, activations = variant.partition(" x ")
    activations = activations or "fp32"
    if fmt not in FORMATS or activations not in ("fp32", "int8") or (
            activations == "int8" and fmt not in BLOCK_FORMATS):
        raise ValueError(f"weight variant must be a format ({', '.join(FORMATS)}), or a "
                         f"block format ({', '.join(BLOCK_FORMATS)}) with ' x int8' or "
                         f"' x fp32' ('q4_1 x int8'), got {variant!r}")
    return Model(model.config, model.weights.float32().converted(fmt), model.tokenizer,
                 model.source, activations=activations)


def evaluate_weights(model, tokens: Sequence[int],
                     weights: Sequence[str] = DEFAULT_WEIGHT_VARIANTS,
                     caches: Sequence[FormatSpec] = DEFAULT_CACHE_FORMATS,
                     context: Optional[int] = None, progress: bool = False) -> CombinationReport:
    """Every weight variant with every cache format, teacher-forced on `tokens` in windows
    of `context` tokens (default: the model's context, at most 512), against the model's
    float32 weights (their dequantized values, for a model loaded in fewer bytes) with an
    fp32 cache: KL, top-1 agreement and perplexity change, and the bytes each reads."""
    config = model.config
    tokens, context = _checked_text(config, tokens, context)
    exact_model = _weight_variant(model, "fp32")
    variants = [(name, _weight_variant(model, name)) for name in weights]
    specs = [_options(spec) for spec in caches]
    cache_formats = [model.cache_format(**spec) for spec in specs]
    windows = [tokens[i:i + context] for i in range(0, len(tokens) - 1, context)]
    windows = [w for w in windows if len(w) >= 2]
    runs = [(name, variant, spec, fmt) for name, variant in variants
            for spec, fmt in zip(specs, cache_formats)]
    totals = {(name, fmt.name): _Totals(config.n_layers) for name, _, _, fmt in runs}
    exact_nll, n_predicted = 0.0, 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(windows) * (len(runs) + 1), desc="weight x cache formats", unit="run")
    for window in windows:
        targets = window[1:]
        exact = log_softmax(exact_model.prefill(window, exact_model.new_cache(len(window)),
                                                all_logits=True))[:-1]
        p = np.exp(exact)
        exact_nll -= exact[np.arange(len(targets)), targets].sum()
        n_predicted += len(targets)
        if bar is not None:
            bar.update(1)
        for name, variant, spec, fmt in runs:
            options = {**spec, "window": min(fmt.window, len(window))}
            log_q = log_softmax(variant.prefill(window, variant.new_cache(len(window), **options),
                                                all_logits=True))[:-1]
            totals[(name, fmt.name)].score(p, exact, log_q, targets)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    exact_perplexity = float(np.exp(exact_nll / n_predicted))
    results = []
    for name, variant, _, fmt in runs:
        total = totals[(name, fmt.name)]
        ppl = float(np.exp(total.nll / n_predicted))
        results.append(CombinationAccuracy(
            weights=name, cache=fmt.name, weight_bytes=variant.weights_nbytes,
            cache_bytes_per_token=kv_bytes_per_token(config, fmt),
            kl=total.kl / n_predicted, top1=total.agree / n_predicted, perplexity=ppl,
            perplexity_change=100.0 * (ppl / exact_perplexity - 1.0)))
    return CombinationReport(model=config.name or model.source,
                             n_tokens=n_predicted + len(windows), context=context,
                             exact_perplexity=exact_perplexity, results=results)


# ---- any models against one -----------------------------------------------------------------

@dataclasses.dataclass
class ModelAccuracy:
    """One model's predictions against a reference model's, on the same text."""
    name: str
    weight_bytes: int             # the model's weights as stored
    kl: float                     # mean KL(p_reference || p_this), nats
    top1: float                   # fraction of positions whose argmax agrees with the reference
    perplexity: float
    perplexity_change: float      # percent, against the reference's perplexity

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compare_models(reference: Model, models: Dict[str, Model], tokens: Sequence[int],
                   context: Optional[int] = None) -> tuple:
    """Each model of `models` (same config and vocabulary as `reference`, weights chosen
    another way: kvlab.weight_quantization) teacher-forced on `tokens` in windows of
    `context` tokens, each window from an empty fp32 cache, against the reference: the
    reference's perplexity and a ModelAccuracy per model, in the dict's order."""
    tokens, context = _checked_text(reference.config, tokens, context)
    windows = [w for w in (tokens[i:i + context] for i in range(0, len(tokens) - 1, context))
               if len(w) >= 2]
    totals = {name: _Totals(reference.config.n_layers) for name in models}
    exact_nll, n_predicted = 0.0, 0
    for window in windows:
        targets = window[1:]
        exact = log_softmax(reference.prefill(window, reference.new_cache(len(window)),
                                              all_logits=True))[:-1]
        exact_nll -= exact[np.arange(len(targets)), targets].sum()
        n_predicted += len(targets)
        p = np.exp(exact)                  # the reference's probabilities, once for every model
        for name, model in models.items():
            log_q = log_softmax(model.prefill(window, model.new_cache(len(window)),
                                              all_logits=True))[:-1]
            totals[name].score(p, exact, log_q, targets)
    exact_perplexity = float(np.exp(exact_nll / n_predicted))
    rows = []
    for name, model in models.items():
        ppl = float(np.exp(totals[name].nll / n_predicted))
        rows.append(ModelAccuracy(name=name, weight_bytes=model.weights_nbytes,
                                  kl=totals[name].kl / n_predicted,
                                  top1=totals[name].agree / n_predicted, perplexity=ppl,
                                  perplexity_change=100.0 * (ppl / exact_perplexity - 1.0)))
    return exact_perplexity, rows
