"""Hidden grading tests for lab 5 (block allocator). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Fixed scenarios check fork, copy-on-write, free and running out of blocks one rule at a
time, each on its worked example (blocks of 4, mostly) and again on a block size and
lengths drawn at grading time. Then seeded random runs of new / append / fork / free check the allocator's
invariants after every operation (the ones kvlab's own pool.check() verifies), and drive
kvlab's C pool (kvlab.PagedPool, whose block manager is csrc/blocks.c) with the very same operations: your
allocator must have as many free blocks as the pool after every step, copy a block
exactly when the pool does and run out of blocks at exactly the same operations. The pool
keeps freed full blocks for prefix reuse ("cached"), and hands them out when it needs
blocks, so its free count here is `pool.available_blocks` (free + cached).
"""
from collections import Counter

import numpy as np

import kvlab
from kvlab.grading.remote import RemoteError
from kvlab.grading.testkit import bundled_model, points, raises


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


def prepare():
    bundled_model()


def state(alloc, seqs, num_blocks):
    """Everything the allocator shows through its methods (asked in one round trip)."""
    seqs = list(seqs)
    answers = alloc.calls(*[("block_table", s) for s in seqs], *[("length", s) for s in seqs],
                          *[("ref_count", b) for b in range(num_blocks)], ("num_free_blocks",))
    tables, lengths = answers[:len(seqs)], answers[len(seqs):2 * len(seqs)]
    for s, table in zip(seqs, tables):
        assert isinstance(table, (list, tuple)), (
            f"block_table({s}) must return a list of block ids, got {table!r}")
    return {"tables": {s: list(t) for s, t in zip(seqs, tables)},
            "lengths": dict(zip(seqs, lengths)),
            "ref_counts": answers[2 * len(seqs):-1], "free": answers[-1]}


def ran_out(error):
    """True for the student's OutOfBlocks; any other exception of theirs goes on up."""
    if isinstance(error, RemoteError) and error.is_a("OutOfBlocks"):
        return True
    raise error


def check_invariants(alloc, seqs, num_blocks, block_size, where):
    """The pool's invariants (pool.check() in kvlab), through the allocator's methods."""
    seen = state(alloc, seqs, num_blocks)
    entries = Counter()
    for s in seqs:
        table, length = seen["tables"][s], seen["lengths"][s]
        assert len(table) == blocks_for(length, block_size), (
            f"{where}: sequence {s} holds {length} tokens, so ceil({length} / {block_size}) = "
            f"{blocks_for(length, block_size)} blocks, but its table has {len(table)}: {table}")
        for b in table:
            assert isinstance(b, (int, np.integer)) and 0 <= b < num_blocks, (
                f"{where}: sequence {s}'s table {table} holds {b!r}, not a block id in "
                f"0..{num_blocks - 1}")
        entries.update(table)
    for b in range(num_blocks):
        got = seen["ref_counts"][b]
        assert got == entries[b], (f"{where}: block {b} appears in {entries[b]} block-table "
                                   f"entries, but ref_count({b}) is {got}")
    used, free = len(entries), seen["free"]
    assert free + used == num_blocks, (
        f"{where}: {used} blocks are referenced and num_free_blocks() says {free}: together "
        f"they should be every one of the {num_blocks} blocks (each block is free xor used)")


def expected_need(alloc, seq, n_tokens, block_size):
    """Blocks append(seq, n_tokens) must take, worked out from the allocator's own state."""
    table, length = alloc.block_table(seq), alloc.length(seq)
    copy = length % block_size != 0 and alloc.ref_count(table[-1]) > 1
    return int(copy), blocks_for(length + n_tokens, block_size) - len(table)


