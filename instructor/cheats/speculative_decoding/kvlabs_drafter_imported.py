"""propose is kvlab's own drafter (kvlab.speculative.PromptLookup), imported by name at call
time past the source check: the worker never has kvlab loaded, and refuses to load it."""
TARGETS = ["test_propose_on_crafted_contexts", "test_propose_on_random_contexts",
           "test_speculative_generation_keeps_the_greedy_tokens",
           "test_speculation_takes_fewer_passes_than_tokens", "test_measurement_reports_what_ran",
           "test_drafts_never_pass_the_tokens_still_wanted"]

import shutil as _ue                                          # noqa: E402

_sys = _ue.sys


def propose(tokens, k, max_ngram=3):
    speculative = _sys.modules["importlib"].import_module("kvlab.speculative")
    return speculative.PromptLookup(max_ngram).propose([int(t) for t in tokens], k)
