"""Worked answer to notebook 07's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("07_gpu_kernels", merge_states)
"""
import numpy as np


def merge_states(a, b):
    acc1, m1, l1 = a
    acc2, m2, l2 = b
    m = max(m1, m2)
    # Each piece summed exp(s - m_i); moving it to the common max m multiplies it by
    # exp(m_i - m) <= 1, so nothing overflows however large the scores are.
    r1, r2 = np.exp(m1 - m), np.exp(m2 - m)
    acc = r1 * acc1 + r2 * acc2
    l = r1 * l1 + r2 * l2
    return acc, m, l          # not divided: acc / l is the output once every piece is merged

# Mistakes the check catches: acc1 + acc2 (no rescaling), rescaling acc but not l, exp(m1)
# and exp(m2) without subtracting the max (overflow for scores in the hundreds), returning
# acc / l already (a third piece then merges wrongly), keeping m1 as the merged max.
