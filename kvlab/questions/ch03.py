"""Chapter 3 (MHA, GQA, MQA): the Check yourself questions whose answer is a number."""
from . import Number
import kvlab


def _q1_bytes_per_token() -> float:
    """40 layers, 40 query heads of 128, 8 K/V heads, fp16."""
    config = kvlab.ModelConfig.llama2_7b().replace(n_layers=40, n_heads=40, n_kv_heads=8,
                                                   head_dim=128, dim=5120, name="question 1")
    return kvlab.kv_bytes_per_token(config, "fp16")


def _q2_kv_head_of_query_head_13() -> float:
    config = kvlab.ModelConfig.llama2_7b().replace(n_kv_heads=4)     # 32 query heads
    return 13 // config.kv_mul


def _q5_repeated_bytes() -> float:
    """np.repeat's K and V for one layer of the bundled model at 512 positions, float32."""
    c = kvlab.ModelConfig.shakespeare_1m()
    return 2 * 512 * c.n_heads * c.head_dim * 4


NUMBERS = {
    1: Number(expected=_q1_bytes_per_token, unit="bytes per token",
              hint="2 (K and V) x n_layers x n_kv_heads x head_dim x 2 bytes: only the K/V "
                   "heads count, not the 40 query heads"),
    2: Number(expected=_q2_kv_head_of_query_head_13, unit="K/V head", rel_tol=0.0, whole=True,
              hint="kv_mul = n_heads / n_kv_heads; query head h reads K/V head h // kv_mul"),
    5: Number(expected=_q5_repeated_bytes, unit="bytes",
              hint="after np.repeat, K and V each have n_heads heads (not n_kv_heads) for "
                   "every position, in float32"),
}
