"""No preemption and no recompute: a request is admitted only when the blocks for its whole
length (prompt + max_new_tokens - 1) are free beside what the running requests may still
grow to, so no running request ever runs out. Admission waits where the rules admit."""
TARGETS = ["test_preemption_takes_the_newest_request_and_requeues_it_first",
           "test_a_preempted_request_keeps_its_tokens_and_recomputes_them",
           "test_random_workloads_follow_the_rules",
           "test_random_workloads_match_kvlabs_scheduler"]


def _whole(request, block_size):
    return blocks_for(request.prompt_len + request.max_new_tokens - 1, block_size)


class Scheduler(Scheduler):
    def step(self):
        batch, budget = [], self.max_batch_tokens
        for request in self.running:
            n = min(request.pending, budget)
            if n and len(batch) < self.max_batch_seqs:
                batch.append((request.id, n))
                budget -= n
        reserved = sum(_whole(r, self.block_size) for r in self.running)
        while self.waiting and budget > 0 and len(batch) < self.max_batch_seqs:
            request = self.waiting[0]
            if reserved + _whole(request, self.block_size) > self.num_blocks:
                break
            self.running.append(self.waiting.popleft())
            reserved += _whole(request, self.block_size)
            chunk = min(request.pending, budget)
            batch.append((request.id, chunk))
            budget -= chunk
        self._run(batch)
        return batch
