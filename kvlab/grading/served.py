"""The speculative-decoding lab's model, lent to the student's code by reference.

Like every object a lab lends (handouts.py has the other labs'), it never leaves the
judge's process: the student's code gets a proxy (kvlab/grading/remote.py, ServedObject; worker.py, JudgeObject) whose
method calls come back to the judge and run here. So what they count cannot be forged
from the worker, and what they hold is read by the tests directly.

ServedModel is the bundled model as the speculative-decoding lab lends it: the same calls
as kvlab's Model (forward over a cache, new_cache, encode, decode_text, config) and caches
with kvlab's KVCache's length, capacity, truncate, keys and values. It writes down every
forward pass it runs (Pass: which cache, where it started, the tokens, the arg-max of each
row, when), which is how the lab's tests count passes and accepted drafts.

ServedRandom is a seeded NumPy generator lent the same way, for the sampling rejection
rule: random() and choice(a, p=...) as numpy.random.Generator has them, every draw written
down, so the tests choose the seed and see each number the rule drew and each
distribution it drew a token from.
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Tuple

import numpy as np

from ..errors import CacheFullError
from .handouts import MAX_CACHES, bundled_model, config_fields, text_to_encode
from .remote import ServedObject
from .wire import Record

MAX_PASSES = 4096         # forward passes one served model runs (a test needs a few hundred)
MAX_DRAWS = 100_000       # draws one served generator makes (a test needs a few thousand)
MAX_ITEMS = 1 << 20       # items one choice draws among (a model's vocabulary is far fewer):
                          # choice(10 ** 10) would have the judge build 80 GB of them


@dataclasses.dataclass(frozen=True)
class Pass:
    """One forward pass the served model ran."""
    cache: "ServedCache"
    start: int                    # positions the cache held before it
    tokens: Tuple[int, ...]       # the tokens it ran (at positions start, start + 1, ...)
    all_logits: bool              # every row asked for, or only the last
    picks: Tuple[int, ...]        # the arg-max of each row (the greedy choice after each token)
    context: Tuple[int, ...]      # what the cache held before it (start tokens)
    started: float                # time.perf_counter() when it began and ended (the same
    ended: float                  # clock in every process of the machine)

    @property
    def drafts(self) -> Tuple[int, ...]:
        """Read as a verification pass: the tokens after the first."""
        return self.tokens[1:]

    @property
    def accepted(self) -> int:
        """Drafts the greedy rule keeps: while draft i is the arg-max of row i."""
        kept = 0
        while kept < len(self.drafts) and self.drafts[kept] == self.picks[kept]:
            kept += 1
        return kept


class ServedCache(ServedObject):
    """A kvlab KVCache made by a ServedModel, in the judge: length, capacity, truncate(n),
    keys and values (copies, (n_layers, length, n_kv_heads, head_dim)), as kvlab's."""
    served_methods = ("truncate",)
    served_attributes = ("length", "capacity", "keys", "values")
    served_type_name = "KVCache"

    def __init__(self, model: "ServedModel", cache, number: int):
        self._model, self._cache, self.number = model, cache, number
        self.tokens: List[int] = []        # the token of every position it holds

    @property
    def length(self) -> int:
        return self._cache.length

    @property
    def capacity(self) -> int:
        return self._cache.capacity

    @property
    def keys(self) -> np.ndarray:
        return self._cache.keys.copy()

    @property
    def values(self) -> np.ndarray:
        return self._cache.values.copy()

    def truncate(self, n) -> None:
        """Keep the first n positions, as if the rest never came."""
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"truncate(n) takes an int, got {n!r}")
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({int(n)}): the cache holds {self.length} positions; "
                             f"n must be between 0 and {self.length}")
        self._cache.truncate(int(n))
        del self.tokens[int(n):]

    def __repr__(self) -> str:
        return f"<cache {self.number}: {self.length} of {self.capacity} positions>"


