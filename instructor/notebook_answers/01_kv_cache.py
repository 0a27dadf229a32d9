"""Worked answer to notebook 01's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("01_kv_cache", greedy_with_cache)
"""
import numpy as np


def greedy_with_cache(model, prompt_ids, n_new):
    # Room for the prompt and every token we feed back. (The last chosen token need not be
    # decoded, so len(prompt_ids) + n_new - 1 would do if the loop stopped one step early.)
    cache = model.new_cache(len(prompt_ids) + n_new)
    # Prefill: the whole prompt in one pass; its K and V stay in the cache. The logits
    # returned are the last prompt token's: they choose the first new token.
    logits = model.prefill(prompt_ids, cache)
    new_tokens = []
    for _ in range(n_new):
        token = int(np.argmax(logits))          # greedy: the highest score
        new_tokens.append(token)
        # Decode: only the new token runs; it attends over everything cached.
        logits = model.decode(token, cache)
    return new_tokens

# Mistakes the check catches:
# - re-running model.forward(prompt + new_tokens) each step: right tokens, but the check
#   counts the tokens run through the model and finds far more than len(prompt) + n_new;
# - decoding prompt_ids[-1] (or the first token) every step instead of the newest token;
# - returning the prompt with the new tokens.
