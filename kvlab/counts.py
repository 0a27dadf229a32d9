"""What forward calls did: FLOPs and bytes, as the C core counts them while it runs.

Model.counters and Generation.counts hold these; kvlab.measure derives the same figures
from shapes alone (forward_counts, generation_counts), and the tests hold the two equal.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Counts:
    """FLOPs and bytes of forward calls; the same fields as the C core's kv_counters.
    A FLOP is one multiply or one add (a multiply-add is 2)."""
    flops_projections: int = 0   # Wq, Wk, Wv, Wo
    flops_attention: int = 0     # q . k over the visible positions, and the mix of V
    flops_mlp: int = 0           # W1, W3, W2
    flops_logits: int = 0        # the classifier
    weight_bytes: int = 0        # weights read, each matrix once per call
    kv_read_bytes: int = 0       # K and V read by attention
    kv_write_bytes: int = 0      # K and V written
    scratch_bytes: int = 0       # peak activation scratch of one call
    tokens: int = 0              # tokens run through the model
    calls: int = 0

    @property
    def flops(self) -> int:
        return self.flops_projections + self.flops_attention + self.flops_mlp + self.flops_logits

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def __add__(self, other: "Counts") -> "Counts":
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self)}
        summed["scratch_bytes"] = max(self.scratch_bytes, other.scratch_bytes)
        return Counts(**summed)
