"""verify has no case of its own for an empty draft list: it runs the newest token again as
a stand-in draft and rolls it back, so the drafts' code path serves both. The answer and
the cache are a decode step's, but the pass ran a token twice, two where one was due."""
TARGETS = ["test_verify_without_drafts_is_a_decode_step"]

_verify = verify


def verify(model, cache, newest, drafts):
    if len(drafts):
        return _verify(model, cache, newest, drafts)
    rows = model.forward([int(newest), int(newest)], cache, all_logits=True)
    rollback(cache, 1, 0)
    return 0, int(np.argmax(rows[0]))
