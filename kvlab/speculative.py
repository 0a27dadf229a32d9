"""Speculative decoding: guess several tokens cheaply, check them all in one forward pass.

Decoding runs one forward pass per token, and on a small batch each pass reads every
weight for one token's worth of arithmetic. Speculation makes each pass count for more: a
drafter proposes k tokens, the model runs its newest token and the k drafts over the cache
in ONE pass (verification is a prefill: chapter 1's causal pass over new tokens), and keeps
the drafts as long as they are what it would have chosen itself, plus one token of its own
after them. The K and V of the rejected drafts were written to the cache and are simply cut
off again (cache.truncate): rollback is the cache forgetting positions, which it never
needed. With greedy choice the output is the model's own, token for token (tested on every
model the kit ships or reads); only the number of passes changes.

Drafters (anything with propose(tokens, k) -> a list of at most k ids):
    PromptLookup(ngram=3)          the tokens that followed the last n-gram the last time it
                                   occurred in the context: no second model (prompt lookup)
    DraftModel(small_model)        a smaller model with the same vocabulary, greedy
    DraftModel.first_layers(model, n)  the model's own first n layers and classifier
                                   (self-speculation), so the bundled model can demo it alone

    out = kvlab.generate(model, prompt, 100, speculate=PromptLookup(), draft_tokens=4)
    out.speculation.acceptance_rate, out.speculation.passes_saved

Sampling (temperature > 0, with top_k and top_p as generate takes them) uses the rejection
rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023), which leaves the
output's distribution exactly the model's: draft x, drawn with probability q(x), is kept
with probability min(1, p(x) / q(x)), where p is the model's distribution at that position;
at the first draft refused, the token is drawn from max(0, p - q) renormalized instead, and
after k kept drafts, one more from p. A prompt-lookup draft is certain (q(x) = 1). The
tokens are the same in distribution, not draw for draw: plain sampling and speculation use
the random numbers differently (tested statistically on a small vocabulary).

kvlab.generate (speculative_pass below, one pass) and the batching engine (kvlab.Engine(...,
speculate=...)) share the steps of a pass: propose_drafts, verify_drafts, keep_until_stop
and SpeculationStats.count_pass.
"""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import arguments
from .model import Model
from .reference import probabilities
from .sampling import sample


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int, sampling: Optional[tuple] = None) -> List[int]:
        """At most k token ids likely to follow `tokens` (the whole context so far), drawn
        with sampling = (temperature, top_k, top_p, rng) when it is given. A drafter whose
        drafts are random sets last_probabilities: q, the distribution each was drawn
        from; None (or no such attribute) means each draft was certain. A drafter that
        keeps state about one context (DraftModel: its cache) may also have spawn(): a
        drafter like it with state of its own, which the engine gives each sequence."""


