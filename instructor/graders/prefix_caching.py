"""Hidden grading tests for lab 7 (prefix caching). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Every test replays a stream of requests (admit a prompt, decode a few tokens, free) on the
student's PrefixCache and on kvlab's C pool (kvlab.PagedPool, whose block manager is csrc/blocks.c) side by side,
and compares them after every operation. The pool is fed token ids and rows of zeros (its
append without a model), except in the last test, where the bundled model computes the rows
and picks the tokens. What must agree:

  * the tokens each admission reuses, and stats(): hits, misses, blocks used, cached, free;
  * which blocks are cached, each named by what it holds (the sequence's tokens from the
    start to the block's end): block ids are the student's (which free block to hand out
    is up to them), and the pool's LRU order is only required where blocks get evicted;
  * which block-table entries share a block: two entries share one in the student's cache
    exactly when they do in the pool.

Small fixed scenarios check one rule each (their tokens drawn at grading time). A reused
block is taken as it is, never computed again; on a pool with room to spare, computing it
again and then swapping it for its registered twin ends in the same books, so the reuse
scenarios admit a request while the free blocks are enough for the tokens it does not reuse
and no more. Then seeded random streams (shared system prompts, repeated prompts, the next
turn of a conversation, prompts diverging mid-block, equal blocks after a different first
block, up to three requests live at once, block sizes that do not divide the prompts) on
pools with room for everything (nothing is ever evicted) and on pools just big enough for
the live requests (evictions all the time); and requests decoded by the bundled model
through a real pool.
"""
import zlib

import numpy as np

import kvlab
from kvlab.grading.remote import RemoteError, RemoteObject
from kvlab.grading.testkit import bundled_model, described, points, raises, whole_number

STATS = ("prefix_hits", "prefix_misses", "blocks_used", "blocks_cached", "blocks_free")


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


def prepare():
    bundled_model()


def show(tokens, limit=8):
    tokens = [int(t) for t in tokens]
    if len(tokens) <= limit:
        return str(tokens)
    return f"[{', '.join(map(str, tokens[:limit]))}, ... ({len(tokens)} tokens)]"


def block_name(held, block_size):
    """A block named by what it holds: `held` is the sequence's tokens from its start to the
    block's end (None: a block no sequence was seen to hold)."""
    if held is None:
        return "a block no sequence ever held"
    end = len(held)
    start = (end - 1) // block_size * block_size
    where = f"tokens {start}..{end - 1}" if end - start > 1 else f"token {start}"
    name = f"the block of {where} {list(held[start:])}"
    if start:
        name += f" after {show(held[:start], 6)}"
    return name if end % block_size == 0 else name + " (partly filled)"


class Pool:
    """kvlab's pool driven with token ids only: its append writes rows without a model (zeros
    here), and its prefix cache takes equal tokens after equal prefixes to be equal rows."""

    def __init__(self, num_blocks, block_size):
        self.pool = kvlab.PagedPool(1, 1, 1, num_blocks, block_size, max_seqs=64)
        self.handles = {}

    def admit(self, seq, prompt):
        handle = self.handles[seq] = self.pool.new_sequence()
        # as kvlab.Engine does: the last token is always computed (its logits pick the next)
        reused = self.pool.reuse_prefix(handle, prompt, len(prompt) - 1)
        self.append(seq, prompt[reused:])
        return reused

    def append(self, seq, tokens):
        if tokens:
            rows = np.zeros((len(tokens), 1, 1, 1), np.float32)
            self.pool.append(self.handles[seq], np.asarray(tokens, np.int32), rows, rows)

    def free(self, seq):
        self.pool.free(self.handles.pop(seq))

    def state(self):
        self.pool.check()
        stats = self.pool.stats()
        return ({key: getattr(stats, key) for key in STATS}, list(self.pool.cached_blocks),
                {seq: handle.block_table.tolist() for seq, handle in self.handles.items()})


class ModelPool(Pool):
    """The same, with the bundled model computing the rows (prefill after reuse_prefix)."""

    def __init__(self, model, num_blocks, block_size):
        self.model = model
        self.pool = model.new_paged_pool(num_blocks=num_blocks, block_size=block_size)
        self.handles, self.logits = {}, {}

    def append(self, seq, tokens):
        if tokens:
            self.logits[seq] = self.model.prefill(np.asarray(tokens, np.int32), self.handles[seq])

    def next_token(self, seq):
        return int(np.argmax(self.logits[seq]))


