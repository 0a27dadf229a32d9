"""Preempts the oldest running request (self.running[0]) instead of the most recently
admitted one: the request that has waited and computed the longest loses its work."""
EXPECTED_FAILURES = ["test_preemption_takes_the_newest_request_and_requeues_it_first",
                     "test_a_preempted_request_keeps_its_tokens_and_recomputes_them",
                     "test_random_workloads_follow_the_rules",
                     "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def step(self):
        batch, scheduled = [], {}
        budget = self.max_batch_tokens
        preempted = False
        for request in list(self.running):
            if request not in self.running:
                continue
            n = min(request.pending, budget)
            if n == 0 or len(batch) >= self.max_batch_seqs:
                continue
            need = (blocks_for(request.computed + n, self.block_size)
                    - blocks_for(request.computed, self.block_size))
            while need > self._free(scheduled):
                victim = self.running[0]      # the oldest
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                continue
            batch.append((request.id, n))
            scheduled[request.id] = n
            budget -= n
        if not preempted:
            self._admit(batch, scheduled, budget)
        self._run(batch)
        return batch
