"""add() checks a request against num_blocks * 4 tokens, the capacity of blocks of 4 (the
block size of every add() check it was shown), not against blocks_for(...) <= num_blocks:
no block counting."""
TARGETS = ["test_add_refuses_a_request_that_could_never_fit"]


class Scheduler(Scheduler):
    def add(self, request_id, prompt_len, max_new_tokens):
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError("prompt_len and max_new_tokens must be at least 1")
        if prompt_len + max_new_tokens - 1 > self.num_blocks * 4:
            raise ValueError(f"request {request_id} does not fit the cache")
        request = Request(request_id, prompt_len, max_new_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)