def sharing(tables, order):
    """Each table entry labelled by its block's first appearance: equal labels, one block."""
    labels = {}
    return {seq: [labels.setdefault(b, len(labels)) for b in tables[seq]] for seq in order}


class Replay:
    """Your PrefixCache and kvlab's pool, given the same operations and compared after each."""

    def __init__(self, sub, num_blocks, block_size, lru_order=True, label="", pool=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache = sub.PrefixCache(num_blocks, block_size)
        self.pool = pool or Pool(num_blocks, block_size)
        self.lru_order, self.label = lru_order, label
        self.tokens, self.live = {}, []         # live sequences: their tokens; in order
        self.mine, self.theirs = {}, {}         # block id -> what it held when last seen
        self.step, self.stats, self.cached = 0, {}, []
        self.pool_stats = {"blocks_free": num_blocks, "blocks_cached": 0}   # before each call
        self.history = []                       # what each operation was, for messages

    def admit(self, seq, prompt):
        prompt = [int(t) for t in prompt]
        want = self.pool.admit(seq, prompt)
        self.tokens[seq] = list(prompt)
        self.live.append(seq)
        got = self.run(("admit", seq, prompt), f"admit({seq}, {show(prompt)})")
        got = whole_number(got, f"{self.where}: admit returned")
        assert got == want, (
            f"{self.where}: the pool reused {want} tokens ({want // self.block_size} full "
            f"blocks found in the cache), yours says {got}")
        self.check()
        return got

    def append(self, seq, tokens):
        tokens = [int(t) for t in tokens]
        self.pool.append(seq, tokens)
        self.tokens[seq] += tokens
        self.run(("append", seq, tokens), f"append({seq}, {show(tokens)}) to a sequence of "
                                          f"{len(self.tokens[seq]) - len(tokens)} tokens")
        self.check()

    def free(self, seq):
        self.pool.free(seq)
        held = len(self.tokens.pop(seq))
        self.live.remove(seq)
        self.run(("free", seq), f"free({seq}), a sequence of {held} tokens")
        self.check()

    def run(self, call, what):
        self.step += 1
        self.where = f"{self.label}operation {self.step}, {what}"
        self.history.append(f"{self.step}. {what}")
        try:
            answers = self.cache.calls(call, ("stats",), ("cached_blocks",),
                                       *[("block_table", seq) for seq in self.live])
        except RemoteError as error:
            if not error.is_a("OutOfBlocks"):
                raise
            before = self.pool_stats
            raise AssertionError(
                f"{self.where}: your cache raised OutOfBlocks ({error.message}), the pool did "
                f"not: it had {before['blocks_free']} free and {before['blocks_cached']} cached "
                f"blocks before this. New blocks are taken only for the tokens not reused (a "
                f"reused block is taken as it is, never computed again), from the free blocks "
                f"first, then by evicting cached ones") from None
        self.got_stats, self.got_cached, tables = answers[1], answers[2], answers[3:]
        self.got_tables = dict(zip(self.live, tables))
        return answers[0]

    def check(self):
        where, bs, n = self.where, self.block_size, self.num_blocks
        want_stats, want_cached, want_tables = self.pool.state()
        # stats
        stats = self.got_stats
        assert isinstance(stats, dict), (f"{where}: stats() must return a dict with the keys "
                                         f"{', '.join(STATS)}; got {described(stats)}")
        mine = {}
        for key in STATS:
            assert key in stats, f"{where}: stats() has no key {key!r}"
            mine[key] = whole_number(stats[key], f"{where}: stats()[{key!r}]")
        if mine != want_stats:
            diff = "; ".join(f"{key} {want_stats[key]}, yours {mine[key]}"
                             for key in STATS if mine[key] != want_stats[key])
            raise AssertionError(f"{where}: the pool's stats differ from yours: {diff}")
        # tables: plain block ids, ceil(length / block_size) of them
        tables = self.got_tables
        for seq in self.live:
            table, length = tables[seq], len(self.tokens[seq])
            assert isinstance(table, (list, tuple)) and all(
                isinstance(b, (int, np.integer)) and not isinstance(b, bool) and 0 <= b < n
                for b in table), (f"{where}: block_table({seq}) must be a list of block ids "
                                  f"0..{n - 1}; got {described(table)}")
            assert len(table) == blocks_for(length, bs), (
                f"{where}: sequence {seq} holds {length} tokens, so {blocks_for(length, bs)} "
                f"blocks of {bs}; its table has {len(table)}: {list(table)}")
        used = {int(b) for seq in self.live for b in tables[seq]}
        assert len(used) == mine["blocks_used"], (
            f"{where}: the block tables hold {len(used)} different blocks, but stats() says "
            f"blocks_used {mine['blocks_used']}")
        cached = self.got_cached
        assert isinstance(cached, (list, tuple)) and all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in cached), (
            f"{where}: cached_blocks() must be a list of block ids; got {described(cached)}")
        cached = [int(b) for b in cached]
        assert len(cached) == mine["blocks_cached"], (
            f"{where}: cached_blocks() lists {len(cached)} blocks, stats() says blocks_cached "
            f"{mine['blocks_cached']}")
        assert len(set(cached)) == len(cached), (
            f"{where}: cached_blocks() lists a block twice: {cached}")
        in_use = sorted(set(cached) & used)
        assert not in_use, (f"{where}: block {in_use[0]} is in cached_blocks() and in a block "
                            f"table: a cached block is one nobody holds")
        # what every block holds, as last seen in a table
        for held, seen in ((self.mine, tables), (self.theirs, want_tables)):
            for seq in self.live:
                tokens = self.tokens[seq]
                for i, b in enumerate(seen[seq]):
                    held[int(b)] = tuple(tokens[:(i + 1) * bs])
        self.check_cached(where, [self.mine.get(b) for b in cached],
                          [self.theirs[b] for b in want_cached])
        self.check_sharing(where, sharing(tables, self.live), sharing(want_tables, self.live))
        self.stats, self.cached = mine, [self.mine.get(b) for b in cached]
        self.pool_stats = want_stats

    def check_cached(self, where, mine, theirs):
        bs = self.block_size
        if self.lru_order:
            if mine == theirs:
                return
            i = next(i for i in range(min(len(mine), len(theirs)) + 1)
                     if i == len(mine) or i == len(theirs) or mine[i] != theirs[i])
            said = f"{i} the same, then " if i else ""
            pool_next = block_name(theirs[i], bs) if i < len(theirs) else "nothing more"
            your_next = block_name(mine[i], bs) if i < len(mine) else "nothing more"
            raise AssertionError(
                f"{where}: the cached blocks, least recently used first, differ: {said}the "
                f"pool has {pool_next}; yours has {your_next} ({len(theirs)} cached in the "
                f"pool, {len(mine)} in yours)")
        extra = [m for m in mine if m not in set(theirs)]
        missing = [t for t in theirs if t not in set(mine)]
        assert not extra and not missing, (
            f"{where}: the cached blocks differ: "
            + (f"yours has {block_name(extra[0], bs)}, the pool does not" if extra else
               f"the pool has {block_name(missing[0], bs)}, yours does not"))

    def check_sharing(self, where, mine, theirs):
        for seq in self.live:
            if mine[seq] == theirs[seq]:
                continue
            i = next(i for i, (a, b) in enumerate(zip(mine[seq], theirs[seq])) if a != b)

            def partners(labels, label):
                return [(s, j) for s in self.live for j, x in enumerate(labels[s])
                        if x == label and (s, j) != (seq, i)]

            def said(entries):
                return (", ".join(f"sequence {s}'s block {j}" for s, j in entries[:3])
                        if entries else "no other table entry")
            held = tuple(self.tokens[seq][:(i + 1) * self.block_size])
            raise AssertionError(
                f"{where}: block {i} of sequence {seq} ({block_name(held, self.block_size)}) "
                f"is shared with {said(partners(theirs, theirs[seq][i]))} in the pool, with "
                f"{said(partners(mine, mine[seq][i]))} in yours")


