"""A preempted request starts over as if it were new: generated goes back to 0 with
computed, so when it runs again it recomputes only its prompt and generates its first
tokens a second time (the tokens it had already produced are lost)."""
EXPECTED_FAILURES = ["test_a_preempted_request_keeps_its_tokens_and_recomputes_them",
                     "test_random_workloads_follow_the_rules",
                     "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def _preempt(self, request):
        request.computed = 0
        request.generated = 0
        self.running.remove(request)
        self.waiting.appendleft(request)
