"""The generation loop, with and without a KV cache, timed step by step.

With the cache, the prompt is prefilled once and each new token costs one decode step
over the cached K and V. Without it, every step re-runs the whole sequence from position
0, which is what the course's "uncached" measurements time. Both use the same sampler, so
greedy generation gives the same tokens either way: the cache is exact.

generate() is that loop, one token per step, the same for every way of running a step.
The way is chosen before the loop, as one of the Steps classes below:

    Uncached         use_cache=False: the whole sequence from position 0 at every step
    Cached           fast=False: prefill, then decode of the newest token, in Python
    CachedInC        the default: as Cached, with the decode steps in the C core
                     (Model.decode_steps: the same steps and choices, no Python between tokens)
    WithCachePolicy  cache_policy=: a cache that keeps only the rows a policy chooses
    Speculative      speculate=: drafts checked several at a time (kvlab.speculative)

Not here: the sampler (kvlab.sampling), the batching engine that runs many sequences at
once (kvlab.engine), a conversation that keeps its cache across turns (kvlab.chat.Chat).
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import time
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import arguments, chat
from .cache_policy import CachePolicy, SlidingWindow
from .counts import Counts
from .deprecation import renamed
from .errors import ContextLengthError
from .model import Model, as_token_array
from .quant import CacheFormat
from .sampling import sample
from .scheduler import SamplingParams
from .speculative import Drafter, SpeculationStats, check_drafter, speculative_pass


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


# Decode steps that CachedInC runs in C between two updates of a progress bar.
PROGRESS_CHUNK = 16

# generate's sampling keywords, each a shorthand for the SamplingParams field of its name,
# at their defaults (as in generate's signature): what leaving them out means
SHORTHAND_DEFAULTS = {"max_new_tokens": 48, "temperature": 0.0, "top_k": None,
                      "top_p": None, "seed": None, "stop_at_eos": True}


def generate(model: Model, prompt: Union[str, Sequence[int], None] = None,
             max_new_tokens: int = 48, use_cache: bool = True, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None, stop_at_eos: bool = True, progress: bool = False,
             dtype: Union[None, str, CacheFormat] = None, fast: bool = True,
             speculate: Optional[Drafter] = None, draft_tokens: int = 4,
             cache_policy: Optional[CachePolicy] = None,
             messages: Optional[Sequence[dict]] = None, *,
             params: Optional[SamplingParams] = None, **cache_options) -> Generation:
    """Generate after the prompt (text, or a list of token ids), or after `messages` for a
    chat model ([{"role": "user", "content": ...}] in its chat template: the answer,
    out.completion, stops at the end-of-turn token). Prompt + new tokens must fit the
    model's context, config.max_seq_len (ContextLengthError).

    What to generate: params, a kvlab.SamplingParams as the Engine takes it (n=1), or its
    shorthand max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos (not both;
    left out, max_new_tokens is 48 here but 16 in a SamplingParams, as vLLM's).
    Greedy by default; a seed makes sampling reproducible.

    How, chosen before the loop as one of the Steps classes below: use_cache=False
    (Uncached); fast=False, the loop as written (Cached), else its decode steps in C
    (CachedInC: the same tokens, the same random numbers); speculate=a drafter, with up to
    draft_tokens drafts per pass (Speculative); cache_policy=a kvlab.cache_policy policy,
    or the model's own config.sliding_window (WithCachePolicy). dtype (fp32 if unset) and
    cache_options (key_format, value_format, group, key_group, value_group, window): the
    cache's format, as in model.new_cache(). progress=True shows a progress bar.
    """
    params = _sampling_params(params, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos)
    cache_format = _cache_format(model, dtype, cache_options)
    progress = arguments.flag(progress, "progress")
    prompt_text, ids, eos = _read_prompt(model, prompt, messages)
    eos = eos if params.stop_at_eos else None
    steps = _choose_steps(model, ids, params, eos, cache_format, use_cache=use_cache,
                          fast=fast, progress=progress, speculate=speculate,
                          draft_tokens=draft_tokens, cache_policy=cache_policy)
    new_tokens, seconds, finish_reason = [], [], "length"
    with _progress_bar(progress, params.max_new_tokens, steps.cache is not None) as bar, \
            model.counting() as counts:
        # [quote ch01-generate-the-loop]
        for _ in range(params.max_new_tokens):
            token, step_seconds = steps.next_token(new_tokens)
            seconds.append(step_seconds)
            bar.update(1)
            if token == eos:                      # an end-of-sequence token is not kept
                finish_reason = "eos"
                break
            new_tokens.append(token)
        # [end ch01-generate-the-loop]
    completion = model.decode_text(new_tokens) if model.tokenizer is not None else ""
    return Generation(prompt=prompt_text, prompt_tokens=list(ids), tokens=new_tokens,
                      completion=completion, step_seconds=np.array(seconds),
                      use_cache=steps.cache is not None,
                      cache_nbytes=0 if steps.cache is None else steps.cache.nbytes,
                      counts=counts, finish_reason=finish_reason, speculation=steps.stats)


# ---- the ways of running a step ---------------------------------------------------------

# [quote ch01-generate-steps]
class Steps:
    """One way of running generate's steps, chosen before the loop. next_token(new_tokens)
    runs the step after the prompt and the tokens generated so far, and returns the token
    it chose and the seconds the step took. The ways differ in how they get the logits;
    every one chooses with the same sampler, so equal logits give equal tokens."""
    stats: Optional[SpeculationStats] = None     # what speculation did (Speculative)

    def __init__(self, model: Model, ids: List[int], cache, sampling: tuple):
        self.model, self.ids, self.cache = model, ids, cache
        self.sampling = sampling                 # (temperature, top_k, top_p, rng)

    def next_token(self, new_tokens: List[int]) -> Tuple[int, float]:
        start = time.perf_counter()
        logits = self.logits(new_tokens)
        token = _choose(logits, self.sampling, len(new_tokens), len(self.ids))
        return token, time.perf_counter() - start


class Uncached(Steps):
    """No cache: every step runs the whole sequence from position 0."""

    def logits(self, new_tokens: List[int]) -> np.ndarray:
        return self.model.forward(self.ids + new_tokens)        # everything, from scratch


class Cached(Steps):
    """Over a cache: the prompt runs once, then only the newest token."""

    def logits(self, new_tokens: List[int]) -> np.ndarray:
        if not new_tokens:
            return self.model.prefill(self.ids, self.cache)     # the whole prompt at once
        return self.model.decode(new_tokens[-1], self.cache)    # the newest token only
# [end ch01-generate-steps]


class CachedInC(Cached):
    """Cached, with every step after the prompt's run in the C core: Model.decode_steps
    runs decode and the same choice of token for up to `chunk` steps without coming back
    to Python (on a model as small as the kit's, a trip through Python and back costs about
    a sixth of a step), and next_token hands its tokens out one by one. The same tokens and
    the same numbers taken from the generator as Cached: tested."""

    def __init__(self, model: Model, ids: List[int], cache, sampling: tuple,
                 max_new_tokens: int, eos: Optional[int], chunk: int):
        super().__init__(model, ids, cache, sampling)
        self.max_new_tokens, self.eos, self.chunk = max_new_tokens, eos, chunk
        self.ready: collections.deque = collections.deque()   # (token, seconds), chosen in C

    def next_token(self, new_tokens: List[int]) -> Tuple[int, float]:
        if not new_tokens:
            return super().next_token(new_tokens)          # the prompt's step, as Cached
        if not self.ready:
            self.ready.extend(self._decode_steps(new_tokens))
        return self.ready.popleft()

    def _decode_steps(self, new_tokens: List[int]) -> Iterable[Tuple[int, float]]:
        """The next steps in C, up to the chunk, the length limit or the stop token."""
        n = min(self.max_new_tokens - len(new_tokens), self.chunk)
        temperature, top_k, top_p, rng = self.sampling
        try:
            picks, times = self.model.decode_steps(new_tokens[-1], self.cache, n, temperature,
                                                   top_k, top_p, rng, stop_token=self.eos)
        except ValueError as error:           # the arguments were checked: bad logits
            done = len(getattr(error, "completed", ((),))[0])
            raise ValueError(f"generate, new token {len(new_tokens) + done}: {error}") from None
        return zip(picks.tolist(), times.tolist())


class WithCachePolicy(Steps):
    """Over a cache that keeps only the rows a policy chooses (kvlab.cache_policy, chapter
    8): it holds the policy's budget of rows and drops the others as the sequence grows. A
    policy with a fixed budget (all but SnapKV) may generate past the model's context; the
    positions it then uses were never seen in training. A model whose config has a
    sliding_window runs this way with SlidingWindow(config.sliding_window), as it was
    trained, once the sequence outgrows that window."""

    def __init__(self, model: Model, ids: List[int], policy: CachePolicy,
                 cache_format: CacheFormat, capacity: int, sampling: tuple):
        # a bounded policy's cache is its budget; SnapKV's grows after the prompt's compression
        cache = (policy.new_cache(model, cache_format) if policy.bounded
                 else policy.new_cache(model, cache_format, max_seq_len=capacity))
        super().__init__(model, ids, cache, sampling)
        self.policy = policy

    def logits(self, new_tokens: List[int]) -> np.ndarray:
        # as Cached, dropping rows as it must
        tokens = new_tokens[-1:] if new_tokens else self.ids
        return self.policy.forward(self.model, tokens, self.cache)


class Speculative(Steps):
    """Over a cache, with a drafter's guesses checked several at a time (kvlab.speculative,
    chapter 9): after the prompt's step, each pass runs the newest token and up to
    draft_tokens drafts in one forward and keeps the drafts up to the first the model
    refuses, plus one token of its own; next_token hands them out one by one, each with an
    equal share of the pass's time. Greedy: the same tokens as Cached; sampled: the same
    distribution (the rejection rule). stats counts the passes, drafts and tokens."""

    def __init__(self, model: Model, ids: List[int], cache, sampling: tuple,
                 drafter: Drafter, draft_tokens: int, max_new_tokens: int):
        super().__init__(model, ids, cache, sampling)
        self.drafter, self.max_new_tokens = drafter, max_new_tokens
        self.stats = SpeculationStats(draft_tokens)
        self.passes_before = getattr(drafter, "passes", 0)   # a DraftModel counts its own
        self.ready: collections.deque = collections.deque()  # (token, seconds), not handed out

    def next_token(self, new_tokens: List[int]) -> Tuple[int, float]:
        if not self.ready:
            start = time.perf_counter()
            produced = self._produce(new_tokens)
            each = (time.perf_counter() - start) / len(produced)
            self.ready.extend((token, each) for token in produced)
            self.stats.draft_passes = getattr(self.drafter, "passes", 0) - self.passes_before
        self.stats.tokens += 1              # an end-of-sequence token counts as generated
        return self.ready.popleft()

    def _produce(self, new_tokens: List[int]) -> List[int]:
        if not new_tokens:                  # the prompt's step, as Cached
            return [_choose(self.model.prefill(self.ids, self.cache), self.sampling, 0,
                            len(self.ids))]
        return speculative_pass(self.model, self.cache, self.ids, new_tokens, self.drafter,
                                self.max_new_tokens - len(new_tokens), self.sampling,
                                self.stats)


def _choose(logits: np.ndarray, sampling: tuple, step: int, prompt_len: int) -> int:
    """The next token, as kvlab.sampling.sample chooses it; NaN logits name the step."""
    try:
        return sample(logits, *sampling)
    except ValueError as error:            # the arguments were checked: bad logits
        raise ValueError(f"generate, new token {step} (position {prompt_len + step - 1}): "
                         f"{error}") from None


# ---- choosing the way, and checking the arguments -------------------------------------------

def _choose_steps(model: Model, ids: List[int], params: SamplingParams, eos: Optional[int],
                  cache_format: CacheFormat, *, use_cache, fast, progress: bool,
                  speculate: Optional[Drafter], draft_tokens,
                  cache_policy: Optional[CachePolicy]) -> Steps:
    """The way generate runs its steps, with its cache, once the request is known to fit."""
    use_cache = arguments.flag(use_cache, "use_cache")
    fast = arguments.flag(fast, "fast")
    # The last sampled token is never fed back, so the cache needs one slot less.
    capacity = len(ids) + params.max_new_tokens - 1
    policy = _cache_policy(model, cache_policy, capacity, use_cache, speculate, cache_format)
    if len(ids) + params.max_new_tokens > model.config.max_seq_len and \
            not (policy is not None and policy.bounded):
        raise ContextLengthError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                                 f"({params.max_new_tokens}) exceeds the model's context of "
                                 f"{model.config.max_seq_len} tokens")
    if speculate is not None:
        _check_speculation(model, speculate, draft_tokens, use_cache, cache_format)
    sampling = (params.temperature, params.top_k, params.top_p,
                np.random.default_rng(params.seed))
    if not use_cache:
        return Uncached(model, ids, None, sampling)
    if policy is not None:
        return WithCachePolicy(model, ids, policy, cache_format, capacity, sampling)
    if cache_format.window > capacity:          # a residual window no longer than the cache
        cache_format = dataclasses.replace(cache_format, window=capacity)
    cache = model.new_cache(capacity, cache_format)
    if speculate is not None:
        return Speculative(model, ids, cache, sampling, speculate, draft_tokens,
                           params.max_new_tokens)
    if fast:
        chunk = PROGRESS_CHUNK if progress else params.max_new_tokens
        return CachedInC(model, ids, cache, sampling, params.max_new_tokens, eos, chunk)
    return Cached(model, ids, cache, sampling)


def _sampling_params(params: Optional[SamplingParams], **shorthand) -> SamplingParams:
    """params, or the SamplingParams that generate's shorthand keywords describe."""
    if params is None:
        return SamplingParams(n=1, **shorthand)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a kvlab.SamplingParams, got {type(params).__name__}")
    given = [name for name, value in shorthand.items()
             if not (type(value) is type(SHORTHAND_DEFAULTS[name])
                     and value == SHORTHAND_DEFAULTS[name])]
    if given:
        raise TypeError(f"give params or its shorthand ({', '.join(given)}), not both")
    if params.n != 1:
        raise ValueError(f"generate makes one sequence; n={params.n} samples of a prompt "
                         f"are kvlab.Engine's")
    return params