# ---- request streams ----------------------------------------------------------------------

def generated(prefix, vocab):
    """The token a stream's "model" decodes after `prefix`: a fixed function of the prefix,
    as greedy decoding is, so that equal prompts get equal answers."""
    return zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes()) % vocab


def answer(prompt, n_new, vocab):
    tokens = list(prompt)
    for _ in range(n_new):
        tokens.append(generated(tokens, vocab))
    return tokens[len(prompt):]


def random_stream(seed, room):
    """(num_blocks, block_size, vocab, requests, operations): 24 requests (prompt, tokens
    to decode) and the order of their admissions, decode steps and frees, up to 3 live.
    room: the pool holds every block the stream could ever take, so nothing is evicted;
    else it holds the most the live requests ever need at once, plus 0 to 2."""
    rng = np.random.default_rng(seed)
    bs = (1, 2, 3, 4, 5, 8)[seed % 6]
    vocab = int(rng.choice([2, 3, 50, 1 << 20]))
    max_len = 6 * bs + 6

    def fresh(n):
        return [int(t) for t in rng.integers(0, vocab, int(n))]

    systems = [fresh(rng.integers(1, 3 * bs + 3)) for _ in range(int(rng.integers(1, 4)))]
    requests = []
    for _ in range(24):
        kind = rng.choice(["system", "fresh", "repeat", "turn", "branch", "other_start"],
                          p=[0.25, 0.1, 0.15, 0.2, 0.15, 0.15]) if requests else "system"
        if kind in ("repeat", "turn", "branch", "other_start"):
            prompt, n_new = requests[int(rng.integers(len(requests)))]
            said = prompt + answer(prompt, n_new, vocab)
        if kind == "system":
            prompt = systems[int(rng.integers(len(systems)))] + fresh(rng.integers(1, 2 * bs + 2))
        elif kind == "fresh":
            prompt = fresh(rng.integers(1, 4 * bs + 2))
        elif kind == "turn":                         # the conversation's next turn
            prompt = said + fresh(rng.integers(1, bs + 2))
        elif kind == "branch":                       # the same up to anywhere, then not
            prompt = said[:int(rng.integers(1, len(said) + 1))] + fresh(rng.integers(1, 2 * bs + 1))
        elif kind == "other_start":                  # the same blocks after another first one
            prompt = fresh(bs) + prompt[bs:] if len(prompt) > bs else fresh(bs + 1)
        prompt = prompt[:max_len]
        requests.append((prompt, int(rng.integers(0, min(2 * bs + 3, max_len + 2 - len(prompt))))))

    max_live = int(rng.integers(1, 4))
    ops, waiting, left, lengths, peak = [], list(range(len(requests))), {}, {}, 0
    while waiting or left:
        if waiting and (not left or (len(left) < max_live and rng.random() < 0.4)):
            r = waiting.pop(0)
            ops.append(("admit", r))
            left[r], lengths[r] = requests[r][1], len(requests[r][0])
        else:
            r = int(rng.choice(sorted(left)))
            if left[r] == 0:
                ops.append(("free", r))
                del left[r], lengths[r]
            else:
                ops.append(("decode", r))
                left[r] -= 1
                lengths[r] += 1
        peak = max(peak, sum(blocks_for(n, bs) for n in lengths.values()))
    if room:
        num_blocks = sum(blocks_for(len(p) + n, bs) for p, n in requests)
    else:
        num_blocks = peak + int(rng.integers(0, 3))
    return num_blocks, bs, vocab, requests, ops


