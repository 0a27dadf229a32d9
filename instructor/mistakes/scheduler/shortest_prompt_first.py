"""Admits the waiting request with the fewest tokens to compute first (shortest job
first) instead of the one that arrived first: long prompts can wait for ever behind a
stream of short ones."""
EXPECTED_FAILURES = ["test_admission_is_first_come_first_served",
                     "test_preemption_takes_the_newest_request_and_requeues_it_first",
                     "test_random_workloads_follow_the_rules",
                     "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def _admit(self, batch, scheduled, budget):
        while self.waiting and budget > 0 and len(batch) < self.max_batch_seqs:
            request = min(self.waiting, key=lambda r: r.pending)
            chunk = min(request.pending, budget)
            if blocks_for(chunk, self.block_size) > self._free(scheduled):
                break
            self.waiting.remove(request)
            self.running.append(request)
            batch.append((request.id, chunk))
            scheduled[request.id] = chunk
            budget -= chunk