class ServedModel(ServedObject):
    """The bundled model, served from the judge, with a record of every forward pass.

        model.config                     shape (vocab_size, n_layers, max_seq_len, ...)
        model.new_cache(max_seq_len=None)
        model.forward(tokens, cache, all_logits=False)
        model.encode(text), model.decode_text(ids)
    """
    served_methods = ("forward", "new_cache", "encode", "decode_text")
    served_attributes = ("config",)
    served_type_name = "Model"

    def __init__(self, model=None):
        if model is None:
            model = bundled_model()
        self._model = model
        self.passes: List[Pass] = []
        self.caches: List[ServedCache] = []

    @property
    def config(self) -> Record:
        return Record("ModelConfig", config_fields(self._model.config))

    def new_cache(self, max_seq_len=None) -> ServedCache:
        """A cache for up to max_seq_len positions (default: the model's context)."""
        context = self._model.config.max_seq_len
        if max_seq_len is None:
            max_seq_len = context
        if isinstance(max_seq_len, (bool, np.bool_)) or not isinstance(max_seq_len, (int, np.integer)) \
                or not 1 <= max_seq_len <= context:
            raise ValueError(f"max_seq_len must be an int from 1 to the model's context, "
                             f"{context}; got {max_seq_len!r}")
        if len(self.caches) >= MAX_CACHES:
            raise ValueError(f"this model has made {MAX_CACHES} caches already: reuse one "
                             f"(cache.truncate(0) empties it)")
        cache = ServedCache(self, self._model.new_cache(int(max_seq_len)), len(self.caches))
        self.caches.append(cache)
        return cache

    def forward(self, tokens, cache=None, all_logits=False) -> np.ndarray:
        """Run `tokens` at the cache's next positions, appending their K and V; the last
        row of logits (vocab_size,), or every row (len(tokens), vocab_size) with
        all_logits=True. One call is one forward pass."""
        if not isinstance(cache, ServedCache) or cache._model is not self:
            raise TypeError("forward(tokens, cache, all_logits=False) runs the tokens over a "
                            "cache this model made (model.new_cache()); got "
                            + ("no cache" if cache is None else "something else"))
        if not isinstance(all_logits, (bool, np.bool_)):
            raise TypeError(f"all_logits is True or False, got {all_logits!r}")
        if isinstance(tokens, (int, np.integer)):
            raise TypeError("forward takes a list of token ids (write [token] for one)")
        ids = np.asarray(tokens)
        if ids.dtype == object:
            raise TypeError("token ids must be integers")
        if len(self.passes) >= MAX_PASSES:
            raise ValueError(f"this model has run {MAX_PASSES:,} forward passes, far more than "
                             f"the test needs")
        context, start = tuple(cache.tokens), cache.length
        started = time.perf_counter()
        try:
            rows = self._model.forward(ids, cache._cache, all_logits=True)
        except CacheFullError as error:
            if len(ids) + start <= cache.capacity:
                raise
            raise CacheFullError(self.overflow(cache, len(ids))) from None
        ended = time.perf_counter()
        ran = tuple(int(t) for t in ids.tolist())
        cache.tokens.extend(ran)
        self.passes.append(Pass(cache, start, ran, bool(all_logits),
                                tuple(int(i) for i in np.argmax(rows, axis=-1)), context,
                                started, ended))
        return rows if all_logits else rows[-1]

    def overflow(self, cache: ServedCache, n: int) -> str:
        """Why `cache` cannot take n more positions, for a speculative loop: the likely cause
        is not its size but rejected drafts left in it (a missing rollback), so say which
        pass left them, where the passes show it."""
        message = (f"the KV cache is full: it holds {cache.length} of {cache.capacity} "
                   f"positions and cannot take {n} more")
        passes = self.passes_over(cache)
        for before, after in zip(passes[1:], passes[2:]):
            kept = before.start + 1 + before.accepted        # newest token and accepted drafts
            if len(before.drafts) > before.accepted and after.start > kept:
                return (f"{message}. After the pass at position {before.start}, which checked "
                        f"{len(before.drafts)} drafts and accepted {before.accepted}, the cache "
                        f"should have held {kept} positions, but the next pass started at "
                        f"{after.start}: the rejected drafts' K and V stayed in it. Roll back "
                        f"after each verification pass (cache.truncate): that, not a larger "
                        f"cache, is the fix")
        return (f"{message}. If it was made for the prompt and the tokens wanted, the likely "
                f"cause is in the loop, not the size: are the rejected drafts cut off the cache "
                f"after each verification pass (rollback, cache.truncate), and does no pass "
                f"draft more than the tokens still wanted minus one?")

    def encode(self, text) -> list:
        return [int(t) for t in self._model.encode(text_to_encode(text))]

    def decode_text(self, ids) -> str:
        if not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) > self._model.config.max_seq_len:
            raise ValueError(f"decode_text takes a list of at most {self._model.config.max_seq_len} "
                             f"token ids (the model's context)")
        ids = [int(t) for t in ids]
        return self._model.decode_text(ids)

    def passes_over(self, cache: ServedCache, since: int = 0) -> List[Pass]:
        """The passes run over `cache`, from pass number `since` on."""
        return [p for p in self.passes[since:] if p.cache is cache]

    def caches_used(self, since: int = 0) -> List[ServedCache]:
        """The caches passes ran over from pass number `since` on, in the order first used."""
        used: List[ServedCache] = []
        for p in self.passes[since:]:
            if not any(c is p.cache for c in used):
                used.append(p.cache)
        return used

    def __repr__(self) -> str:
        return f"<served model: {len(self.passes)} passes, {len(self.caches)} caches>"