# what **cache_options may hold: Model.cache_format's keywords (its old cache_dtype too)
CACHE_OPTIONS = tuple(name for name, parameter in
                      inspect.signature(Model.cache_format).parameters.items()
                      if parameter.kind is parameter.KEYWORD_ONLY) + ("cache_dtype",)


def _cache_format(model: Model, dtype, cache_options: dict) -> CacheFormat:
    unknown = [name for name in cache_options if name not in CACHE_OPTIONS]
    if unknown:             # a typo or another library's name, not a cache format option
        hint = {"max_tokens": " (the length is max_new_tokens)",
                "n": " (n samples of a prompt are kvlab.Engine's)"}.get(unknown[0], "")
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}{hint}; "
                        f"its cache format options are {', '.join(CACHE_OPTIONS[:6])}")
    if "cache_dtype" in cache_options:            # its name before dtype was one word
        if dtype is not None:
            raise TypeError("give dtype only (cache_dtype is its old name)")
        renamed("generate(cache_dtype=...)", "generate(dtype=...)", stacklevel=4)
        dtype = cache_options.pop("cache_dtype")
    return model.cache_format("fp32" if dtype is None else dtype, **cache_options)


def _read_prompt(model: Model, prompt, messages) -> Tuple[str, List[int], Optional[int]]:
    """The prompt's text ("" for token ids), its ids, and the token that ends an answer."""
    if messages is not None:
        if prompt is not None:
            raise TypeError("give a prompt or messages, not both")
        prompt_text, ids = chat.prompt(model, messages)
        return prompt_text, ids, chat.end_of_turn_id(model.tokenizer)
    eos = getattr(model.tokenizer, "eos_id", None)
    if prompt is None:
        raise TypeError("generate needs a prompt (text or token ids) or messages")
    if isinstance(prompt, str):
        ids = model.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer has no BOS token to "
                             "start from; give at least one character")
        return prompt, ids, eos
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
    return "", as_token_array(prompt, model.config.vocab_size).tolist(), eos


