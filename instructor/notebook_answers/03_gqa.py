"""Worked answer to notebook 03's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("03_gqa", expand_kv_heads)
"""
import numpy as np


def expand_kv_heads(keys, n_heads):
    kv_mul = n_heads // keys.shape[1]           # query heads per K/V head
    # np.repeat turns heads [a, b] into [a, a, a, a, b, b, b, b]: slot h holds K/V head
    # h // kv_mul, the one query head h reads in GQA. This is what kvlab.reference.attention
    # does before plain multi-head attention (and Hugging Face's repeat_kv).
    return np.repeat(keys, kv_mul, axis=1)

# The same by hand:  np.stack([keys[:, h // kv_mul] for h in range(n_heads)], axis=1)
# Mistake the check catches: np.tile(keys, (1, kv_mul, 1)), which gives [a, b, a, b, ...]
# (query head h reading K/V head h % n_kv_heads): the notebook's "wrong rule".
