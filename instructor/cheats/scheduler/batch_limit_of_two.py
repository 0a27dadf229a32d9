"""max_batch_seqs read as min(max_batch_seqs, 2): the limits the checks used (1 publicly, 2
in the batch-size test) hold, a larger one never admits a third request: the limit is not
what decides."""
TARGETS = ["test_a_batch_holds_at_most_max_batch_seqs_requests",
           "test_random_workloads_follow_the_rules",
           "test_random_workloads_match_kvlabs_scheduler"]


class Scheduler(Scheduler):
    def __init__(self, num_blocks, block_size, max_batch_tokens, max_batch_seqs):
        super().__init__(num_blocks, block_size, max_batch_tokens, min(max_batch_seqs, 2))
