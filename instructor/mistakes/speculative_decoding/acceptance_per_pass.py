"""Reports the acceptance rate as drafts accepted per verification pass instead of per
draft checked (accepted / drafted)."""
EXPECTED_FAILURES = ["test_measurement_reports_what_ran"]

_measured = measure


def measure(model, prompt, n_new, k=4, max_ngram=3):
    report = _measured(model, prompt, n_new, k, max_ngram)
    report["acceptance_rate"] = report["accepted"] / (report["passes_speculative"] - 1)
    return report
