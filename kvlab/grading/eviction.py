"""Cache eviction with StreamingLLM's re-rotation, run over a text: how the cache-eviction lab
(kvlab/labs/cache_eviction) draws a policy's budget-against-perplexity curve.

A cache of `budget` rows reads a text, teacher-forced. Whenever it is full, `drop` rows go
at once: choose_rows(length, n_keep, scores) names the n_keep rows each layer and KV head
keeps (scores: the attention each row has received so far, for H2O; None when not asked
for), and rerotate(keys, positions) turns the kept keys, key [l, i, h] rotated at position
positions[l, i, h], into the same keys rotated at their new places 0 .. n_keep - 1. The
cache then holds contiguous positions again and the next token comes at n_keep, so no
query ever sees a distance beyond the budget (StreamingLLM). The next `drop` tokens run in
one forward call.

curve() runs a policy at several budgets with the lab's four functions taken from any object
that has them: the judge passes the student's (each call runs in the worker) and, for the
reference curve, KitFunctions (kvlab's own choice of rows and its RoPE); a student can pass
their own module to try it on kvlab's models (the lab's starter shows how).

Not kvlab.cache_policy: the kit's policies keep positions as stored and drop one row a
token (chapter 8.5 says why). Dropping a quarter of the budget at once keeps a grading run
over SmolLM2 to seconds; each query then sees between three quarters of the budget and all
of it. Not a general tool either: fp32 caches only, the tokens given, nothing sampled.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from .. import reference
from ..cache_policy import AttentionSinks, HeavyHitters
from ..next_token_metrics import log_softmax

POLICIES = ("sinks", "h2o")

ChooseRows = Callable[[int, int, Optional[np.ndarray]], object]
Rerotate = Callable[[np.ndarray, np.ndarray], object]


def drop_size(budget: int) -> int:
    """Rows dropped at once when a cache of `budget` rows is full: a quarter of it."""
    return max(1, budget // 4)


def sinks_for(budget: int) -> int:
    """The sinks a budget keeps, as kvlab.accuracy's "sinks" policy: 4, or half the
    budget under 8."""
    return min(4, budget // 2)


def checked_rows(rows, shape: tuple, length: int) -> np.ndarray:
    """What choose_rows returned, as int64 rows of `shape` (n_layers, n_keep, n_kv_heads),
    each an existing row, strictly increasing along axis 1 (the kept rows keep their
    order: a key's new place is its rank); ValueError naming what is wrong."""
    array = np.asarray(rows)
    if array.dtype == bool or array.dtype.kind not in "iu":
        raise ValueError(f"the rows to keep must be integer row numbers, got {array.dtype}")
    if array.shape != shape:
        raise ValueError(f"the rows to keep must have shape (n_layers, n_keep, n_kv_heads) = "
                         f"{shape}, got {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= length):
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise ValueError(f"row {bad} is not in a cache of rows 0 .. {length - 1}")
    if shape[1] > 1 and not (np.diff(array, axis=1) > 0).all():
        raise ValueError("the rows to keep must be strictly increasing for every layer and KV "
                         "head (no row twice, in the order they were written)")
    return array.astype(np.int64)


def checked_keys(keys, shape: tuple) -> np.ndarray:
    """What rerotate returned, as float32 keys of `shape`, all finite; ValueError else."""
    array = np.asarray(keys)
    if array.dtype.kind != "f" or array.shape != shape:
        raise ValueError(f"the re-rotated keys must be a float array of shape {shape}, got "
                         f"{array.dtype} {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("the re-rotated keys hold inf or nan")
    return np.ascontiguousarray(array, dtype=np.float32)


class _Cache:
    """A kvlab KVCache renumbered after every drop, with the attention sums carried across
    (kvlab counts a row's attention since it was written, and every row is written anew)."""

    def __init__(self, model, budget: int, scores: bool):
        self.cache = model.new_cache(budget)
        self.scores = scores
        self.carried = None                    # (n_layers, n_kept, n_kv_heads) float64
        if scores:
            self.cache.track_attention(True)

    def weights(self) -> Optional[np.ndarray]:
        """The attention each row has received since its token came, or None."""
        if not self.scores:
            return None
        total = self.cache.attention_weights.astype(np.float64)
        if self.carried is not None:
            total[:, :self.carried.shape[1]] += self.carried
        return total

    def evict(self, n_keep: int, choose_rows: ChooseRows, rerotate: Rerotate) -> None:
        cache = self.cache
        n_layers, _, n_kv_heads, _ = cache.shape
        weights = self.weights()
        rows = checked_rows(choose_rows(cache.length, n_keep, weights),
                            (n_layers, n_keep, n_kv_heads), cache.length)
        keys = np.take_along_axis(cache.keys, rows[..., None], axis=1)
        values = np.take_along_axis(cache.values, rows[..., None], axis=1)
        positions = np.take_along_axis(cache.positions, rows, axis=1)
        keys = checked_keys(rerotate(keys, positions), keys.shape)
        cache.reset()                          # then positions 0 .. n_keep - 1 again
        cache.append(np.ascontiguousarray(keys.transpose(1, 0, 2, 3)),
                     np.ascontiguousarray(values.transpose(1, 0, 2, 3)))
        if self.scores:
            self.carried = np.take_along_axis(weights, rows, axis=1)
            cache.track_attention(True)        # from zero: the carried sums hold the past


def token_losses(model, ids, budget: int, choose_rows: ChooseRows, rerotate: Rerotate,
                 scores: bool = False, score_from: int = 0) -> np.ndarray:
    """The negative log-likelihood of each token ids[score_from + 1:] given those before it,
    through a cache of `budget` rows evicted as the module text says. scores: track the
    attention each row receives and pass it to choose_rows (H2O); else it gets None."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 2:
        raise ValueError(f"the budget must be an int of at least 2 rows, got {budget!r}")
    if not 0 <= score_from < len(ids) - 1:
        raise ValueError(f"score_from must leave a token to predict among {len(ids)}")
    state = _Cache(model, budget, scores)
    cache, drop = state.cache, drop_size(budget)
    losses, done = [], 0
    while done < len(ids) - 1:                 # the last token is only predicted
        if cache.length == budget:
            state.evict(budget - drop, choose_rows, rerotate)
        n = min(budget - cache.length, len(ids) - 1 - done)
        scored = done + n > score_from         # a row of this piece predicts a scored token
        logits = model.forward(ids[done:done + n], cache, all_logits=scored)
        if scored:
            first = max(score_from - done, 0)
            log_p = log_softmax(logits[first:])
            targets = ids[done + first + 1:done + n + 1]
            losses.append(-log_p[np.arange(len(targets)), targets])
        done += n
    return np.concatenate(losses)


def perplexity(model, ids, budget: int, choose_rows: ChooseRows, rerotate: Rerotate,
               scores: bool = False, score_from: int = 0) -> float:
    """exp of the mean of token_losses: the perplexity of the scored tokens."""
    return float(np.exp(token_losses(model, ids, budget, choose_rows, rerotate, scores,
                                     score_from).mean()))


# ---- the lab's functions: the reference, and a policy's curve through any of them -----------

class _Rows:
    """What kvlab.cache_policy's keep() reads of a cache: its length, shape and sums."""

    def __init__(self, length: int, n_layers: int, n_kv_heads: int, weights=None):
        self.length, self.attention_weights = length, weights
        self.shape = (n_layers, length, n_kv_heads, 0)


class KitFunctions:
    """The lab's four functions as kvlab computes them: rows by kvlab.cache_policy's
    AttentionSinks and HeavyHitters, rotations by kvlab.reference.rope in float64."""

    @staticmethod
    def rotate(x, shift, inv_freq, interleaved) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        shift = np.broadcast_to(np.asarray(shift), x.shape[:-1]).reshape(-1)
        flat = x.reshape(-1, 1, x.shape[-1])
        return reference.rope(flat, shift, np.asarray(inv_freq, np.float64),
                              bool(interleaved)).reshape(x.shape)

    @staticmethod
    def sink_rows(length, n_keep, sinks) -> np.ndarray:
        policy = AttentionSinks(sinks, max(1, n_keep - sinks))
        return policy.keep(_Rows(length, 1, 1), n_keep)[0, :, 0]

    @staticmethod
    def heavy_hitter_rows(scores, n_keep, n_recent) -> np.ndarray:
        # HeavyHitters keeps recent - 1 newest rows (the token on its way is the last one)
        scores = np.asarray(scores)
        policy = HeavyHitters(n_keep + 2, n_recent + 1)
        return policy.keep(_Rows(scores.shape[1], scores.shape[0], scores.shape[2], scores), n_keep)

    @classmethod
    def rerotate(cls, keys, positions, inv_freq, interleaved) -> np.ndarray:
        slots = np.arange(np.shape(keys)[1])[None, :, None]
        return cls.rotate(keys, slots - np.asarray(positions), inv_freq, interleaved)


def policy_functions(functions, policy: str, budget: int, config) -> tuple:
    """(choose_rows, rerotate, scores) for token_losses: `policy` ("sinks" or "h2o") at
    `budget` through the lab's functions of `functions` (sink_rows or heavy_hitter_rows, and
    rerotate) on a model of this config. sinks: sinks_for(budget) sinks and the newest
    rows; h2o: half the kept rows the newest, the rest by their scores."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    shape = (config.n_layers, config.n_kv_heads)
    inv_freq = config.rope_inv_freq()

    def choose_rows(length, n_keep, scores):
        if policy == "h2o":
            return functions.heavy_hitter_rows(scores, n_keep, n_keep // 2)
        rows = np.asarray(functions.sink_rows(length, n_keep, sinks_for(budget)))
        if rows.shape != (n_keep,):
            raise ValueError(f"sink_rows({length}, {n_keep}, {sinks_for(budget)}) must return "
                             f"{n_keep} rows, got an array of shape {rows.shape}")
        return np.broadcast_to(rows[None, :, None], (shape[0], n_keep, shape[1]))

    def rerotate(keys, positions):
        return functions.rerotate(keys, positions, inv_freq, config.rope_interleaved)
    return choose_rows, rerotate, policy == "h2o"


def curve(model, ids, budgets: Sequence[int], policy: str, functions,
          score_from: Optional[int] = None) -> List[float]:
    """The perplexity of ids[score_from + 1:] (default: the second half) at each budget,
    `policy` run through `functions` (an object with the lab's functions)."""
    score_from = len(ids) // 2 if score_from is None else score_from
    found = []
    for budget in budgets:
        choose_rows, rerotate, scores = policy_functions(functions, policy, budget, model.config)
        found.append(perplexity(model, ids, budget, choose_rows, rerotate, scores, score_from))
    return found
