"""Worked answer to notebook 11's "Your turn": the tokens a prefix cache reuses."""


def reused_tokens(prompts, block_size):
    """For each prompt (a list of token ids), in order: the longest prefix of prompt[:-1]
    that it shares with any earlier prompt, cut down to a multiple of block_size."""
    reused = []
    for i, prompt in enumerate(prompts):
        wanted = prompt[:-1]                      # the last token is always computed
        best = 0
        for earlier in prompts[:i]:               # every earlier prompt is cached whole
            n = 0
            while n < min(len(wanted), len(earlier)) and wanted[n] == earlier[n]:
                n += 1
            best = max(best, n)
        reused.append(best - best % block_size)   # only full blocks are found by hash
    return reused