def checked_append(alloc, seqs, seq, n_tokens, num_blocks, block_size, where):
    """append() with every rule about it checked; returns the copies, or None if it ran
    out of blocks (correctly)."""
    before = state(alloc, seqs, num_blocks)
    copy, new = expected_need(alloc, seq, n_tokens, block_size)
    what = (f"{where}: append({seq}, {n_tokens}) to a sequence of {before['lengths'][seq]} "
            f"tokens, table {before['tables'][seq]}, with {before['free']} free blocks")
    try:
        copies = alloc.append(seq, n_tokens)
    except RemoteError as error:
        ran_out(error)
        assert copy + new > before["free"], (
            f"{what} raised OutOfBlocks, but it needs only {copy} copy + {new} new blocks")
        after = state(alloc, seqs, num_blocks)
        assert after == before, f"{what} raised OutOfBlocks but changed the allocator:\n" \
                                f"  before {before}\n  after  {after}"
        return None
    assert copy + new <= before["free"], (
        f"{what} should raise OutOfBlocks: it needs {copy} copy + {new} new blocks")
    copies = [tuple(c) for c in copies] if isinstance(copies, (list, tuple)) else copies
    table = alloc.block_table(seq)
    assert alloc.length(seq) == before["lengths"][seq] + n_tokens, (
        f"{what}: expected length {before['lengths'][seq] + n_tokens}, got {alloc.length(seq)}")
    assert alloc.num_free_blocks() == before["free"] - copy - new, (
        f"{what}: it takes {copy} copy + {new} new blocks, so {before['free'] - copy - new} "
        f"should stay free; num_free_blocks() is {alloc.num_free_blocks()}")
    old = before["tables"][seq]
    if copy:
        src, dst = old[-1], table[len(old) - 1]
        assert copies == [(src, dst)], (
            f"{what}: its last block {src} is shared (ref count {before['ref_counts'][src]}) "
            f"and partly filled, so it must be copied: expected copies [({src}, {dst})] "
            f"(the new block in its place), got {copies!r}")
        assert table[:len(old) - 1] == old[:-1], f"{what}: only the last block may change"
        assert before["ref_counts"][dst] == 0, (
            f"{what}: the copy went into block {dst}, which was not free "
            f"(ref count {before['ref_counts'][dst]})")
    else:
        assert copies == [], f"{what}: no copy is needed, expected [], got {copies!r}"
        assert table[:len(old)] == old, (
            f"{what}: the blocks it had must stay: {old}, got {table[:len(old)]}")
    for b in table[len(old):]:
        assert before["ref_counts"][b] == 0, (
            f"{what}: new block {b} was not free before (ref count {before['ref_counts'][b]})")
    return copies


def random_ops(rng, n_ops, block_size):
    """A reproducible list of operations on positions in the list of live sequences."""
    ops, live = [], 0
    for _ in range(n_ops):
        r = rng.random()
        if live == 0 or (r < 0.10 and live < 6):
            ops.append(("new",))
            live += 1
        elif r < 0.25 and live < 8:
            ops.append(("fork", int(rng.integers(live))))
            live += 1
        elif r < 0.45:
            ops.append(("free", int(rng.integers(live))))
            live -= 1
        else:
            n = 1 if rng.random() < 0.6 else int(rng.integers(1, 2 * block_size + 1))
            ops.append(("append", int(rng.integers(live)), n))
    return ops


def random_case(seed):
    """A small pool (so it runs out often) and 150 operations."""
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(4, 25))
    block_size = int(rng.choice([1, 2, 3, 4, 8]))
    return num_blocks, block_size, random_ops(rng, 150, block_size)


def seeds(rng):
    """Twelve cases known to reach every rule, and four drawn at grading time."""
    return list(range(12)) + [int(x) for x in rng.integers(100, 1 << 30, size=4)]


# Each fixed scenario runs twice: on its worked example (blocks of 4, the numbers in its
# messages), then on sizes and lengths drawn at grading time, so that neither a table of the
# worked example's answers nor a size taken for granted passes it.

def drawn_block_size(rng):
    """Never 4, the worked examples' size, nor 1 or 2: a length can then fill whole blocks of
    4 and not of this size, or the other way round."""
    return int(rng.choice([3, 5, 6, 7]))


