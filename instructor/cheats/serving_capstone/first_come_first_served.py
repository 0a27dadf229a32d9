"""kvlab's own scheduler's rules written as the plug-in: first come, first served, the whole
budget, no cap on the batch. It is kvlab's default engine: the reference's tiers ask more."""
TARGETS = ["test_goodput_reaches_halfway_to_the_reference",
           "test_goodput_reaches_the_reference"]


class Scheduler(Scheduler):
    def plan(self, view):
        self.view, self.run, self.preempt = view, [], []
        self.tokens, self.free = view["max_batch_tokens"], view["free_blocks"]
        running = view["running"]
        for request in running:
            if request["id"] in self.preempt:
                continue
            n = min(request["pending"], self.tokens)
            if n == 0:
                continue
            while blocks_needed(view, request, n) > self.free:
                victim = [r for r in running if r["id"] not in self.preempt][-1]
                self.preempt.append(victim["id"])
                self.free += victim["blocks"]
                self.tokens += sum(k for rid, k in self.run if rid == victim["id"])
                self.run = [[rid, k] for rid, k in self.run if rid != victim["id"]]
                if victim is request:
                    break
            if request["id"] not in self.preempt:
                self._fits(request, n)
        for request in view["waiting"] if not self.preempt else []:
            n = min(request["pending"], self.tokens)
            if n == 0 or not self._fits(request, n):
                break
        return {"run": self.run, "preempt": self.preempt}