@dataclasses.dataclass(frozen=True)
class Draw:
    """One draw the served generator made: random() (probabilities None) or choice."""
    method: str
    probabilities: Optional[np.ndarray]   # choice's p, as given (None: uniform, or random())
    result: float


class ServedRandom(ServedObject):
    """A numpy.random.Generator of the judge's, seeded by the test: random() and choice(a,
    p=None), one draw a call, each written down in `draws`.

        rng.random()                a float drawn uniformly from [0, 1)
        rng.choice(n, p=probs)      an int from 0 .. n - 1 drawn with these probabilities
                                    (a 1-D sequence for n: one of its items)
    """
    served_methods = ("random", "choice")
    served_type_name = "Generator"

    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)
        self.draws: List[Draw] = []

    def _record(self, draw: Draw) -> None:
        if len(self.draws) >= MAX_DRAWS:
            raise ValueError(f"this generator has made {MAX_DRAWS:,} draws, far more than the "
                             f"test needs")
        self.draws.append(draw)

    def random(self) -> float:
        u = float(self._rng.random())
        self._record(Draw("random", None, u))
        return u

    def choice(self, a, p=None):
        """One item of a (an int n: range(n)), drawn with probabilities p (None: evenly);
        a p that is not a distribution over a's items is refused, as NumPy refuses it."""
        if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
            if not 0 < a <= MAX_ITEMS:
                raise ValueError(f"a must be from 1 to {MAX_ITEMS:,} items, got {int(a):,}")
            a = range(int(a))
        items = np.asarray(a)
        if items.size > MAX_ITEMS:
            raise ValueError(f"a must be from 1 to {MAX_ITEMS:,} items, got {items.size:,}")
        if items.ndim != 1 or len(items) == 0 or items.dtype.kind not in "iuf":
            raise ValueError("a must be a positive int or a non-empty 1-D sequence of numbers")
        if p is not None:
            given = np.asarray(p)
            if given.dtype.kind not in "iuf" or given.shape != items.shape:
                raise ValueError(f"p must be {len(items)} probabilities, one per item of a; got "
                                 f"{given.dtype} of shape {given.shape}")
            p = given.astype(np.float64)
            if not np.isfinite(p).all() or (p < 0).any():
                raise ValueError("probabilities are not non-negative")
            # NumPy's tolerance: the square root of the precision p was given in
            kind = given.dtype if given.dtype.kind == "f" else np.dtype(np.float64)
            if abs(p.sum() - 1.0) > max(np.sqrt(np.finfo(np.float64).eps), np.sqrt(np.finfo(kind).eps)):
                raise ValueError(f"probabilities do not sum to 1 (they sum to {p.sum()!r})")
            p = p / p.sum()
        index = int(self._rng.choice(len(items), p=p))
        item = items[index].item()
        self._record(Draw("choice", p, item))
        return item