def length_unlike_4(rng, block_size, full):
    """A length of at most 3 blocks that fills its last block of block_size (full) or leaves
    it partly filled (not full), and does the opposite for blocks of 4."""
    choices = [n for n in range(1, 3 * block_size + 1)
               if (n % block_size == 0) == full and (n % 4 == 0) != full]
    return int(rng.choice(choices))


def partial_length(rng, block_size):
    """A length of at most 3 blocks whose last block is partly filled."""
    return int(rng.choice([n for n in range(1, 3 * block_size) if n % block_size]))


def grows(sub, num_blocks, block_size, appends):
    alloc = sub.BlockAllocator(num_blocks, block_size)
    sizes = f"{num_blocks} blocks of {block_size}"
    seq = alloc.new_sequence()
    assert alloc.length(seq) == 0 and alloc.block_table(seq) == [], (
        f"{sizes}, a new sequence: expected length 0 and table [], got {alloc.length(seq)} "
        f"and {alloc.block_table(seq)}")
    assert alloc.num_free_blocks() == num_blocks, (
        f"{sizes}, nothing used: expected {num_blocks} free blocks, got {alloc.num_free_blocks()}")
    total = 0
    for n_tokens in appends:
        checked_append(alloc, [seq], seq, n_tokens, num_blocks, block_size,
                       f"{sizes}, after {total} tokens")
        total += n_tokens
        check_invariants(alloc, [seq], num_blocks, block_size, f"{sizes}, after {total} tokens")
    want = blocks_for(total, block_size)
    assert len(alloc.block_table(seq)) == want and alloc.num_free_blocks() == num_blocks - want, (
        f"{sizes}, {total} tokens: expected {want} blocks in the table and "
        f"{num_blocks - want} free, got {len(alloc.block_table(seq))} and "
        f"{alloc.num_free_blocks()}")
    other = alloc.new_sequence()
    assert other != seq, f"new_sequence() returned id {other} twice"


@points(2)
def test_append_takes_a_block_every_block_size_tokens(sub, rng):
    """a sequence grows one block at a time, ceil(length / block_size) blocks"""
    grows(sub, 5, 4, (1, 3, 1, 6, 6))
    bs = drawn_block_size(rng)
    # the second append alone needs at least two new blocks
    appends = [int(rng.integers(1, bs + 1)), 2 * bs + int(rng.integers(1, bs + 1)),
               *(int(n) for n in rng.integers(1, 2 * bs + 1, size=3))]
    grows(sub, blocks_for(sum(appends), bs), bs, appends)


def forks(sub, num_blocks, block_size, length, other_length):
    """A parent of `length` tokens forked twice; another sequence of other_length tokens
    (none if 0) lives beside them and shares nothing."""
    alloc = sub.BlockAllocator(num_blocks, block_size)
    sizes = f"{num_blocks} blocks of {block_size}"
    parent = alloc.new_sequence()
    alloc.append(parent, length)
    live = [parent]
    if other_length:
        other = alloc.new_sequence()
        alloc.append(other, other_length)
        live.append(other)
        beside = (f" (sequence {other}, of {other_length} tokens and table "
                  f"{alloc.block_table(other)}, lives beside them)")
    else:
        beside = ""
    table, free = alloc.block_table(parent), alloc.num_free_blocks()
    child = alloc.fork(parent)
    assert child not in live, f"fork returned the id of a live sequence, {child}"
    assert alloc.block_table(child) == table, (
        f"{sizes}: the child must share the parent's blocks {table}, got "
        f"{alloc.block_table(child)}")
    assert alloc.length(child) == length, (
        f"{sizes}: the child holds {length} tokens, got {alloc.length(child)}")
    refs = [alloc.ref_count(b) for b in table]
    assert refs == [2] * len(table), (
        f"{sizes}: each of {table} is held by 2 tables now{beside}: got ref counts {refs}")
    assert alloc.num_free_blocks() == free, (
        f"{sizes}: fork takes no block: {free} were free, now {alloc.num_free_blocks()}")
    check_invariants(alloc, live + [child], num_blocks, block_size, f"{sizes}, after the fork")
    grandchild = alloc.fork(child)
    refs = [alloc.ref_count(b) for b in table]
    assert refs == [3] * len(table), (
        f"{sizes}: a fork of the fork: each of {table} is held by 3 tables{beside}, got ref "
        f"counts {refs}")
    check_invariants(alloc, live + [child, grandchild], num_blocks, block_size,
                     f"{sizes}, after a second fork")


