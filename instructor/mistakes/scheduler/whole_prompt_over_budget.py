"""Admits a request with its whole prompt as the first chunk as soon as any budget is
left, instead of min(pending, tokens left): the step goes over max_batch_tokens."""
EXPECTED_FAILURES = ["test_a_long_prompt_is_prefilled_in_chunks",
                     "test_decodes_and_a_prefill_chunk_share_a_step",
                     "test_random_workloads_follow_the_rules",
                     "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def _admit(self, batch, scheduled, budget):
        while self.waiting and budget > 0 and len(batch) < self.max_batch_seqs:
            request = self.waiting[0]
            chunk = request.pending
            if blocks_for(chunk, self.block_size) > self._free(scheduled):
                break
            self.waiting.popleft()
            self.running.append(request)
            batch.append((request.id, chunk))
            scheduled[request.id] = chunk
            budget -= chunk
