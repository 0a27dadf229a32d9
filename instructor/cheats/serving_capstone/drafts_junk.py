"""A drafter that proposes ids past the vocabulary, hoping they are taken unchecked: each
request it drafts for fails."""
TARGETS = ["test_the_drafter_guesses_what_the_model_says",
           "test_the_capstone_run_gives_every_request_generates_tokens",
           "test_goodput_reaches_kvlabs_default_engine",
           "test_goodput_reaches_halfway_to_the_reference",
           "test_goodput_reaches_the_reference"]


class Drafter(Drafter):
    def propose(self, tokens, k):
        return [10 ** 6] * k