@points(2)
def test_fork_shares_every_block(sub, rng):
    """fork gives the child the parent's blocks: ref counts up, no block taken"""
    forks(sub, 8, 4, 10, 0)                      # 3 blocks, the last holds 2 of 4
    bs = drawn_block_size(rng)
    length, other = (int(n) for n in rng.integers(1, 3 * bs + 1, size=2))
    forks(sub, blocks_for(length, bs) + blocks_for(other, bs) + int(rng.integers(0, 3)), bs,
          length, other)


def copies_on_write(sub, num_blocks, block_size, length, n_seqs, order):
    """n_seqs sequences share a prompt of `length` tokens (its last block partly filled);
    each writes one token, in `order`."""
    alloc = sub.BlockAllocator(num_blocks, block_size)
    seqs = [alloc.new_sequence()]
    alloc.append(seqs[0], length)
    shared = alloc.block_table(seqs[0])
    seqs += [alloc.fork(seqs[0]) for _ in range(n_seqs - 1)]
    sizes = f"{num_blocks} blocks of {block_size}"
    for turn, i in enumerate(order):
        seq = seqs[i]
        what = (f"{sizes}, {n_seqs} sequences share {shared} ({length} tokens); "
                + (f"sequence {i} writes first" if turn == 0 else f"then sequence {i} writes"))
        copies = checked_append(alloc, seqs, seq, 1, num_blocks, block_size, what)
        table = alloc.block_table(seq)
        if turn < n_seqs - 1:
            assert copies and table[:-1] == shared[:-1], (
                f"{what}: expected a copy of block {shared[-1]}, the blocks before it still "
                f"shared, got copies {copies} and table {table}")
        else:
            assert table == shared, (
                f"{what}: the last sharer holds block {shared[-1]} alone by now: it writes "
                f"in place, table {shared}; got {table}")
        check_invariants(alloc, seqs, num_blocks, block_size, f"{what}, after the write")
    refs = [alloc.ref_count(b) for b in shared]
    assert refs == [n_seqs] * (len(shared) - 1) + [1], (
        f"{sizes}, after every sequence wrote: the full blocks of {shared} stay shared by all "
        f"{n_seqs}, the last is held by one: expected ref counts "
        f"{[n_seqs] * (len(shared) - 1) + [1]}, got {refs}")
    used = len(shared) + n_seqs - 1
    assert alloc.num_free_blocks() == num_blocks - used, (
        f"{sizes}: {len(shared)} prompt blocks + {n_seqs - 1} copies are used: expected "
        f"{num_blocks - used} free, got {alloc.num_free_blocks()}")


@points(2)
def test_writing_into_a_shared_partly_filled_block_copies_it(sub, rng):
    """the first writer copies the shared last block; the last sharer writes in place"""
    copies_on_write(sub, 10, 4, 6, 3, [0, 1, 2])  # block 0 full, block 1 holds 2 rows
    bs, n_seqs = drawn_block_size(rng), int(rng.integers(2, 5))
    length = length_unlike_4(rng, bs, full=False)
    copies_on_write(sub, blocks_for(length, bs) + n_seqs - 1 + int(rng.integers(0, 3)), bs,
                    length, n_seqs, [int(i) for i in rng.permutation(n_seqs)])


