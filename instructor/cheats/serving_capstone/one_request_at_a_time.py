"""No batching: the oldest request alone, whole chunks, until it is done."""
TARGETS = ["test_goodput_reaches_kvlabs_default_engine",
           "test_goodput_reaches_halfway_to_the_reference",
           "test_goodput_reaches_the_reference"]


class Scheduler(Scheduler):
    def plan(self, view):
        first = (view["running"] or view["waiting"])[0]
        return {"run": [[first["id"], min(first["pending"], view["max_batch_tokens"])]]}