@dataclasses.dataclass
class SpeculationStats:
    """What speculation did in one generate call, or for one sample of an Engine request
    (the totals of several sequences: SpeculationStats.total)."""
    draft_tokens: int                  # k: drafts asked for per pass (fewer near the end)
    verify_passes: int = 0             # forward passes of the model after the prompt's
    drafted: int = 0                   # draft tokens proposed and checked
    accepted: int = 0                  # ... that the model agreed with
    accepted_at: List[int] = dataclasses.field(default_factory=list)   # accepted[i]: drafts
                                       # accepted at position i of a pass (0 = the first)
    proposed_at: List[int] = dataclasses.field(default_factory=list)   # drafts proposed there
    draft_passes: int = 0              # forward passes the drafter ran (0 for prompt lookup)
    tokens: int = 0                    # tokens generated (EOS included, if it stopped there)
    sequences: int = 1                 # sequences counted: each one's first token came from
                                       # its prompt's pass, not from a verification

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> List[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def passes_saved(self) -> int:
        """Forward passes of the model that plain decoding would have run and this did not
        (one per token after each sequence's first, against one per verification)."""
        return max(0, self.tokens - self.sequences) - self.verify_passes

    def count_pass(self, drafted: int, accepted: int) -> None:
        """One verification pass: `drafted` drafts checked, the first `accepted` kept."""
        for i in range(drafted):
            if i == len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
        self.verify_passes += 1
        self.drafted += drafted
        self.accepted += accepted

    @classmethod
    def total(cls, parts: Iterable["SpeculationStats"], draft_tokens: int) -> "SpeculationStats":
        """The sum of several sequences' counts (a sequence that has made no token yet has
        no first token: it is not counted in `sequences`)."""
        out = cls(draft_tokens, sequences=0)
        for part in parts:
            for name in ("verify_passes", "drafted", "accepted", "draft_passes", "tokens"):
                setattr(out, name, getattr(out, name) + getattr(part, name))
            out.sequences += part.sequences if part.tokens else 0
            for i in range(len(part.proposed_at)):
                if i == len(out.proposed_at):
                    out.proposed_at.append(0)
                    out.accepted_at.append(0)
                out.proposed_at[i] += part.proposed_at[i]
                out.accepted_at[i] += part.accepted_at[i]
        return out


class PromptLookup:
    """Prompt lookup: find the most recent earlier place where the context's last n tokens
    (n = ngram, then shorter, down to min_ngram) occurred, and propose what followed it.
    Free to run, and right surprisingly often: text repeats itself (names, code, quotes)."""

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        ngram = arguments.positive(ngram, "ngram")
        min_ngram = arguments.positive(min_ngram, "min_ngram")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"need 1 <= min_ngram <= ngram, got {min_ngram} and {ngram}")
        self.ngram, self.min_ngram = ngram, min_ngram

    last_probabilities = None          # its drafts are certain: q(x) = 1

    # [quote ch09-prompt-lookup]
    def propose(self, tokens: Sequence[int], k: int, sampling: Optional[tuple] = None) -> List[int]:
        tokens = list(tokens)
        for n in range(min(self.ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            # latest match first, and never the tail itself
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []
    # [end ch09-prompt-lookup]


class DraftModel:
    """A smaller model that drafts greedily, over a KV cache of its own. Between calls its
    cache keeps what it computed that is still in the context, and forgets (truncates) the
    drafts the target model rejected."""

    def __init__(self, model: Model, dtype: str = "fp32"):
        if not isinstance(model, Model):
            raise TypeError(f"DraftModel drafts with a kvlab.Model, got {type(model).__name__}")
        self.model, self.dtype = model, dtype
        self.cache = model.new_cache(dtype=dtype)     # its own cache, in any format
        self.cached: List[int] = []    # the tokens whose K and V are in self.cache
        self.passes = 0                # forward passes run, over every call
        self.last_probabilities: Optional[List[np.ndarray]] = None

    # [quote ch09-first-layers]
    @classmethod
    def first_layers(cls, model: Model, n_layers: int, dtype: str = "fp32") -> "DraftModel":
        """Self-speculation: the model's own first n_layers, then its final norm and
        classifier, as the drafter (the weights are shared, not copied)."""
        if not isinstance(model, Model):
            raise TypeError(f"first_layers takes a kvlab.Model, got {type(model).__name__}")
        n_layers = arguments.integer(n_layers, "n_layers", None, None)
        if not 1 <= n_layers < model.config.n_layers:
            raise ValueError(f"n_layers must be between 1 and {model.config.n_layers - 1}, "
                             f"got {n_layers}")
        w = model.weights
        layers = {name: getattr(w, name)[:n_layers] for name in
                  ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")}
        small = Model(model.config.replace(n_layers=n_layers), dataclasses.replace(w, **layers),
                      model.tokenizer, source=f"{model.source} (first {n_layers} layers)",
                      activations=model.activations)
        return cls(small, dtype)
    # [end ch09-first-layers]

    def spawn(self) -> "DraftModel":
        """A drafter with the same model (weights shared) and a cache of its own. The
        engine drafts for each sequence with its own: a cache holds one context, and two
        sequences drafted in turn with one drafter would refill it at every call."""
        return DraftModel(self.model, self.dtype)

    def check_compatible(self, target: Model) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model.config.vocab_size} "
                             f"ids) is not the model's ({target.config.vocab_size})")

    def propose(self, tokens: Sequence[int], k: int, sampling: Optional[tuple] = None) -> List[int]:
        """k drafts, greedy, or drawn from the draft model's own distribution (q, kept in
        last_probabilities) with the same temperature, top_k and top_p."""
        tokens = list(tokens)
        self.last_probabilities = None
        if k < 1 or len(tokens) + k > self.cache.capacity:
            return []
        # keep the longest cached prefix of the context, and always feed at least one token
        keep = 0
        limit = min(len(self.cached), len(tokens) - 1, self.cache.length)
        while keep < limit and self.cached[keep] == tokens[keep]:
            keep += 1
        self.cached = []               # until the cache holds what it says again (an
        self.cache.truncate(keep)      # interrupted call leaves it unknown)
        self.cached = tokens[:keep]
        logits = self.model.prefill(tokens[keep:], self.cache)
        self.passes += 1
        drafts: List[int] = []
        q: List[np.ndarray] = []
        while True:
            if sampling is None or sampling[0] == 0.0:
                drafts.append(sample(logits))
            else:
                temperature, top_k, top_p, rng = sampling
                q.append(probabilities(logits, temperature, top_k, top_p))
                drafts.append(_draw(q[-1], rng))
            if len(drafts) == k:
                break
            logits = self.model.decode(drafts[-1], self.cache)
            self.passes += 1
        self.cached = tokens + drafts[:-1]
        self.last_probabilities = q or None
        return drafts


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from a distribution (inverse transform with one number from rng)."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf / cdf[-1], rng.random(), side="right")), len(probs) - 1)


def check_drafter(model: Model, drafter, draft_tokens) -> None:
    """TypeError / ValueError, at once, for a drafter or a draft_tokens that cannot work."""
    if isinstance(drafter, type) or not callable(getattr(drafter, "propose", None)):
        what = (f"the class {drafter.__name__}" if isinstance(drafter, type)
                else type(drafter).__name__)
        raise TypeError(f"speculate takes a drafter (kvlab.speculative.PromptLookup(), "
                        f"DraftModel(...)), got {what}")
    arguments.positive(draft_tokens, "draft_tokens")
    if hasattr(drafter, "check_compatible"):
        drafter.check_compatible(model)


def propose_drafts(drafter: Drafter, context: Sequence[int], k: int, room: int,
                   sampling: tuple, vocab_size: int) -> Tuple[List[int], Optional[list]]:
    """The drafts for the next pass after `context`, and the distributions they were drawn
    from (None: certain). At most k, and at most room - 1 when only `room` more tokens may
    be generated: drafts that could all be kept, with the model's own token after them.
    A drafter's junk is refused (TypeError, ValueError); a proposal longer than asked is cut.
    When sampling, each of its distributions (last_probabilities) is checked too: one per
    draft, over the whole vocabulary, finite, none negative, summing to 1, and giving its
    draft a chance; before, NaN, negative or all-zero ones were used without a word and a
    short one leaked an IndexError."""
    wanted = min(k, room - 1)
    if wanted <= 0:
        return [], None
    drafts = drafter.propose(context, wanted, sampling)
    if drafts is None or isinstance(drafts, (str, bytes)):
        raise TypeError(f"a drafter's propose() returns a list of token ids, got {drafts!r}")
    drafts = list(drafts)[:wanted]
    for d in drafts:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"a drafter proposed {d!r}: drafts are integer token ids")
        if not 0 <= d < vocab_size:
            raise ValueError(f"a drafter proposed token {d}, out of range [0, {vocab_size})")
    drafts = [int(d) for d in drafts]
    q = getattr(drafter, "last_probabilities", None) if drafts else None
    if q is None:
        return drafts, None
    if isinstance(q, (str, bytes)) or not isinstance(q, (collections.abc.Sequence, np.ndarray)):
        raise TypeError(f"a drafter's last_probabilities is None or one distribution per "
                        f"draft (a list of arrays), got {type(q).__name__}")
    if len(q) < len(drafts):
        raise ValueError(f"the drafter gave {len(drafts)} drafts but {len(q)} "
                         f"distributions (last_probabilities) to check them with")
    if sampling[0] == 0.0:             # greedy: verification never reads q
        return drafts, q
    return drafts, [_distribution(q[i], i, x, vocab_size) for i, x in enumerate(drafts)]


