"""Takes the model's next token from the LAST row of the pass, whatever was accepted: right
when every draft was (the bonus token) or there were none, but after a wrong draft the
correction must come from the row after the last accepted one."""
EXPECTED_FAILURES = ["test_verify_stops_at_the_first_wrong_draft",
                     "test_speculative_generation_keeps_the_greedy_tokens",
                     "test_speculation_takes_fewer_passes_than_tokens"]


def verify(model, cache, newest, drafts):
    drafts = [int(d) for d in drafts]
    rows = model.forward([int(newest)] + drafts, cache, all_logits=True)
    picks = np.argmax(rows, axis=-1)
    accepted = 0
    while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
        accepted += 1
    rollback(cache, len(drafts), accepted)
    return accepted, int(picks[-1])
