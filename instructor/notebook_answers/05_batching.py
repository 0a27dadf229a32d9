"""Worked answer to notebook 05's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("05_batching", batching_steps)
"""


def batching_steps(output_lengths, slots):
    # Static: groups of `slots` requests in order; a group lasts as long as its longest one.
    static = sum(max(output_lengths[i:i + slots]) for i in range(0, len(output_lengths), slots))

    # Continuous: step by step. Free slots are filled at the start of a step, in arrival
    # order; every running request makes one token; finished ones leave at the end.
    waiting = list(output_lengths)
    running = []                            # tokens each running request still has to make
    continuous = 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        running = [left - 1 for left in running if left > 1]
        continuous += 1
    return static, continuous

# kvlab.Engine(model, pool, max_batch_seqs=slots) with 1-token prompts makes exactly these
# steps (a request's first token comes from its prompt step). Mistakes the check catches:
# ceil(sum / slots) (perfect packing, which ignores that a request holds its slot throughout),
# continuous == static, summing the lengths of a group instead of taking its longest.
