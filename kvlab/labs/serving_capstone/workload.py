"""Lab 15's workload, drawn as the capstone's grader draws it (the README states its shape):
the grader imports draw() from here, so the trial at the end of the starter runs the same
kind of traffic a grade is measured on. It is not the grader's draw itself: that one's
seed, and so its rate and prompts, are chosen at grading time (and its text holds more
than the sample used here).
"""
import numpy as np

N_REQUESTS = 48
RATE = (220.0, 300.0)       # arrivals a second, drawn once a workload: more than kvlab serves well
SHORT, LONG = (4, 24), (100, 300)     # prompt lengths, [low, high): 70 % short, 30 % long
SHORT_SHARE = 0.7
NEW_TOKENS = (8, 64)


def draw(rng, ids, n_requests=N_REQUESTS):
    """(arrival second, prompt ids, new tokens) for each of n_requests: Poisson arrivals at
    a rate drawn from RATE, prompts cut from the token ids `ids`, SHORT_SHARE of them of
    SHORT lengths and the rest LONG, NEW_TOKENS new tokens each. rng: a NumPy Generator."""
    rate = float(rng.uniform(*RATE))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(*SHORT) if rng.random() < SHORT_SHARE else rng.integers(*LONG))
        start = int(rng.integers(0, len(ids) - length))
        requests.append((float(arrival), ids[start:start + length], int(rng.integers(*NEW_TOKENS))))
    return requests


def trial(model, seed=0, n_requests=N_REQUESTS):
    """A workload drawn as the grader's, with prompts cut from the sample text kvlab serves
    (kvlab.serving.SAMPLE_TEXT), from `seed`: the same requests every time for one seed."""
    from kvlab import serving
    return draw(np.random.default_rng(seed), model.encode(serving.SAMPLE_TEXT * 8), n_requests)