def _distribution(q_i, i: int, draft: int, vocab_size: int) -> np.ndarray:
    """A drafter's q for draft i, checked where it enters: the rejection rule keeps draft x
    with probability min(1, p(x) / q(x)) and draws a refused one from max(0, p - q), so q
    must be a distribution over the whole vocabulary (vocab_size finite values, none
    negative, summing to 1) that gave the draft a chance (q(x) > 0). Returned as it is
    (a float array), so a drafter's own q is used bit for bit."""
    name = f"the drafter's last_probabilities[{i}]"
    try:
        array = np.asarray(q_i)
    except Exception as exc:            # a ragged list, an object that is no array
        raise TypeError(f"{name} must be an array of {vocab_size} probabilities: {exc}") from None
    if array.dtype == bool or array.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be an array of {vocab_size} probabilities, got "
                        f"dtype {array.dtype}")
    if array.shape != (vocab_size,):
        raise ValueError(f"{name} has shape {array.shape}: a distribution over the "
                         f"vocabulary has {vocab_size} probabilities")
    if array.dtype.kind != "f":
        array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds NaN or infinite values: it is not a distribution")
    if (array < 0).any():
        raise ValueError(f"{name} holds a negative probability "
                         f"({float(array.min())}) at token {int(array.argmin())}")
    total = float(array.sum(dtype=np.float64))
    if not abs(total - 1.0) <= 1e-3:
        raise ValueError(f"{name} sums to {total}, not 1: it is not a distribution"
                         + (" (all zero)" if total == 0 else ""))
    if not array[draft] > 0:
        raise ValueError(f"{name} gives draft {draft} probability 0: a draft drawn from q "
                         f"has q(x) > 0")
    return array


