"""measure runs both and counts the passes honestly, but reports plain decoding's time
three times over, to flatter speculation: the speedup agrees with the times it reports."""
TARGETS = ["test_measurement_reports_what_ran"]

_measured = measure


def measure(model, prompt, n_new, k=4, max_ngram=3):
    report = _measured(model, prompt, n_new, k, max_ngram)
    report["seconds_plain"] *= 3
    report["speedup"] = report["seconds_plain"] / report["seconds_speculative"]
    return report
