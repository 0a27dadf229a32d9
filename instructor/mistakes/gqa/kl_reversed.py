"""Measures KL(converted || original) instead of KL(original || converted): KL is not
symmetric, and the question is what the converted model loses of the original's."""
EXPECTED_FAILURES = ["test_conversion_table"]

_kl_divergence = kl_divergence


def kl_divergence(reference_logits, logits):
    return _kl_divergence(logits, reference_logits)
