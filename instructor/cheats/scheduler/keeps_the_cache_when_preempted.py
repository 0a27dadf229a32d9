"""Preemption without its cost: the preempted request goes to the front of the queue as it
should, but keeps `computed` (its cache is never freed), so when it runs again it only
decodes on: no recompute of prompt + generated tokens, and its blocks never given back."""
TARGETS = ["test_a_preempted_request_keeps_its_tokens_and_recomputes_them",
           "test_random_workloads_follow_the_rules",
           "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def _preempt(self, request):
        self.running.remove(request)          # computed stays: nothing to recompute
        self.waiting.appendleft(request)
