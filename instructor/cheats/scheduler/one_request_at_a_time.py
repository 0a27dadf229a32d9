"""No batching: one request runs at a time, in chunks of the budget, and the next one is
admitted when it finishes. A request alone always fits (add made sure), so nothing is ever
preempted; every step follows the rules that are checked on what does run."""
TARGETS = ["test_decodes_and_a_prefill_chunk_share_a_step",
           "test_admission_is_first_come_first_served",
           "test_a_batch_holds_at_most_max_batch_seqs_requests",
           "test_preemption_takes_the_newest_request_and_requeues_it_first",
           "test_a_preempted_request_keeps_its_tokens_and_recomputes_them",
           "test_random_workloads_follow_the_rules",
           "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def step(self):
        if not self.running and self.waiting:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return []
        request = self.running[0]
        batch = [(request.id, min(request.pending, self.max_batch_tokens))]
        self._run(batch)
        return batch