def replay_stream(sub, seed, room):
    num_blocks, bs, vocab, requests, ops = random_stream(seed, room)
    replay = Replay(sub, num_blocks, bs, lru_order=not room,
                    label=f"stream {seed} ({num_blocks} blocks of {bs}), ")
    try:
        for op, r in ops:
            if op == "admit":
                replay.admit(r, requests[r][0])
            elif op == "decode":
                replay.append(r, [generated(replay.tokens[r], vocab)])
            else:
                replay.free(r)
    except AssertionError as failed:
        # a stream is long: show the operations that led here, so the case can be replayed
        shown = replay.history[-12:]
        raise AssertionError(f"{failed}\n  the stream up to there ({len(replay.history) - len(shown)} "
                             f"earlier operations left out):\n    " + "\n    ".join(shown)) from None


def seeds(rng):
    """Ten streams known to reach every rule, and three drawn at grading time."""
    return list(range(10)) + [int(x) for x in rng.integers(100, 1 << 30, size=3)]


def distinct_blocks(rng, n_blocks, block_size):
    """n_blocks lists of block_size tokens, no two equal."""
    tokens = rng.permutation(10_000)[:n_blocks * block_size] + 1
    return [[int(t) for t in tokens[i * block_size:(i + 1) * block_size]] for i in range(n_blocks)]


def is_hashable(value):
    try:
        hash(value)
    except TypeError:
        return False
    return not isinstance(value, RemoteObject)


# ---- the tests ------------------------------------------------------------------------------

