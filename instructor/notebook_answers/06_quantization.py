"""Worked answer to notebook 06's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("06_quantization", int8_quantize_group)
"""
import numpy as np


def int8_quantize_group(x):
    x = np.asarray(x, dtype=np.float32)
    # float32 arithmetic throughout, as kvlab.quant and csrc/quant.c do
    scale = np.float32(np.abs(x).max() / np.float32(127))
    # an all-zero group: scale 0, divided by 1 so the codes are 0 (0 / 0 would be NaN)
    safe = scale if scale > 0 else np.float32(1)
    # divide (not multiply by 1 / scale), round halves to even (np.rint = C's nearbyintf);
    # the clip never triggers for finite x, since the largest value rounds to +-127
    codes = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return codes, scale

# Every value comes back within half a step: |codes * scale - x| <= max|x| / 254.
# Mistakes the check catches: dividing by 128, the range / 255 (that is asymmetric),
# astype(np.int8) without rounding (truncates), rounding halves up (np.floor(v + 0.5)),
# NaN codes for an all-zero group, codes left as float.
