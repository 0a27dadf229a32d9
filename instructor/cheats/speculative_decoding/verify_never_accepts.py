"""verify runs the pass but never keeps a draft: it returns (0, the arg-max of row 0), one
plain decode step in the shape of a verification. The tokens are greedy decoding's, the
drafts are proposed and checked, so generation looks like speculation; it saves nothing."""
TARGETS = ["test_verify_keeps_drafts_the_model_agrees_with",
           "test_verify_stops_at_the_first_wrong_draft",
           "test_verify_leaves_the_cache_holding_the_accepted_tokens",
           "test_speculation_takes_fewer_passes_than_tokens", "test_measurement_reports_what_ran"]


def verify(model, cache, newest, drafts):
    drafts = [int(d) for d in drafts]
    rows = model.forward([int(newest)] + drafts, cache, all_logits=True)
    rollback(cache, len(drafts), 0)
    return 0, int(np.argmax(rows[0]))
