"""Step times from nowhere: cached steps said to be faster than uncached ones, no clock read."""
TARGETS = ["test_step_times_are_measured"]


def step_seconds(model, prompt, n_new, use_cache):
    generate(model, prompt, n_new, use_cache)
    return [1e-4 if use_cache else 2e-4 + 1e-5 * i for i in range(n_new)]
