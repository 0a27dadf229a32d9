"""How well logits predict the next token, and how far two models' predictions are apart.

kvlab.accuracy uses these to compare cache formats; the GQA lab lends `perplexity` and
`kl_divergence` to a submission that compares a converted model with the original. This
file imports only NumPy and nothing relative, so the grading worker can lend them without
importing the rest of kvlab (as it does with process_memory.py).

Row t of a (n, vocab) logits array is the prediction for token t + 1, so n tokens give
n - 1 predictions: the last row predicts a token the text does not have.
"""
import numpy as np


def log_softmax(logits) -> np.ndarray:
    """log of softmax over the last axis, in float64 (exact enough to sum many of them)."""
    # one float64 copy, shifted and normalized in place: the same values as with a new array
    # for each step, and a third less time on a model's (n, 49152) logits
    out = np.array(logits, dtype=np.float64)
    out -= out.max(axis=-1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=-1, keepdims=True))
    return out


def _checked(logits, name: str) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 2 or len(logits) < 2:
        raise ValueError(f"{name} must be (n, vocab_size) with n >= 2, got shape {logits.shape}")
    if not np.isfinite(logits).all():
        raise ValueError(f"{name} holds inf or nan")
    return logits


def perplexity(logits, tokens) -> float:
    """exp(mean negative log-likelihood) of tokens[1:] under the rows logits[:-1]:
    logits (n, vocab_size) of a forward pass over tokens (n,)."""
    logits = _checked(logits, "logits")
    tokens = np.asarray(tokens)
    if tokens.shape != (len(logits),) or tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be {len(logits)} integer ids, one per row of logits; "
                         f"got {tokens.dtype} of shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= logits.shape[1]:
        raise ValueError(f"token ids must be in [0, {logits.shape[1]})")
    log_p = log_softmax(logits[:-1])
    return float(np.exp(-log_p[np.arange(len(log_p)), tokens[1:]].mean()))


def kl_divergence(reference_logits, logits) -> float:
    """Mean over rows of KL(p || q) in nats, p = softmax(reference_logits), q = softmax(logits),
    both (n, vocab_size): how much information the second model's predictions lose."""
    reference_logits, logits = _checked(reference_logits, "reference_logits"), _checked(logits, "logits")
    if reference_logits.shape != logits.shape:
        raise ValueError(f"the two logits differ in shape: {reference_logits.shape} and {logits.shape}")
    log_p, log_q = log_softmax(reference_logits), log_softmax(logits)
    return float((np.exp(log_p) * (log_p - log_q)).sum(axis=-1).mean())
