"""measure runs nothing: it returns numbers that look like a good speculative run (a third
of the passes, half the drafts accepted, three times faster), consistent with each other."""
TARGETS = ["test_measurement_reports_what_ran"]


def measure(model, prompt, n_new, k=4, max_ngram=3):
    return {"passes_plain": n_new, "passes_speculative": n_new // 3, "drafted": n_new,
            "accepted": n_new // 2, "acceptance_rate": 0.5, "seconds_plain": 0.3,
            "seconds_speculative": 0.1, "speedup": 3.0}
