"""Public self-checks for lab 4 (GQA and the conversion): `kvlab check gqa gqa.py`.

Small cases you can follow by hand, and one short run of the bundled models. The grade
comes from hidden tests: random MHA, GQA and MQA shapes against the C core's attention,
pooling of random weights to every head count, the forward pass and the conversion table
of the MHA model on a stretch of text the grader picks.
"""
import numpy as np

import kvlab
from kvlab import reference
from kvlab.grading.handouts import ReferenceModel
from kvlab.grading.testkit import as_array, bundled_model, check_close, described, points, whole_number


@points(1)
def test_one_position_gives_its_kv_heads_value(sub, rng):
    """4 query heads on 2 KV heads, 1 cached position: heads 0, 1 get KV head 0's value, 2, 3 KV head 1's"""
    q = np.ones((4, 2), np.float32)
    keys = np.array([[[1, 0], [0, 1]]], np.float32)
    values = np.array([[[10, 11], [20, 21]]], np.float32)
    got = sub.attend(q, keys, values)
    check_close(got, np.array([[10, 11], [10, 11], [20, 21], [20, 21]]),
                "one position: every head's output is its KV head's value (query head h reads "
                "KV head h // 2)")


@points(1)
def test_the_first_position_sees_only_itself(sub, rng):
    """prefill with 4 query heads on 2 KV heads: row 0 is v[0] of each head's KV head"""
    q = np.ones((2, 4, 2), np.float32)
    k = np.array([[[1, 0], [0, 1]], [[5, 5], [5, 5]]], np.float32)
    v = np.array([[[1, 2], [3, 4]], [[9, 9], [9, 9]]], np.float32)
    got = as_array(sub.causal_attention(q, k, v), "causal_attention", shape=(2, 4, 2))
    check_close(got[0], np.array([[1, 2], [1, 2], [3, 4], [3, 4]]),
                "row 0 (position 1 is in the future)")


@points(1)
def test_four_heads_pooled_to_two(sub, rng):
    """4 heads of 1 row pooled to 2: the means of heads 0 and 1, and of heads 2 and 3"""
    w = np.array([[0, 2], [2, 4], [10, 0], [20, 0]], np.float32)
    got = sub.mean_pool_heads(w, 2, 1)
    check_close(got, np.array([[1, 3], [15, 0]]), "4 heads of head_dim 1 pooled to 2")


@points(1)
def test_forward_of_the_bundled_gqa_model(sub, rng):
    """the bundled model (8 query heads on 2 KV heads) over "ROMEO:": the reference's logits"""
    model = bundled_model()
    tokens = list(model.encode("ROMEO:"))
    got = sub.forward(ReferenceModel(), tokens)
    check_close(got, reference.forward(model.config, model.weights, tokens),
                "forward over the 6 tokens of 'ROMEO:'", atol=1e-4, rtol=1e-4)


@points(1)
def test_the_mha_model_unconverted(sub, rng):
    """conversion_table of the MHA model for [8] KV heads: itself, KL 0, 6,144 bytes per token"""
    mha = kvlab.load(kvlab.MHA_MODEL)
    tokens = list(mha.encode("ROMEO:\nBut soft, what light"))
    rows = sub.conversion_table(ReferenceModel(checkpoint="mha", convertible=True), tokens, [8])
    assert isinstance(rows, (list, tuple)) and len(rows) == 1 and isinstance(rows[0], dict), (
        f"expected a list of one dict, got {described(rows)}")
    row = rows[0]
    got = whole_number(row.get("cache_bytes_per_token"), "cache_bytes_per_token")
    assert got == 6_144, f"2 x 6 layers x 8 KV heads x 16 x 4 B = 6,144 bytes per token, got {got:,}"
    want = kvlab.accuracy.perplexity(reference.forward(mha.config, mha.weights, tokens), np.array(tokens))
    check_close(np.array([row.get("perplexity", np.nan), row.get("kl", np.nan)], dtype=np.float64),
                np.array([want, 0.0]), "(perplexity, kl) of the model against itself", atol=1e-6, rtol=1e-4)
