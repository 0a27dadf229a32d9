"""A scheduler that plans nothing (the engine's own scheduler would run, it hopes)."""
TARGETS = ["test_the_schedulers_plans_follow_the_rules_and_keep_every_token",
           "test_the_capstone_run_gives_every_request_generates_tokens",
           "test_goodput_reaches_kvlabs_default_engine",
           "test_goodput_reaches_halfway_to_the_reference",
           "test_goodput_reaches_the_reference"]


class Scheduler(Scheduler):
    def plan(self, view):
        return {"run": [], "preempt": []}
