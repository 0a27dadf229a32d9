"""One clock around the whole generation, shared out evenly: an average, not each step's time."""
TARGETS = ["test_step_times_are_measured"]


def step_seconds(model, prompt, n_new, use_cache):
    started = time.perf_counter()
    generate(model, prompt, n_new, use_cache)
    return [(time.perf_counter() - started) / n_new] * n_new
