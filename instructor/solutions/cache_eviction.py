"""Lab 11 reference solution (instructors only: never hand this to students)."""
import numpy as np


def rotate(x, shift, inv_freq, interleaved):
    x = np.asarray(x, dtype=np.float32)
    # angles in float64: a shift of thousands times a frequency near 1 loses digits in float32
    angles = np.asarray(shift, dtype=np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos, sin = np.cos(angles), np.sin(angles)
    half = x.shape[-1] // 2
    first, second = (slice(0, None, 2), slice(1, None, 2)) if interleaved else \
        (slice(0, half), slice(half, None))
    a, b = x[..., first], x[..., second]
    out = np.empty_like(x)
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def sink_rows(length, n_keep, sinks):
    return np.concatenate([np.arange(sinks), np.arange(length - (n_keep - sinks), length)])


def heavy_hitter_rows(scores, n_keep, n_recent):
    scores = np.asarray(scores)
    n_layers, length, n_kv_heads = scores.shape
    older = length - n_recent
    # a stable sort of the negated scores: the largest first, a tie to the earlier row
    order = np.argsort(-scores[:, :older, :], axis=1, kind="stable")[:, :n_keep - n_recent, :]
    recent = np.broadcast_to(np.arange(older, length)[None, :, None], (n_layers, n_recent, n_kv_heads))
    return np.concatenate([np.sort(order, axis=1), recent], axis=1)


def rerotate(keys, positions, inv_freq, interleaved):
    slots = np.arange(np.shape(keys)[1])[None, :, None]      # where each kept key is now
    return rotate(keys, slots - np.asarray(positions), inv_freq, interleaved)
