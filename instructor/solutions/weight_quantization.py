"""Lab 13 reference solution (instructors only: never hand this to students)."""
import numpy as np


def q4_0_round_to_nearest(w):
    w = np.asarray(w, dtype=np.float32)
    blocks = w.reshape(w.shape[0], -1, 32)
    # the value of largest magnitude, its sign kept (the first of equal ones)
    at = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, at, axis=-1) / np.float32(-8)            # (out, n, 1)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(np.trunc(blocks * inverse + np.float32(8.5)), 15)
    stored_d = d.astype(np.float16).astype(np.float32)                      # kept as a half
    return (stored_d * (q - np.float32(8))).reshape(w.shape)


def channel_scales(magnitude, alpha):
    s = np.asarray(magnitude, dtype=np.float64) ** alpha
    return (s / np.sqrt(s.max() * s.min())).astype(np.float32)


def output_error(x, w, w_stored):
    diff = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) - np.asarray(w_stored, np.float32)).T
    return float(np.square(diff, dtype=np.float64).sum())


def search_scales(x, matrices, alphas):
    x = np.asarray(x, dtype=np.float32)
    magnitude = np.abs(x).mean(axis=0)
    errors = []
    for alpha in alphas:
        s = channel_scales(magnitude, alpha)
        errors.append(sum(output_error(x, w, q4_0_round_to_nearest(w * s) / s)
                          for w in matrices))
    best = int(np.argmin(errors))
    return {"alpha": alphas[best], "scales": channel_scales(magnitude, alphas[best]),
            "errors": errors}


def fold_into_norm(norm_weight, matrices, scales):
    scales = np.asarray(scales, dtype=np.float32)
    return (np.asarray(norm_weight, np.float32) / scales,
            [np.asarray(w, np.float32) * scales for w in matrices])