def _cache_policy(model: Model, policy: Optional[CachePolicy], capacity: int, use_cache: bool,
                  speculate, cache_format: CacheFormat) -> Optional[CachePolicy]:
    """The policy to run with: the one given, or the model's own sliding window once the
    sequence outgrows it; None when there is none, or it would never drop a row."""
    window = model.config.sliding_window
    if policy is None and window is not None and capacity > window:
        if not use_cache or speculate is not None or cache_format.window > 0:
            raise ValueError(f"this model attends to its last {window} positions "
                             f"(config.sliding_window), which kvlab runs over a cache that drops "
                             f"older rows (kvlab.cache_policy.SlidingWindow): that needs "
                             f"use_cache=True, no speculate= and no residual window, or at most "
                             f"{window} positions in all")
        policy = SlidingWindow(window)            # the model's own attention: its last window
    if policy is None:
        return None
    _check_cache_policy(policy, use_cache, speculate, cache_format)
    if policy.bounded and capacity <= policy.budget:
        return None       # it would never drop a row: a plain cache, no larger than needed
    return policy


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


class _NoBar:
    """What the loop updates when no progress bar shows."""
    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress_bar(enabled: bool, total: int, cached: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"generating ({'cached' if cached else 'uncached'})",
                unit="tok", leave=False)
