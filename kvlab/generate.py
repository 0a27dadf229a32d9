"""The generation loop, with and without a KV cache, timed step by step.

With the cache, the prompt is prefilled once and each new token costs one decode step
over the cached K and V. Without it, every step re-runs the whole sequence from position
0, which is what the course's "uncached" measurements time. Both use the same sampler, so
greedy generation gives the same tokens either way: the cache is exact. generate() reads
as that loop; by default the cached decode steps run in the C core instead
(Model.decode_steps, the same steps and choices with no Python between tokens).
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Sequence, Union

import numpy as np

from . import arguments, chat
from .cache_policy import CachePolicy, SlidingWindow
from .counts import Counts
from .deprecation import renamed
from .errors import ContextLengthError
from .model import Model, as_token_array
from .quant import CacheFormat
from .sampling import check_sampling_args, check_seed, sample
from .speculative import Drafter, SpeculationStats, check_drafter, speculative_loop


@dataclasses.dataclass
class Generation:
    prompt: str                 # the prompt text ("" when ids were given)
    prompt_tokens: List[int]    # prompt ids, BOS included where the tokenizer has one
    tokens: List[int]           # generated ids, in order
    completion: str             # the generated text alone
    step_seconds: np.ndarray    # wall time of each step; step 0 includes the prefill
    use_cache: bool
    cache_nbytes: int           # bytes the KV cache reserved (0 without a cache)
    counts: Counts = dataclasses.field(default_factory=Counts)  # FLOPs and bytes, counted by the core
    finish_reason: str = "length"   # "length": max_new_tokens reached; "eos": the model chose
                                    # its end-of-sequence token (not kept in tokens); as the Engine's
    speculation: Optional[SpeculationStats] = None   # with speculate=: drafted, accepted, passes

    @property
    def text(self) -> str:
        """Prompt followed by the generated text."""
        return self.prompt + self.completion

    @property
    def flops(self) -> int:
        return self.counts.flops

    @property
    def seconds(self) -> float:
        return float(self.step_seconds.sum())

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


# Decode steps between two updates of a progress bar.
PROGRESS_CHUNK = 16


def generate(model: Model, prompt: Union[str, Sequence[int], None] = None,
             max_new_tokens: int = 48,
             use_cache: bool = True, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: Optional[int] = None,
             stop_at_eos: bool = True, progress: bool = False,
             dtype: Union[None, str, CacheFormat] = None, fast: bool = True,
             speculate: Optional[Drafter] = None, draft_tokens: int = 4,
             cache_policy: Optional[CachePolicy] = None,
             messages: Optional[Sequence[dict]] = None, **cache_options) -> Generation:
    """Generate up to max_new_tokens after the prompt (text, or a list of token ids).

    messages (instead of a prompt), for a chat model: [{"role": "user", "content": ...}],
    rendered with the model's chat template (kvlab.chat); the answer stops at the
    template's end-of-turn token (<|im_end|> for ChatML), and out.completion is the answer.
    kvlab.chat.Chat keeps a conversation's cache across turns.

    Greedy by default (temperature 0). A seed makes sampling reproducible. The model's
    context (config.max_seq_len) bounds prompt + new tokens (ContextLengthError). dtype (a
    name or a CacheFormat; fp32 if unset) and cache_options (key_dtype, value_dtype, group, key_group,
    value_group, window) choose how the KV cache stores K and V, as in model.new_cache().

    The loop below is the algorithm. With a cache and fast=True (the default) its decode
    steps run in the C core instead (_cached_loop_in_c): on a model as small as the kit's
    a trip through Python and back costs about a sixth of a step. fast=False runs the loop
    as written; both give the same tokens and take the same numbers from the generator.

    speculate (a drafter from kvlab.speculative: PromptLookup(), DraftModel(...)) checks up
    to draft_tokens guessed tokens per forward pass: greedy, the same tokens; sampled, the
    same distribution (the rejection rule). out.speculation says how many passes it saved.

    cache_policy (from kvlab.cache_policy: SlidingWindow(64), AttentionSinks(4, 60),
    HeavyHitters(64), SnapKV(64)) keeps fewer positions: the cache holds the policy's
    budget of rows and drops the others as the sequence grows. A policy with a fixed
    budget (all but SnapKV) may generate past the model's context; the positions it then
    uses were never seen in training. A model whose config has a sliding_window runs with
    SlidingWindow(config.sliding_window) by itself, as it was trained.
    """
    if "cache_dtype" in cache_options:            # its name before dtype was one word
        if dtype is not None:
            raise TypeError("give dtype only (cache_dtype is its old name)")
        renamed("generate(cache_dtype=...)", "generate(dtype=...)")
        dtype = cache_options.pop("cache_dtype")
    cache_format = model.cache_format("fp32" if dtype is None else dtype, **cache_options)
    max_new_tokens = arguments.positive(max_new_tokens, "max_new_tokens")
    check_sampling_args(temperature, top_k, top_p)
    seed = check_seed(seed)
    use_cache = arguments.flag(use_cache, "use_cache")
    stop_at_eos = arguments.flag(stop_at_eos, "stop_at_eos")
    progress = arguments.flag(progress, "progress")
    fast = arguments.flag(fast, "fast")
    if speculate is not None:
        draft_tokens = arguments.positive(draft_tokens, "draft_tokens")
    eos = getattr(model.tokenizer, "eos_id", None)
    if messages is not None:
        if prompt is not None:
            raise TypeError("give a prompt or messages, not both")
        prompt_text, ids = chat.prompt(model, messages)
        eos = chat.end_of_turn_id(model.tokenizer)
    elif prompt is None:
        raise TypeError("generate needs a prompt (text or token ids) or messages")
    elif isinstance(prompt, str):
        prompt_text, ids = prompt, model.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer has no BOS token to "
                             "start from; give at least one character")
    else:
        # checked as forward checks them: a bool, a float or a string is not a token id
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            try:
                prompt = list(prompt)
            except TypeError:
                raise arguments.ArgumentTypeError(
                    f"prompt must be text or a sequence of token ids, got "
                    f"{type(prompt).__name__}") from None
        if (prompt.size if isinstance(prompt, np.ndarray) else len(prompt)) == 0:
            raise ValueError("the prompt has no token ids")
        prompt_text, ids = "", as_token_array(prompt, model.config.vocab_size).tolist()
    context = model.config.max_seq_len
    # The last sampled token is never fed back, so the cache needs one slot less.
    capacity = len(ids) + max_new_tokens - 1
    window = model.config.sliding_window
    if cache_policy is None and window is not None and capacity > window:
        if not use_cache or speculate is not None or cache_format.window > 0:
            raise ValueError(f"this model attends to its last {window} positions "
                             f"(config.sliding_window), which kvlab runs over a cache that drops "
                             f"older rows (kvlab.cache_policy.SlidingWindow): that needs "
                             f"use_cache=True, no speculate= and no residual window, or at most "
                             f"{window} positions in all")
        cache_policy = SlidingWindow(window)      # the model's own attention: its last window
    if cache_policy is not None:
        _check_cache_policy(cache_policy, use_cache, speculate, cache_format)
    bounded = cache_policy is not None and cache_policy.bounded
    if bounded and capacity <= cache_policy.budget:
        # it would never drop a row: a plain cache, no larger than needed
        cache_policy, bounded = None, False
    if len(ids) + max_new_tokens > context and not bounded:
        raise ContextLengthError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the model's context of {context} tokens")
    if speculate is not None:
        _check_speculation(model, speculate, draft_tokens, use_cache, cache_format)
    rng = np.random.default_rng(seed)
    eos = eos if stop_at_eos else None
    if use_cache and cache_format.window > capacity:
        cache_format = dataclasses.replace(cache_format, window=capacity)
    if bounded:
        cache = cache_policy.new_cache(model, cache_format)
    elif cache_policy is not None:
        cache = cache_policy.new_cache(model, cache_format, max_seq_len=capacity)
    else:
        cache = (model.new_cache(capacity, cache_format) if use_cache else None)

    new_tokens: List[int] = []
    seconds: List[float] = []
    bar = _progress_bar(max_new_tokens, "cached" if use_cache else "uncached", progress)
    sampling = (temperature, top_k, top_p, rng)
    finish_reason = "length"
    stats = SpeculationStats(draft_tokens) if speculate is not None else None
    with model.counting() as counts:
        if stats is not None:
            passes_before = getattr(speculate, "passes", 0)
            if speculative_loop(model, ids, cache, max_new_tokens, speculate, sampling, stats,
                                eos, new_tokens, seconds, bar):
                finish_reason = "eos"
            stats.draft_passes = getattr(speculate, "passes", 0) - passes_before
        elif cache is not None and fast and cache_policy is None:
            if _cached_loop_in_c(model, ids, cache, max_new_tokens, sampling, eos, new_tokens,
                                 seconds, bar):
                finish_reason = "eos"
        else:
            # The loop. With a cache, the prompt runs once and then only the newest token;
            # without one, every step runs the whole sequence from position 0.
            # [quote ch01-generate-the-loop]
            for step in range(max_new_tokens):
                start = time.perf_counter()
                if cache is None:
                    logits = model.forward(ids + new_tokens)        # everything, from scratch
                elif cache_policy is not None:      # the same, dropping rows as it must (ch. 8)
                    logits = cache_policy.forward(model, new_tokens[-1:] if step else ids, cache)
                elif step == 0:
                    logits = model.prefill(ids, cache)              # the whole prompt at once
                else:
                    logits = model.decode(new_tokens[-1], cache)    # the newest token only
                token = _choose(logits, sampling, step, len(ids))
                seconds.append(time.perf_counter() - start)
                if bar is not None:
                    bar.update(1)
                if token == eos:                  # an end-of-sequence token is not kept
                    finish_reason = "eos"
                    break
                new_tokens.append(token)
            # [end ch01-generate-the-loop]
    if bar is not None:
        bar.close()

    completion = model.decode_text(new_tokens) if model.tokenizer is not None else ""
    return Generation(prompt=prompt_text, prompt_tokens=list(ids), tokens=new_tokens,
                      completion=completion, step_seconds=np.array(seconds),
                      use_cache=use_cache, cache_nbytes=cache.nbytes if cache else 0,
                      counts=counts, finish_reason=finish_reason, speculation=stats)


def _check_speculation(model: Model, drafter, draft_tokens, use_cache, cache_format) -> None:
    check_drafter(model, drafter, draft_tokens)
    if not use_cache or cache_format.window > 0:
        raise ValueError("speculation rolls rejected drafts back with cache.truncate: it needs "
                         "a cache (use_cache=True) without a residual window")


def _check_cache_policy(policy, use_cache, speculate, cache_format) -> None:
    if not isinstance(policy, CachePolicy):
        raise TypeError(f"cache_policy takes a policy from kvlab.cache_policy "
                        f"(SlidingWindow(64), AttentionSinks(4, 60), HeavyHitters(64), "
                        f"SnapKV(64)), got {type(policy).__name__}")
    if not use_cache:
        raise ValueError("a cache_policy decides what a cache keeps: it needs use_cache=True")
    if speculate is not None:
        raise ValueError("speculate and cache_policy cannot be combined yet: rolling back "
                         "drafts after rows were dropped is not supported")
    if cache_format.window > 0:
        raise ValueError("a cache_policy drops rows; a residual window keeps its rows by "
                         "position: give window=0")


def _choose(logits: np.ndarray, sampling: tuple, step: int, prompt_len: int) -> int:
    """The next token, as kvlab.sampling.sample chooses it; NaN logits name the step."""
    try:
        return sample(logits, *sampling)
    except ValueError as error:            # the arguments were checked: bad logits
        raise ValueError(f"generate, new token {step} (position {prompt_len + step - 1}): "
                         f"{error}") from None


def _cached_loop_in_c(model: Model, ids: List[int], cache, max_new_tokens: int,
                      sampling: tuple, eos: Optional[int], new_tokens: List[int],
                      seconds: List[float], bar) -> bool:
    """generate's loop over a cache with its decode steps in the C core (fast=True): the
    prompt's step as in the loop, then Model.decode_steps, which runs decode and the same
    choice of token for every later step without coming back to Python (in chunks when a
    progress bar shows). The same tokens, the same numbers taken from rng: tested. Returns
    whether the end-of-sequence token stopped it."""
    temperature, top_k, top_p, rng = sampling
    start = time.perf_counter()
    token = _choose(model.prefill(ids, cache), sampling, 0, len(ids))
    seconds.append(time.perf_counter() - start)
    if bar is not None:
        bar.update(1)
    if token == eos:
        return True
    new_tokens.append(token)
    while len(seconds) < max_new_tokens:
        n = max_new_tokens - len(seconds)
        try:
            picks, times = model.decode_steps(new_tokens[-1], cache,
                                              n if bar is None else min(n, PROGRESS_CHUNK),
                                              temperature, top_k, top_p, rng, stop_token=eos)
        except ValueError as error:           # the arguments were checked: bad logits
            done = len(getattr(error, "completed", ((),))[0])
            raise ValueError(f"generate, new token {len(seconds) + done}: {error}") from None
        seconds.extend(times.tolist())
        if bar is not None:
            bar.update(len(picks))
        picks = picks.tolist()
        if picks[-1] == eos:
            new_tokens.extend(picks[:-1])
            return True
        new_tokens.extend(picks)
    return False


def _progress_bar(total: int, label: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"generating ({label})", unit="tok", leave=False)
