"""Chapter 7 (kernels for decode attention): the Check yourself questions whose answer is a
number."""
from . import Number
import kvlab
import math


def _mistral_7b():
    """Mistral 7B's attention shape (Jiang et al., 2023): 32 layers, 32 query heads, 8 KV
    heads of head_dim 128 (the same shape as Llama 3 8B's attention)."""
    return kvlab.ModelConfig.llama3_8b().replace(vocab_size=32000, name="Mistral 7B shape")


def _q1_int4_intensity() -> float:
    """FLOPs per byte of decode attention over kvlab's int4 cache (4 bits a value, one
    fp32 scale and zero point per 32 values)."""
    c = _mistral_7b()
    flops_per_position = 4 * c.n_heads * c.head_dim * c.n_layers      # q.k and p.v
    return flops_per_position / kvlab.kv_bytes_per_token(c, "int4")


def _q3_factor_of_acc1() -> float:
    return math.exp(3.0 - max(3.0, 5.0))


def _q4_blocks() -> float:
    return 2 * kvlab.ModelConfig.llama3_8b().n_kv_heads      # batch 2


NUMBERS = {
    1: Number(expected=_q1_int4_intensity, unit="FLOPs per byte",
              hint="intensity = 2 x kv_mul / bytes per value; an int4 value is half a byte "
                   "plus its share of the 8 bytes of scale and zero point per 32 values"),
    3: Number(expected=_q3_factor_of_acc1, unit="(the factor acc1 is multiplied by)",
              hint="M = max(m1, m2); each partial sum is multiplied by exp(m_i - M)"),
    4: Number(expected=_q4_blocks, unit="thread blocks", rel_tol=0.0, whole=True,
              hint="one block per (sequence, KV head) pair; Llama 3 8B has 8 KV heads"),
}
