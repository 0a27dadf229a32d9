"""Keeping fewer positions: cache policies that decide which rows a KV cache keeps.

The other levers shrink each row (GQA: fewer heads; kvlab.quant: fewer bits) or stop
wasting rows (kvlab.paged). These keep fewer rows, so that a cache of `budget` rows serves a
sequence of any length:

    SlidingWindow(window)          the newest `window` positions (Mistral's sliding window)
    AttentionSinks(sinks, window)  the first `sinks` positions and the newest `window`
                                   (StreamingLLM: the first tokens soak up attention)
    HeavyHitters(budget, recent)   the newest `recent`, and the rest by the attention they
                                   have received so far (H2O's heavy hitters)
    SnapKV(budget, observation)    after the prompt, the prompt rows the prompt's last
                                   `observation` queries attend to most (SnapKV); then the
                                   cache grows as usual

    policy = SlidingWindow(64)
    cache = policy.new_cache(model)
    logits = policy.forward(model, prompt_ids, cache)       # drops rows as it must
    cache.positions                                         # which positions are kept

How a policy runs: tokens go through the model as ordinary forward calls. When the cache
holds `budget` rows and another token comes, the policy picks `budget - 1` rows to keep
(keep() below), and the core keeps them as the cache's rows 0 .. budget - 2, in order
(cache.keep). Tokens that fit without dropping anything go in one call; after that, one at
a time, so every query sees exactly the rows the policy would leave it token by token,
however the tokens are split. Each layer and KV head may keep different rows (H2O and SnapKV
choose per head).

Where the rows are: the cache's memory holds them as a ring, and keep moves as few as it
can. A window turns the ring past its oldest row and moves none, so position p of a
SlidingWindow(w) lands in slot p % w, Mistral's rolling buffer (until a view below turns the
ring back); sinks move their few first rows; H2O moves, in each head, the rows on one side
of the row it drops (the side with fewer rows over all heads). What a policy
and a student read is in row order, oldest first, whatever the ring's turn: cache.positions
and cache.attention_weights (copies), and cache.keys, cache.values and the codes (zero-copy
views: reading one turns the ring back to slot 0 first, which moves every row once).

RoPE: positions as stored. A row keeps the rotation of the position it was computed at,
and a new token is rotated by its true position (cache.next_position), so attention sees
the same relative distances as without dropping anything. StreamingLLM instead rotates the
kept keys by their place in the shortened cache, so no position past the model's training
context is ever used; kvlab does not, and says so: past config.max_seq_len a model meets
rotations it was never trained on (tests/test_cache_policy.py checks both halves of this).

Not here: the attention arithmetic (csrc/model.c), keeping rows (csrc/kvcache.c), the sums
of attention weights (csrc/attention_weights.c), accuracy against a budget (kvlab.accuracy).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import arguments
from ._core import core
from .errors import CacheFullError
from .model import KVCache, Model, as_token_array


def _count(name: str, value, minimum: int) -> int:
    """A size of a policy (rows, positions, queries): an integer (not a bool, a float or a
    string: ArgumentTypeError) from `minimum` to a C int, checked when the policy is made,
    before any cache exists."""
    return arguments.integer(value, name, minimum, arguments.C_INT_MAX)


def _checked_rows(rows, cache, n_keep: int, policy: str) -> np.ndarray:
    """What a policy's keep() returned, checked before it reaches cache.keep: integer row
    indices (a float or a bool is no row, and a cast to int32 would wrap an index beyond
    it) shaped (n_layers, n_keep, n_kv_heads), each an existing row. cache.keep checks the
    rest (increasing rows) and changes nothing when it refuses."""
    array = np.asarray(rows)
    if array.dtype == bool or array.dtype.kind not in "iu":
        raise TypeError(f"{policy}.keep() must return integer row indices, got an array of "
                        f"{array.dtype}")
    want = (cache.shape[0], n_keep, cache.shape[2])
    if array.shape != want:
        raise ValueError(f"{policy}.keep() must return rows shaped (n_layers, n_keep, "
                         f"n_kv_heads) = {want}, got {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= cache.length):
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise ValueError(f"{policy}.keep() returned row {bad}, but the cache holds rows 0 .. "
                         f"{cache.length - 1}")
    return np.ascontiguousarray(array, np.int32)


def newest_rows(length: int, n: int, cache: KVCache) -> np.ndarray:
    """Rows length - n .. length - 1 for every layer and KV head: (n_layers, n, n_kv_heads)."""
    rows = np.arange(length - n, length, dtype=np.int32)
    return np.broadcast_to(rows[None, :, None], (cache.shape[0], n, cache.shape[2]))


def most_attended(weights: np.ndarray, n: int) -> np.ndarray:
    """The n rows with the largest weights for each layer and KV head, in row order.
    weights: (n_layers, n_rows, n_kv_heads). Ties go to the earlier row."""
    order = np.argsort(-weights, axis=1, kind="stable")[:, :n, :]
    return np.sort(order, axis=1).astype(np.int32)


class PagedRows:
    """A sequence of a CPU paged pool as a policy sees a cache: its length, shape and
    positions, and keep(), which the pool does for it (PagedPool.keep)."""

    tracks_attention = False

    def __init__(self, seq, model: Model):
        self.seq, pool, c = seq, seq.pool, model.config
        self.shape = (c.n_layers, pool.max_blocks_per_seq * pool.block_size, c.n_kv_heads,
                      c.head_dim)
        self.capacity, self.window = self.shape[1], pool.window

    @property
    def length(self) -> int:
        return self.seq.length

    @property
    def next_position(self) -> int:
        return self.seq.next_position

    @property
    def positions(self) -> np.ndarray:
        return self.seq.pool.positions(self.seq)

    def keep(self, rows: np.ndarray) -> None:
        self.seq.pool.keep(self.seq, rows)


class CachePolicy:
    """A cache of at most `budget` rows, and the rule for which ones to keep."""

    name = "policy"
    budget: int
    tracks_attention = False   # keep() reads cache.attention_weights
    bounded = True             # never holds more than `budget` rows, however long the sequence

    def keep(self, cache: KVCache, n_keep: int) -> np.ndarray:
        """The rows to keep, (n_layers, n_keep, n_kv_heads) int32, increasing along
        axis 1, when the cache is full and one more token is coming."""
        raise NotImplementedError

    def new_cache(self, model: Model, dtype="fp32", **format_options) -> KVCache:
        """A cache of exactly `budget` rows for this policy: its memory stays the same
        however long the sequence grows."""
        cache = model.new_cache(self.budget, dtype, **format_options)
        self._prepare(cache, model)
        return cache

    def _prepare(self, cache, model: Model):
        """The cache (or a paged sequence, as PagedRows) checked for this policy."""
        # (a GPU pool's rows cannot be dropped: the GPU reads row i as position i)
        if isinstance(cache, core.PagedSequence) and isinstance(cache.pool, core.PagedPool) \
                and cache.pool.device == "cpu":
            if self.tracks_attention:
                raise TypeError(f"{self.name} ranks rows by the attention they receive, which "
                                f"only a contiguous KVCache adds up: use model.new_cache()")
            cache = PagedRows(cache, model)
        elif not isinstance(cache, KVCache):
            raise TypeError(f"{self.name} drops rows of a KVCache or of a sequence of a CPU "
                            f"PagedPool, got {type(cache).__name__}: GPU caches keep every row")
        if cache.window:
            raise ValueError(f"{self.name}: a cache with a residual window keeps its newest "
                             f"rows by position and cannot drop rows; make it with window=0")
        if self.bounded and cache.capacity < self.budget:
            raise ValueError(f"{self.name} keeps {self.budget} rows but this cache has room "
                             f"for {cache.capacity}: make it with policy.new_cache(model)")
        if self.tracks_attention and not cache.tracks_attention:
            cache.track_attention(True)
        return cache

    # [quote ch08-policy-forward]
    def forward(self, model: Model, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """model.forward(tokens, cache, all_logits), dropping rows whenever the cache is full
        and another token comes."""
        ids = as_token_array(tokens, model.config.vocab_size)
        rows = self._prepare(cache, model)      # the cache, or a paged sequence's rows
        pieces, done = [], 0
        while done < len(ids):
            if rows.length >= self.budget:               # full: make room for one token
                rows.keep(_checked_rows(self.keep(rows, self.budget - 1), rows,
                                        self.budget - 1, type(self).__name__))
            # as many tokens as fit before the next drop, in one call
            n = min(self.budget - rows.length, len(ids) - done)
            pieces.append(model.forward(ids[done:done + n], cache, all_logits))
            done += n
        return np.concatenate(pieces) if all_logits else pieces[-1]
    # [end ch08-policy-forward]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(budget={self.budget})"


# [quote ch08-policies]
class SlidingWindow(CachePolicy):
    """Each token sees itself and the window - 1 positions before it."""

    name = "window"

    def __init__(self, window: int):
        self.window = self.budget = _count("window", window, 1)

    def keep(self, cache, n_keep):
        return newest_rows(cache.length, n_keep, cache)

    def __repr__(self):
        return f"SlidingWindow(window={self.window})"


class AttentionSinks(CachePolicy):
    """The first `sinks` positions, which soak up the attention a query gives to nothing
    in particular, and the newest `window` (the token's own row included)."""

    name = "sinks"

    def __init__(self, sinks: int = 4, window: int = 60):
        self.sinks = _count("sinks", sinks, 1)
        self.window = _count("window", window, 1)
        self.budget = _count("sinks + window", self.sinks + self.window, 2)

    def keep(self, cache, n_keep):
        # rows never move past each other, so the first rows hold the first positions
        first = np.broadcast_to(np.arange(self.sinks, dtype=np.int32)[None, :, None],
                                (cache.shape[0], self.sinks, cache.shape[2]))
        return np.concatenate([first, newest_rows(cache.length, n_keep - self.sinks, cache)],
                              axis=1)

    def __repr__(self):
        return f"AttentionSinks(sinks={self.sinks}, window={self.window})"


class HeavyHitters(CachePolicy):
    """H2O: the newest `recent` rows (the new token's own included), and budget - recent
    others by the attention weight they have received since they came (summed over every
    later query), per layer and KV head."""

    name = "h2o"
    tracks_attention = True

    def __init__(self, budget: int, recent: Optional[int] = None):
        self.budget = _count("budget", budget, 2)
        self.recent = self.budget // 2 if recent is None else _count("recent", recent, 1)
        if self.recent >= self.budget:
            raise ValueError(f"recent ({self.recent}) must be below the budget ({self.budget})")

    def keep(self, cache, n_keep):
        recent = min(self.recent - 1, n_keep)      # the token on its way is the last recent one
        older = cache.length - recent
        heavy = most_attended(cache.attention_weights[:, :older, :], n_keep - recent)
        return np.concatenate([heavy, newest_rows(cache.length, recent, cache)], axis=1)

    def __repr__(self):
        return f"HeavyHitters(budget={self.budget}, recent={self.recent})"
# [end ch08-policies]


class SnapKV(CachePolicy):
    """SnapKV: once the prompt has run, keep `budget` of its rows: its last `observation`
    positions, and the earlier ones that those positions' queries attend to most (weights
    smoothed over `kernel` neighbouring rows, so a chosen row brings its neighbours), per
    layer and KV head. The prompt is the first forward call on an empty cache; tokens after
    it are appended as usual: the cache must have room for them (new_cache's max_seq_len).
    The smoothing is a moving average that repeats the edge rows, not zeros as an average
    pool with padding would."""

    name = "snapkv"
    bounded = False

    def __init__(self, budget: int, observation: int = 16, kernel: int = 5):
        self.budget = _count("budget", budget, 1)
        self.observation = _count("observation", observation, 1)
        self.kernel = _count("kernel", kernel, 1)
        if self.observation > self.budget:
            raise ValueError(f"observation ({self.observation}) must not exceed the budget "
                             f"({self.budget}): the observed rows are always kept")

    def new_cache(self, model: Model, dtype="fp32", max_seq_len: Optional[int] = None,
                  **format_options) -> KVCache:
        """A cache that holds the whole prompt until it is compressed, and what follows:
        max_seq_len positions (default: the model's context)."""
        cache = model.new_cache(max_seq_len, dtype, **format_options)
        self._prepare(cache, model)
        return cache

    def forward(self, model, tokens, cache, all_logits=False):
        """The first call (the prompt) runs in two parts, the last `observation` tokens
        with their attention counted, then compresses the cache to `budget` rows; later
        calls are plain model.forward."""
        ids = as_token_array(tokens, model.config.vocab_size)
        if not isinstance(cache, KVCache):
            raise TypeError(f"SnapKV ranks rows by the attention they receive, which only a "
                            f"contiguous KVCache adds up, got {type(cache).__name__}")
        self._prepare(cache, model)
        if cache.next_position > 0:
            return model.forward(ids, cache, all_logits)
        if len(ids) > cache.capacity:       # before anything runs: a failed call changes nothing
            raise CacheFullError(f"the prompt has {len(ids)} tokens but the cache holds "
                                 f"{cache.capacity}: SnapKV runs the whole prompt before it "
                                 f"compresses")
        n_observed = min(self.observation, len(ids))
        pieces = []
        if len(ids) > n_observed:
            pieces.append(model.forward(ids[:-n_observed], cache, all_logits))
        cache.track_attention(True)
        try:
            pieces.append(model.forward(ids[-n_observed:], cache, all_logits))
            weights = cache.attention_weights
        finally:
            cache.track_attention(False)
        if cache.length > self.budget:
            cache.keep(np.ascontiguousarray(self.keep_from(weights, n_observed, cache), np.int32))
        return np.concatenate(pieces) if all_logits else pieces[-1]

    def keep_from(self, weights: np.ndarray, n_observed: int, cache: KVCache) -> np.ndarray:
        """The prompt rows to keep, from the observation queries' weights."""
        older = weights[:, :cache.length - n_observed, :]
        chosen = most_attended(smoothed(older, self.kernel), self.budget - n_observed)
        return np.concatenate([chosen, newest_rows(cache.length, n_observed, cache)], axis=1)

    def keep(self, cache, n_keep):
        raise RuntimeError("SnapKV compresses once, after the prompt; it does not drop rows "
                           "while decoding")

    def __repr__(self):
        return (f"SnapKV(budget={self.budget}, observation={self.observation}"
                + (f", kernel={self.kernel})" if self.kernel != 5 else ")"))


def smoothed(weights: np.ndarray, kernel: int) -> np.ndarray:
    """The moving average of `kernel` neighbouring rows (axis 1 of (n_layers, n_rows,
    n_kv_heads)), row i's window running from i - kernel // 2 to i + kernel - 1 - kernel // 2
    and repeating the edge rows where it passes them. Computed from running sums: memory
    for the rows there are (a few copies of them), whatever the kernel, not kernel copies
    of them (SnapKV(kernel=10**8) asked for 4.47 GiB on a 25-token prompt)."""
    n = weights.shape[1]
    if n == 0:
        return weights.astype(np.float64)
    pad = kernel // 2
    values = weights.astype(np.float64)
    sums = np.concatenate([np.zeros_like(values[:, :1]), np.cumsum(values, axis=1)], axis=1)
    i = np.arange(n)
    low, high = i - pad, i + kernel - 1 - pad            # the window, before clamping
    first, last = np.maximum(low, 0), np.minimum(high, n - 1)
    inside = sums[:, last + 1] - sums[:, first]          # the rows the window covers
    before = np.maximum(-low, 0).astype(np.float64)      # how often row 0 repeats
    after = np.maximum(high - (n - 1), 0).astype(np.float64)   # ... and row n - 1
    total = (inside + before[None, :, None] * values[:, :1] +
             after[None, :, None] * values[:, -1:])
    return total / kernel


def make_policy(name: str, budget: int) -> CachePolicy:
    """The policy `name` at a cache budget of `budget` rows, as kvlab.accuracy's
    evaluate_budgets and `kvlab generate --cache-policy NAME:BUDGET` make them. window: the
    newest rows; sinks: the 4 first rows (half the budget, under 8) and the newest; h2o: half recent, half heavy
    hitters; snapkv: the prompt compressed to `budget` rows, observed by its last
    budget // 4 queries (at most 16)."""
    if not isinstance(name, str):
        raise arguments.ArgumentTypeError(f"a policy's name is a string (window, sinks, h2o, "
                                          f"snapkv), got {name!r}")
    budget = _count("budget", budget, 2 if name in ("sinks", "h2o") else 1)
    if name == "window":
        return SlidingWindow(budget)
    if name == "sinks":             # 4 sinks, or half the budget when it is under 8
        sinks = min(4, budget // 2)
        return AttentionSinks(sinks, budget - sinks)
    if name == "h2o":
        return HeavyHitters(budget)
    if name == "snapkv":
        return SnapKV(budget, observation=max(1, min(16, budget // 4)))
    raise ValueError(f"unknown policy {name!r}: one of window, sinks, h2o, snapkv")