def fork_at_an_edge(sub, num_blocks, block_size, length):
    alloc = sub.BlockAllocator(num_blocks, block_size)
    parent = alloc.new_sequence()
    alloc.append(parent, length)
    child = alloc.fork(parent)
    what = f"a fork of {length} tokens in blocks of {block_size} ({num_blocks} blocks)"
    for seq in (parent, child, parent):
        checked_append(alloc, [parent, child], seq, 1, num_blocks, block_size, what)
    parent_table, child_table = alloc.block_table(parent), alloc.block_table(child)
    full = length // block_size
    assert parent_table[:full] == child_table[:full] and parent_table[full] != child_table[full], (
        f"{what}: the {full} full blocks stay shared and each sequence gets a block of its "
        f"own: got parent {parent_table}, child {child_table}")
    assert alloc.num_free_blocks() == num_blocks - full - 2, (
        f"{what}: {full} shared blocks + one new block each: expected "
        f"{num_blocks - full - 2} free of {num_blocks}, got {alloc.num_free_blocks()}")
    check_invariants(alloc, [parent, child], num_blocks, block_size, f"{what}, after both wrote")


@points(1)
def test_a_full_shared_block_is_not_copied(sub, rng):
    """after a fork at a block edge, both sequences take new blocks and copy nothing"""
    fork_at_an_edge(sub, 6, 4, 8)
    bs = drawn_block_size(rng)
    length = length_unlike_4(rng, bs, full=True)
    fork_at_an_edge(sub, length // bs + 2 + int(rng.integers(0, 3)), bs, length)


def free_the_parent(sub, num_blocks, block_size, length, n_tokens):
    """A parent of `length` tokens forked; the child appends n_tokens (a copy and new blocks);
    then the parent is freed."""
    alloc = sub.BlockAllocator(num_blocks, block_size)
    sizes = f"{num_blocks} blocks of {block_size}"
    parent = alloc.new_sequence()
    alloc.append(parent, length)
    child = alloc.fork(parent)
    alloc.append(child, n_tokens)
    parent_table, child_table = alloc.block_table(parent), alloc.block_table(child)
    free = alloc.num_free_blocks()
    alloc.free(parent)
    own = [b for b in parent_table if b not in child_table]
    assert alloc.num_free_blocks() == free + len(own), (
        f"{sizes}: freeing the parent (table {parent_table}) returns only the blocks the child "
        f"(table {child_table}) does not hold, {own}: expected {free + len(own)} free, got "
        f"{alloc.num_free_blocks()}")
    assert alloc.block_table(child) == child_table and alloc.length(child) == length + n_tokens, (
        f"{sizes}: freeing the parent must leave the child as it was: table {child_table}, "
        f"{length + n_tokens} tokens; got {alloc.block_table(child)}, {alloc.length(child)}")
    for b in child_table:
        assert alloc.ref_count(b) == 1, (
            f"{sizes}: block {b} of the child: expected ref count 1 after the parent is freed, "
            f"got {alloc.ref_count(b)}")
    check_invariants(alloc, [child], num_blocks, block_size, f"{sizes}, after freeing the parent")
    # the child's blocks must not be handed out again while it holds them
    other = alloc.new_sequence()
    checked_append(alloc, [child, other], other, block_size * alloc.num_free_blocks(), num_blocks,
                   block_size, f"{sizes}, a new sequence takes every free block")
    assert not set(alloc.block_table(other)) & set(child_table), (
        f"{sizes}: the new sequence got {alloc.block_table(other)}, which overlaps the child's "
        f"{child_table}")
    alloc.free(child)
    alloc.free(other)
    assert alloc.num_free_blocks() == num_blocks, (
        f"{sizes}, all freed: expected {num_blocks} free, got {alloc.num_free_blocks()}")
    check_invariants(alloc, [], num_blocks, block_size, f"{sizes}, after freeing everything")


@points(2)
def test_freeing_the_parent_keeps_the_childs_blocks(sub, rng):
    """free drops one reference; only blocks nobody holds become free"""
    free_the_parent(sub, 8, 4, 7, 3)             # the child copies block 1, then takes one
    bs = drawn_block_size(rng)
    length, n_tokens = partial_length(rng, bs), int(rng.integers(1, 2 * bs + 1))
    grown = blocks_for(length + n_tokens, bs) - blocks_for(length, bs)
    # room for the blocks held, and for a fork that copied them all
    free_the_parent(sub, 2 * blocks_for(length, bs) + grown + 1 + int(rng.integers(0, 3)), bs,
                    length, n_tokens)


def runs_out(sub, free, block_size, length, parent_first, short):
    """A of `length` tokens (its last block partly filled) and B, its fork, share every
    block, with `free` blocks free. The first writer (A or B) needs a copy and `free` new
    blocks: too many; then a copy and free - 1, exactly enough (each append `short` tokens
    under the most those blocks hold). The other, alone in its partly filled block by then,
    fills it, then needs a block: none is left."""
    held = blocks_for(length, block_size)
    num_blocks = held + free
    alloc = sub.BlockAllocator(num_blocks, block_size)
    a = alloc.new_sequence()
    alloc.append(a, length)
    b = alloc.fork(a)
    seqs = [a, b]
    first, second = (a, b) if parent_first else (b, a)
    name = {a: "a", b: "b"}
    sizes = f"{num_blocks} blocks of {block_size}, a of {length} tokens and b its fork"
    assert alloc.num_free_blocks() == free, (
        f"{sizes}: a holds {held} blocks and b shares them: expected {free} free, got "
        f"{alloc.num_free_blocks()}")
    too_many = (held + free) * block_size - length - short
    before = state(alloc, seqs, num_blocks)
    what = f"{sizes}: append({name[first]}, {too_many})"
    with raises("OutOfBlocks", f"{what} needs a copy and {free} new blocks, {free} are free"):
        alloc.append(first, too_many)
    assert state(alloc, seqs, num_blocks) == before, (
        f"{what} ran out of blocks (a copy + {free} new > {free} free) and must change "
        f"nothing:\n  before {before}\n  after  {state(alloc, seqs, num_blocks)}")
    enough = (held + free - 1) * block_size - length - short
    copies = checked_append(alloc, seqs, first, enough, num_blocks, block_size,
                            f"{sizes}: then append({name[first]}, {enough})")
    assert copies is not None, (
        f"{sizes}: append({name[first]}, {enough}) needs a copy + {free - 1} new blocks, "
        f"the {free} free: it must succeed")
    assert alloc.num_free_blocks() == 0
    fill = block_size - length % block_size
    checked_append(alloc, seqs, second, fill, num_blocks, block_size,
                   f"{sizes}: then append({name[second]}, {fill}), which fills its last block")
    before = state(alloc, seqs, num_blocks)
    with raises("OutOfBlocks", f"{sizes}: append({name[second]}, 1) needs a new block, none "
                               f"is free"):
        alloc.append(second, 1)
    assert state(alloc, seqs, num_blocks) == before, (
        f"{sizes}: append({name[second]}, 1) with no free block must change nothing:\n"
        f"  before {before}\n  after  {state(alloc, seqs, num_blocks)}")
    check_invariants(alloc, seqs, num_blocks, block_size, f"{sizes}, after running out")


@points(2)
def test_out_of_blocks_changes_nothing(sub, rng):
    """OutOfBlocks leaves every table, length and count as it was (a copy counts too)"""
    runs_out(sub, 4, 2, 3, parent_first=False, short=1)    # b, the fork, writes first
    bs = drawn_block_size(rng)
    runs_out(sub, int(rng.integers(2, 6)), bs, partial_length(rng, bs), parent_first=True,
             short=int(rng.integers(0, bs)))


@points(3)
def test_random_operations_keep_the_invariants(sub, rng):
    """12 seeded runs of new/append/fork/free: every invariant after every operation"""
    for seed in seeds(rng):
        num_blocks, block_size, ops = random_case(seed)
        alloc = sub.BlockAllocator(num_blocks, block_size)
        live = []
        for step, op in enumerate(ops):
            where = f"seed {seed} ({num_blocks} blocks of {block_size}), operation {step} {op}"
            if op[0] == "new":
                live.append(alloc.new_sequence())
            elif op[0] == "fork":
                try:
                    live.append(alloc.fork(live[op[1]]))
                except RemoteError as error:
                    if ran_out(error):
                        raise AssertionError(f"{where}: fork takes no block, so it never runs "
                                             f"out of blocks; yours raised OutOfBlocks") from None
            elif op[0] == "free":
                alloc.free(live.pop(op[1]))
            else:
                checked_append(alloc, live, live[op[1]], op[2], num_blocks,
                               block_size, where)
            assert len(set(live)) == len(live), f"{where}: a sequence id was handed out twice"
            check_invariants(alloc, live, num_blocks, block_size, where)


def pool_append(pool, handle, n_tokens, next_token):
    """Append n_tokens to a PagedPool sequence (no model: the K/V rows are zeros). Every
    token id is new, so no two full blocks ever hold the same tokens and the pool never
    merges blocks through its prefix cache. Returns (copies, error)."""
    tokens = np.arange(next_token, next_token + n_tokens, dtype=np.int32)
    rows = np.zeros((n_tokens, 1, 1, 2), dtype=np.float32)
    old = handle.block_table.tolist()
    try:
        pool.append(handle, tokens, rows, rows)
    except kvlab.OutOfBlocks:
        return 0, True
    new = handle.block_table.tolist()
    return int(bool(old) and new[len(old) - 1] != old[-1]), False


@points(3)
def test_random_operations_match_the_paged_pool(sub, rng):
    """the same operations on kvlab's C pool: same free blocks, copies and OutOfBlocks"""
    for seed in seeds(rng):
        num_blocks, block_size, ops = random_case(seed)
        alloc = sub.BlockAllocator(num_blocks, block_size)
        pool = kvlab.PagedPool(1, 1, 2, num_blocks, block_size, max_seqs=64,
                               max_blocks_per_seq=1024)
        live, handles, next_token = [], [], 0
        for step, op in enumerate(ops):
            where = f"seed {seed} ({num_blocks} blocks of {block_size}), operation {step} {op}"
            if op[0] == "new":
                live.append(alloc.new_sequence())
                handles.append(pool.new_sequence())
            elif op[0] == "fork":
                live.append(alloc.fork(live[op[1]]))
                handles.append(pool.fork(handles[op[1]]))
            elif op[0] == "free":
                alloc.free(live.pop(op[1]))
                pool.free(handles.pop(op[1]))
            else:
                seq, handle, n = live[op[1]], handles[op[1]], op[2]
                want_copies, pool_ran_out = pool_append(pool, handle, n, next_token)
                next_token += n
                try:
                    copies, out = alloc.append(seq, n), False
                except RemoteError as error:
                    copies, out = [], ran_out(error)
                assert out == pool_ran_out, (
                    f"{where}: the pool {'ran out of blocks' if pool_ran_out else 'had room'}, "
                    f"your allocator {'raised OutOfBlocks' if out else 'did not'}")
                got = len(copies) if copies is not None else None
                assert got == want_copies, (
                    f"{where}: the pool copied {want_copies} block(s) (copy-on-write), "
                    f"your append returned {copies!r}")
            pool.check()
            seen = state(alloc, live, num_blocks)
            assert seen["free"] == pool.available_blocks, (
                f"{where}: the pool has {pool.available_blocks} blocks to hand out, your "
                f"allocator {seen['free']}")
            want_refs = sorted(pool.ref_counts.tolist())
            got_refs = sorted(seen["ref_counts"], key=repr)
            assert got_refs == want_refs, (
                f"{where}: the pool's ref counts, sorted, are {want_refs}; yours {got_refs}")
            for seq, handle in zip(live, handles):
                mine = (seen["lengths"][seq], len(seen["tables"][seq]))
                assert mine == (handle.length, len(handle.block_table)), (
                    f"{where}: a sequence holds {handle.length} tokens in "
                    f"{len(handle.block_table)} blocks in the pool; yours {mine[0]} tokens "
                    f"in {mine[1]} blocks")


TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east."


def three_samples(sub, model, num_blocks, block_size, prompt, orders):
    """n=3 samples of `prompt` decoded for 12 steps (sample 0 is done after 8), each step's
    samples in the order `orders` draws (None: 0, 1, 2)."""
    pool = model.new_paged_pool(num_blocks=num_blocks, block_size=block_size)
    alloc = sub.BlockAllocator(num_blocks, block_size)
    first = alloc.new_sequence()
    handles = [pool.new_sequence()]
    model.prefill(prompt, handles[0])
    alloc.append(first, len(prompt))
    seqs = [first, alloc.fork(first), alloc.fork(first)]
    handles += [pool.fork(handles[0]), pool.fork(handles[0])]
    names = [0, 1, 2]
    log = []
    for t in range(12):
        if t == 8:                                   # sample 0 is done: its blocks go back
            alloc.free(seqs.pop(0))
            pool.free(handles.pop(0))
            names.pop(0)
        order = range(len(seqs)) if orders is None else orders.permutation(len(seqs))
        for j in order:
            seq, handle, i = seqs[j], handles[j], names[j]
            token = 97 + (3 * t + i) % 26            # different tokens for every sample
            old = handle.block_table.tolist()
            try:
                model.decode(token, handle)
                pool_copies, pool_ran_out = int(handle.block_table.tolist()[len(old) - 1] != old[-1]), False
            except kvlab.OutOfBlocks:
                pool_copies, pool_ran_out = 0, True
            try:
                copies, out = alloc.append(seq, 1), False
            except RemoteError as error:
                copies, out = [], ran_out(error)
            log.append((t, i, pool_copies, pool_ran_out))
            where = (f"decode step {t}, sample {i} (a prompt of {len(prompt)} tokens forked "
                     f"into 3, {num_blocks} blocks of {block_size})")
            assert out == pool_ran_out, (
                f"{where}: the pool {'ran out of blocks' if pool_ran_out else 'had room'}, "
                f"your allocator {'raised OutOfBlocks' if out else 'did not'}")
            assert copies is not None and len(copies) == pool_copies, (
                f"{where}: the pool copied {pool_copies} block(s), your append returned {copies!r}")
            assert alloc.num_free_blocks() == pool.available_blocks, (
                f"{where}: the pool has {pool.available_blocks} blocks left, your allocator "
                f"{alloc.num_free_blocks()}")
            pool.check()
    assert sum(c for _, _, c, _ in log) == 2 and any(r for _, _, _, r in log), log


@points(2)
def test_three_samples_decoded_by_the_bundled_model(sub, rng):
    """n=3 samples of one prompt, decoded by the model in a pool: same books as yours"""
    model = bundled_model()
    # the worked example: 7 tokens, a full block and 3 rows
    three_samples(sub, model, 9, 4, model.encode("ROMEO:\n"), None)
    # a drawn block size and prompt, the samples in a drawn order at every step; the pool is
    # one block short of what the samples hold after 8 steps, so it runs out before sample 0
    # is done
    bs = drawn_block_size(rng)
    prompt = model.encode(TEXT)[:length_unlike_4(rng, bs, full=False)]
    shared = len(prompt) // bs
    num_blocks = shared + 3 * (blocks_for(len(prompt) + 8, bs) - shared) - 1
    three_samples(sub, model, num_blocks, bs, prompt, rng)