@points(1)
def test_block_hash_chains_through_the_parent(sub, rng):
    """block_hash(parent, tokens): the same for the same arguments, different for another parent"""
    for _ in range(4):
        bs = int(rng.integers(1, 9))
        a, b, c = distinct_blocks(rng, 3, bs)
        h_a = sub.block_hash(None, a)
        assert is_hashable(h_a), (f"block_hash(None, {a}) must return a hashable value (an "
                                  f"int, say), got {described(h_a)}")
        assert sub.block_hash(None, list(a)) == h_a, (
            f"block_hash(None, {a}) gave two different values for the same arguments")
        h_ab, h_b = sub.block_hash(h_a, b), sub.block_hash(None, b)
        assert h_ab == sub.block_hash(h_a, b), f"block_hash(h, {b}) gave two different values"
        assert h_b != h_a, f"block_hash(None, {a}) and block_hash(None, {b}) must differ"
        assert h_ab != h_b, (
            f"tokens {b} as a first block and after block {a} must hash differently: "
            f"block_hash(block_hash(None, {a}), {b}) == block_hash(None, {b})")
        h_cb = sub.block_hash(sub.block_hash(None, c), b)
        assert h_ab != h_cb, (
            f"tokens {b} after block {a} and after block {c} must hash differently: their K "
            f"and V differ, since they depend on every token before them")


@points(2)
def test_a_repeated_prompt_reuses_its_full_blocks(sub, rng):
    """a prompt seen before: its full blocks are hits; the first time, each is a miss"""
    prompt = [int(t) for t in rng.integers(0, 1000, 14)]   # blocks of 4: 3 full, 2 tokens over
    # 6 blocks: no room to compute a reused block again (see operation 4)
    replay = Replay(sub, 6, 4, lru_order=False, label="6 blocks of 4, ")
    assert replay.admit(0, prompt) == 0
    assert replay.stats["prefix_misses"] == 3, (
        f"{replay.where}: the 3 full blocks of a prompt of 14 tokens are 3 misses")
    replay.free(0)
    assert replay.stats["blocks_cached"] == 3, (
        f"{replay.where}: its 3 full blocks are cached, its last block (2 tokens) is free")
    assert replay.admit(1, prompt) == 12, f"{replay.where}: 3 full blocks are reused"
    # a request with the same start while the first is live shares its blocks: 2 blocks
    # are free, enough for its last block, not for its 3 full ones computed again
    assert replay.admit(2, prompt + [int(rng.integers(0, 1000))]) == 12
    assert replay.stats["blocks_used"] == 5, (
        f"{replay.where}: 3 shared blocks and one last block each: 5 blocks used")
    replay.free(1)
    replay.free(2)
    assert replay.admit(3, prompt[:5]) == 4      # one full block of the prompt: a hit
    assert replay.admit(4, prompt[:1] + prompt) == 0, (
        f"{replay.where}: shifted by one token, no block is the same: nothing reused")
    assert (replay.stats["prefix_hits"], replay.stats["prefix_misses"]) == (7, 6), (
        f"{replay.where}: 3 + 3 + 1 hits, 3 + 3 misses")


@points(2)
def test_only_full_blocks_are_cached(sub, rng):
    """a partly filled last block is never cached; it is once decoding fills it"""
    a, b, c, d = distinct_blocks(rng, 4, 3)
    prompt = a + b + c[:1]                       # blocks of 3: 2 full, then 1 token
    replay = Replay(sub, 12, 3, lru_order=False, label="12 blocks of 3, ")
    replay.admit(0, prompt)
    replay.free(0)
    assert replay.stats["blocks_cached"] == 2 and replay.stats["blocks_free"] == 10, (
        f"{replay.where}: 2 full blocks cached, the block of 1 token free")
    assert replay.admit(1, prompt + c[1:] + d[:1]) == 6, (
        f"{replay.where}: the partly filled block was not cached, so only 6 tokens are reused")
    replay.free(1)                               # its third block (c) was full: now cached
    replay.admit(2, prompt)
    replay.append(2, c[1:])                      # decoding fills the third block
    replay.append(2, d[:1])
    replay.free(2)
    assert replay.admit(3, a + b + c + d) == 9, f"{replay.where}: blocks a, b, c are cached"
    replay.admit(4, a[:2])                       # shorter than a block: nothing looked up
    replay.append(4, a[2:] + b[:1])              # fills block a, which sequence 3 holds: shared
    replay.free(3)
    replay.free(4)


