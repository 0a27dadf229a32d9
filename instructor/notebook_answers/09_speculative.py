"""Worked answer to notebook 09's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("09_speculative", speculative_step)
"""
import numpy as np


def speculative_step(model, cache, tokens, drafts):
    # One pass over the cache: the newest token (its K and V are not cached yet) and every
    # draft, as a prefill of 1 + len(drafts) tokens. all_logits=True gives one row per new
    # token: rows[i] is the model's choice for the position of drafts[i], and
    # rows[len(drafts)] the choice after the last draft.
    rows = model.forward([tokens[-1]] + list(drafts), cache, all_logits=True)
    kept = 0
    while kept < len(drafts) and int(np.argmax(rows[kept])) == drafts[kept]:
        kept += 1
    own = int(np.argmax(rows[kept]))         # the model's token after the kept drafts
    # The pass wrote K and V for the newest token and all the drafts; the refused drafts'
    # rows belong to tokens that are not in the text. Keep the context and the kept drafts;
    # the model's own token is fed (and cached) by the next step.
    cache.truncate(len(tokens) + kept)
    return list(drafts[:kept]) + [own]

# Mistakes the check catches:
# - no truncate (the refused drafts' K and V stay, and the next step attends over them);
# - truncating to len(tokens) + kept + 1 (the first refused draft stays cached);
# - returning the kept drafts without the model's own token;
# - carrying on past the first refused draft;
# - comparing drafts[i] with rows[i + 1] (row 0 is the newest token's: it predicts drafts[0]);
# - one model.decode per draft: the right tokens, but as many passes as tokens.
