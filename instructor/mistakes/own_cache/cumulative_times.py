"""Returns, for each step, the time since the generation began (a running total) instead of
the step's own time."""
EXPECTED_FAILURES = ["test_step_times_are_measured"]


def step_seconds(model, prompt, n_new, use_cache):
    tokens, seconds = list(prompt), []
    cache = KVCache(model.config.n_layers) if use_cache else None
    started = time.perf_counter()
    for i in range(n_new):
        if cache is None:
            logits = forward(model, tokens)[-1]
        else:
            logits = forward(model, tokens if i == 0 else tokens[-1:], cache)[-1]
        seconds.append(time.perf_counter() - started)
        tokens.append(int(np.argmax(logits)))
    return seconds