@points(2)
def test_equal_blocks_after_different_prefixes_do_not_match(sub, rng):
    """a block is found by its tokens and every token before it, not by its own tokens"""
    x, y, a, b, c, tail = distinct_blocks(rng, 6, 4)
    replay = Replay(sub, 16, 4, lru_order=False, label="16 blocks of 4, ")
    for seq, prompt in enumerate((x + a + c + tail[:1], x + b + tail[:1])):
        replay.admit(seq, prompt)
        replay.free(seq)
    assert replay.admit(2, x + b + c + tail[:1]) == 8, (
        f"{replay.where}: x and b are cached, and c only after x, a: 8 tokens reused")
    replay.free(2)
    assert replay.admit(3, y + a + c + tail[:1]) == 0, (
        f"{replay.where}: nothing starts with block y: nothing reused")
    assert replay.stats["blocks_used"] == 4, (
        f"{replay.where}: a and c after y are not the cached a and c after x: the new "
        f"sequence computes and holds 4 blocks of its own")
    replay.admit(4, x + a + c + tail)            # the first prompt again, while that one runs
    replay.free(3)
    replay.free(4)


@points(1)
def test_a_prompt_diverging_mid_block_reuses_the_blocks_before(sub, rng):
    """a shared system prompt of 10 tokens, blocks of 4: 8 tokens reused, not 10"""
    system = [int(t) for t in rng.permutation(500)[:10] + 1]
    questions = distinct_blocks(rng, 3, 3)
    # 8 blocks: room for the three requests' own blocks, none to compute a reused one again
    replay = Replay(sub, 8, 4, lru_order=False,
                    label="8 blocks of 4, a system prompt of 10 tokens, ")
    replay.admit(0, system + questions[0])
    assert replay.admit(1, system + questions[1]) == 8, (
        f"{replay.where}: the system prompt's 2 full blocks are reused (request 0 holds "
        f"them); its third block also holds question tokens, so it differs")
    # 2 blocks are free: enough for this request's last 2 blocks, not for all 4
    assert replay.admit(2, system + questions[0][:1] + questions[2]) == 8, (
        f"{replay.where}: tokens 8..11 differ from request 0's in their last token")
    replay.free(0)
    assert replay.admit(3, system + questions[0] + [7, 1]) == 12, (
        f"{replay.where}: request 0's third block was full (tokens 8..11), so it is cached")


@points(2)
def test_eviction_takes_the_least_recently_used_block(sub, rng):
    """no free block: the least recently used cached block goes, a chain's tail before its head"""
    a, b, c, d, e = distinct_blocks(rng, 5, 5)
    replay = Replay(sub, 7, 2, label="7 blocks of 2, ")

    def names():
        return [block_name(held, 2) for held in replay.cached]
    replay.admit("A", a)                         # blocks a0 a1 and a partly filled a2
    replay.free("A")
    assert replay.cached == [tuple(a[:4]), tuple(a[:2])], (
        f"{replay.where}: A freed its last block first, so its tail a1 is less recently used "
        f"than its head a0: expected cached [a1, a0], got {names()}")
    replay.admit("B", b)
    replay.free("B")                             # cached: a1 a0 b1 b0; 3 free
    replay.admit("C", a[:3])                     # a hit on a0 ...
    replay.free("C")                             # ... which is now the most recently used
    assert replay.cached[-1] == tuple(a[:2]), (
        f"{replay.where}: a0 was used last, expected it last of {names()}")
    replay.admit("D", c[:4] + d[:4])             # 4 blocks: 3 free, then a1 is evicted
    assert tuple(a[:4]) not in replay.cached and tuple(a[:2]) in replay.cached, (
        f"{replay.where}: a1 is the least recently used: it goes, a0 stays; got {names()}")
    replay.admit("E", e[:4])                     # 2 blocks: b1 and b0 are evicted, a0 stays
    assert replay.cached == [tuple(a[:2])], (
        f"{replay.where}: a0 was used more recently than b0 and b1: it should be the one "
        f"left cached, got {names()}")
    replay.free("E")
    assert replay.admit("F", a) == 2, f"{replay.where}: a0 is still cached, a1 is not"
    replay.free("D")
    replay.free("F")
    # allocate() itself: free blocks first, then the least recently used cached one
    cache = replay.cache
    cached, free = cache.cached_blocks(), cache.stats()["blocks_free"]
    for _ in range(free):
        cache.allocate()
    assert cache.cached_blocks() == cached, (
        f"allocate() with {free} blocks free must hand those out before evicting anything: "
        f"cached_blocks() was {cached}, then {cache.cached_blocks()}")
    for i, block in enumerate(cached):
        got = cache.allocate()
        assert got == block, (f"no block free, cached_blocks() {cached[i:]}: allocate() must "
                              f"evict and return the least recently used, {block}; got {got!r}")
    with raises("OutOfBlocks", "allocate() with every block in use"):
        cache.allocate()