# [quote ch09-verify]
def verify_drafts(rows: np.ndarray, drafts: List[int], q: Optional[list],
                  sampling: tuple) -> Tuple[int, int]:
    """(drafts kept, the model's token after them). rows[i]: the model's logits for the
    position of drafts[i] (and rows[len(drafts)] after the last). Greedy: kept while each
    is the arg-max; sampled: the rejection rule (see the module text), its random numbers
    from sampling's rng. Raises ValueError on NaN in a row it reads."""
    temperature, top_k, top_p, rng = sampling
    if temperature == 0.0:                     # greedy: kept while it is the arg-max
        accepted = 0
        while accepted < len(drafts) and sample(rows[accepted]) == drafts[accepted]:
            accepted += 1
        return accepted, sample(rows[accepted])
    for i, x in enumerate(drafts):
        if np.isnan(rows[i]).any():            # as sample() refuses them
            raise ValueError("the logits hold NaN: no token can be chosen")
        p = probabilities(rows[i], temperature, top_k, top_p)
        if q is not None:
            q_i = q[i]
        else:                                  # a certain draft: q is all on x
            q_i = np.zeros_like(p)
            q_i[x] = 1.0
        if rng.random() * q_i[x] < p[x]:       # kept with probability min(1, p(x) / q(x))
            continue
        residual = np.maximum(p - q_i, 0.0)    # refused: draw from what p has beyond q
        return i, _draw(residual if residual.sum() > 0 else p, rng)
    return len(drafts), sample(rows[len(drafts)], temperature, top_k, top_p, rng)
# [end ch09-verify]


def keep_until_stop(produced: List[int], eos: Optional[int],
                    room: int) -> Tuple[List[int], Optional[str]]:
    """What plain decoding keeps of the tokens one pass produced, taken one by one: it
    stops at the end-of-sequence token (not kept: "eos") or once `room` tokens are kept
    ("length"); None when it goes on."""
    for i, token in enumerate(produced):
        if token == eos:
            return produced[:i], "eos"
        if i + 1 == room:
            return produced[:i + 1], "length"
    return list(produced), None


def speculative_pass(model: Model, cache, ids: List[int], new_tokens: List[int],
                     drafter: Drafter, room: int, sampling: tuple,
                     stats: SpeculationStats) -> List[int]:
    """One pass of generate's speculation (kvlab.generate.Speculative runs them after the
    prompt's step): the newest token and up to stats.draft_tokens drafts in one forward
    over the cache, where at most `room` more tokens may be generated. Returns the tokens
    it produced, the drafts up to the first the model refuses and one token of the model's
    own after them; the refused drafts' K and V are cut off the cache again."""
    # [quote ch09-speculative-pass]
    # drafts that could all be kept, with the model's own token after them
    drafts, q = propose_drafts(drafter, ids + new_tokens, stats.draft_tokens, room,
                               sampling, model.config.vocab_size)
    rows = model.forward([new_tokens[-1]] + drafts, cache, all_logits=True)
    accepted, token = verify_drafts(rows, drafts, q, sampling)
    stats.count_pass(len(drafts), accepted)
    # the cache now holds the newest token and every draft: keep the accepted ones
    cache.truncate(len(ids) + len(new_tokens) + accepted)
    return drafts[:accepted] + [token]
    # [end ch09-speculative-pass]
