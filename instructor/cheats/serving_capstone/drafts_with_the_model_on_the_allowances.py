"""Built on first_come_first_served and drafts_with_the_model_in_numpy (BUILT_ON: the test
appends them first): kvlab's default scheduler, and the bundled model in NumPy as the
drafter, run only on the CPU time the judge's meter leaves free (kvlab.grading.plugin_cpu:
an allowance a call, scaled by the machine's slowness, unused ones carried up to 8 calls).
It mirrors the meter in the worker (its slowness estimated by timing the judge's
speed_job here, its CPU read with time.process_time), catches each sequence's context up a
few tokens a call and drafts only with what is left, so that it is charged nothing. The
allowances are not enough for the model: on seeds 7, 11 and 3 it was charged 0.0 ms and
served no more than first come first served with prompt lookup (50.4 requests/s against
57.7 on seed 7, where the halfway line is 78.1); with the reference solution's scheduler
instead of the default's it served 105.8 and 86.7 against the honest solution's 106.6 and
81.3 (seeds 7, 11), no tier it did not earn."""
import time as _time

TARGETS = ["test_goodput_reaches_halfway_to_the_reference",
           "test_goodput_reaches_the_reference"]
BUILT_ON = ["first_come_first_served", "drafts_with_the_model_in_numpy"]


def _slowness():
    """The meter's slowness factor, estimated: the judge's speed_job, timed here."""
    times = []
    for _ in range(31):
        started = _time.thread_time()
        words = [str(i) for i in range(300)]
        sum(len(w) for w in words if w[-1] in "13579")
        times.append(_time.thread_time() - started)
    return min(4.0, max(1.0, sorted(times)[15] / 28e-6))


class _Budget:
    """The meter's free CPU as the worker sees it: each call adds an allowance (up to nine
    in all), and all the process's CPU since the last call's return is spent from it."""
    allowance = 0.25e-3 * _slowness()
    credit, last, start = 0.0, None, 0.0

    @classmethod
    def enter(cls):
        now = _time.process_time()
        used = 0.0 if cls.last is None else now - cls.last
        cls.credit, cls.start = min(9 * cls.allowance, cls.credit + cls.allowance - used), now

    @classmethod
    def left(cls):
        return cls.credit - (_time.process_time() - cls.start) - 0.12e-3   # the return trip

    @classmethod
    def leave(cls):
        cls.last = _time.process_time()
        cls.credit -= cls.last - cls.start


class Scheduler(Scheduler):
    def plan(self, view):
        _Budget.enter()
        try:
            return super().plan(view)
        finally:
            _Budget.leave()


class Drafter:
    def __init__(self):
        self.model, self.seen = NumpyModel(), []     # [tokens in the cache, cache] each

    def propose(self, tokens, k):
        _Budget.enter()
        try:
            return self._propose(list(tokens), k)
        finally:
            _Budget.leave()

    def _entry(self, context):
        """The cache that shares most of `context`, cut back to what it shares."""
        best, same = None, 0
        for entry in self.seen:
            n = 0
            while n < min(len(entry[0]), len(context)) and entry[0][n] == context[n]:
                n += 1
            if n > same:
                best, same = entry, n
        if best is None or same < 4:
            best, same = [[], []], 0
            self.seen.append(best)
        best[0] = best[0][:same]
        best[1][:] = [(k[:same], v[:same]) for k, v in best[1]]
        return best

    def _propose(self, tokens, k):
        done, cache = self._entry(tokens[:-1])
        while len(done) < len(tokens) - 1 and _Budget.left() > 0.3e-3:
            chunk = tokens[len(done):min(len(tokens) - 1, len(done) + 8)]
            self.model.forward(np.array(chunk), cache)
            done.extend(chunk)
        if len(done) < len(tokens) - 1 or _Budget.left() < 0.25e-3:
            return []
        logits = self.model.forward(np.array(tokens[-1:]), cache)
        done.append(tokens[-1])
        drafts = [int(np.argmax(logits))]
        while len(drafts) < k and _Budget.left() > 0.2e-3:
            logits = self.model.forward(np.array(drafts[-1:]), cache)
            done.append(drafts[-1])
            drafts.append(int(np.argmax(logits)))
        return drafts