@points(1)
def test_a_block_computed_twice_is_shared(sub, rng):
    """a block that fills up like a registered one (same prefix, same tokens) is that one"""
    a, b, c = distinct_blocks(rng, 3, 4)
    replay = Replay(sub, 10, 4, lru_order=False, label="10 blocks of 4, ")
    replay.admit(0, a + b)                       # 8 tokens: 2 full blocks
    replay.free(0)
    assert replay.admit(1, a + b) == 4, (
        f"{replay.where}: only the 7 tokens before the last one are looked up: block a")
    assert replay.stats["blocks_used"] == 2 and replay.stats["blocks_cached"] == 0, (
        f"{replay.where}: block b, computed again, is the cached b: the sequence takes it and "
        f"lets go of its own copy, 2 blocks used, none cached")
    replay.free(1)
    # two live requests decode the same tokens side by side, as a batch does
    replay.admit(2, c[:3])
    replay.admit(3, c[:3])
    for token in c[3:] + a + b[:1]:              # 9 tokens: 2 full blocks and 1 token
        replay.append(2, [token])
        replay.append(3, [token])
    assert replay.stats["blocks_used"] == 4, (
        f"{replay.where}: each full block is held once, shared, then one last block each: "
        f"4 used")
    for seq in (2, 3):
        replay.free(seq)
    # blocks are taken before any is swapped for its registered twin: on a full pool, a
    # several-token append that fills a block already cached evicts for the copy it drops
    x, y, z = distinct_blocks(rng, 3, 2)
    full = Replay(sub, 5, 2, label="5 blocks of 2, ")
    full.admit("Z", y + z + [x[0]])              # then y and z are cached, 3 blocks free
    full.free("Z")
    full.admit("X", x + [int(x[0]) + 1])         # X holds block x (full) and a partial one
    full.admit("Y", x[:1])
    full.append("Y", x[1:] + y + z[:1])          # fills x (X's twin), then y; starts a block


@points(2)
def test_streams_with_room_match_the_paged_pool(sub, rng):
    """13 request streams, nothing evicted: the pool's reuse, stats, cached blocks and sharing"""
    for seed in seeds(rng):
        replay_stream(sub, seed, room=True)


@points(3)
def test_tight_pools_evict_like_the_paged_pool(sub, rng):
    """13 streams on pools just big enough: all that, and the pool's LRU order, at every step"""
    for seed in seeds(rng):
        replay_stream(sub, seed, room=False)


SYSTEM = "You are a helpful assistant who answers in the style of the Bard. "
QUESTIONS = ["Who is Romeo?", "Where is Verona?", "What is a sonnet?", "Why so sad?",
             "Who wrote this?", "What is love?"]


@points(2)
def test_requests_decoded_by_the_bundled_model(sub, rng):
    """a system prompt, six questions in a drawn order, three second turns: decoded by the model"""
    model = bundled_model()
    block_size, num_blocks = 8, 20
    pool = ModelPool(model, num_blocks, block_size)
    replay = Replay(sub, num_blocks, block_size, pool=pool,
                    label=f"the bundled model, {num_blocks} blocks of {block_size}, ")
    said = {}
    questions = [QUESTIONS[int(i)] for i in rng.permutation(len(QUESTIONS))]   # drawn order
    # a second turn right after its first reuses the whole conversation; one that comes
    # later finds its answer evicted, and reuses only the system prompt (with the block its
    # question's start may share with another question's)
    for seq in ("q0", "q1", "q1 again", "q2", "q3", "q0 again", "q4", "q5", "q5 again"):
        if seq.endswith(" again"):
            prompt = said[seq.split()[0]] + model.encode(" And then?", bos=False)
        else:
            prompt = model.encode(SYSTEM + questions[int(seq[1])])
        replay.admit(seq, prompt)
        for _ in range(12):
            replay.append(seq, [pool.next_token(seq)])
        said[seq] = replay.tokens[seq]
        replay.free(seq)
