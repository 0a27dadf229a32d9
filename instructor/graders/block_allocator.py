"""Hidden grading tests for lab 5 (block allocator). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Fixed scenarios check fork, copy-on-write, free and running out of blocks one rule at a
time. Then seeded random runs of new / append / fork / free check the allocator's
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


@points(2)
def test_append_takes_a_block_every_block_size_tokens(sub, rng):
    """a sequence grows one block at a time, ceil(length / block_size) blocks"""
    alloc = sub.BlockAllocator(5, 4)
    seq = alloc.new_sequence()
    assert alloc.length(seq) == 0 and alloc.block_table(seq) == [], (
        f"a new sequence: expected length 0 and table [], got {alloc.length(seq)} and "
        f"{alloc.block_table(seq)}")
    assert alloc.num_free_blocks() == 5, f"expected 5 free blocks, got {alloc.num_free_blocks()}"
    for n_tokens, total in ((1, 1), (3, 4), (1, 5), (6, 11), (6, 17)):
        checked_append(alloc, [seq], seq, n_tokens, 5, 4, f"after {total - n_tokens} tokens")
        check_invariants(alloc, [seq], 5, 4, f"after {total} tokens")
    assert len(alloc.block_table(seq)) == 5 and alloc.num_free_blocks() == 0
    other = alloc.new_sequence()
    assert other != seq, f"new_sequence() returned id {other} twice"


@points(2)
def test_fork_shares_every_block(sub, rng):
    """fork gives the child the parent's blocks: ref counts up, no block taken"""
    alloc = sub.BlockAllocator(8, 4)
    parent = alloc.new_sequence()
    alloc.append(parent, 10)                         # 3 blocks, the last holds 2 of 4
    table, free = alloc.block_table(parent), alloc.num_free_blocks()
    child = alloc.fork(parent)
    assert child != parent, f"fork returned the parent's own id {parent}"
    assert alloc.block_table(child) == table, (
        f"the child must share the parent's blocks {table}, got {alloc.block_table(child)}")
    assert alloc.length(child) == 10, f"the child holds 10 tokens, got {alloc.length(child)}"
    assert [alloc.ref_count(b) for b in table] == [2, 2, 2], (
        f"each of {table} is held by 2 tables now: got ref counts "
        f"{[alloc.ref_count(b) for b in table]}")
    assert alloc.num_free_blocks() == free, (
        f"fork takes no block: {free} were free, now {alloc.num_free_blocks()}")
    check_invariants(alloc, [parent, child], 8, 4, "after the fork")
    grandchild = alloc.fork(child)
    assert [alloc.ref_count(b) for b in table] == [3, 3, 3], "a fork of the fork: ref count 3"
    check_invariants(alloc, [parent, child, grandchild], 8, 4, "after a second fork")


@points(2)
def test_writing_into_a_shared_partly_filled_block_copies_it(sub, rng):
    """the first writer copies the shared last block; the last sharer writes in place"""
    alloc = sub.BlockAllocator(10, 4)
    seqs = [alloc.new_sequence()]
    alloc.append(seqs[0], 6)                         # block 0 full, block 1 holds 2 rows
    shared = alloc.block_table(seqs[0])
    seqs += [alloc.fork(seqs[0]), alloc.fork(seqs[0])]
    for i, seq in enumerate(seqs):
        copies = checked_append(alloc, seqs, seq, 1, 10, 4,
                                f"3 sequences share {shared}; sequence {i} writes first"
                                if i == 0 else f"sequence {i} writes")
        if i < 2:
            assert copies and alloc.block_table(seq)[0] == shared[0], (
                f"sequence {i}: expected a copy of block {shared[1]} and block {shared[0]} "
                f"still shared, got copies {copies} and table {alloc.block_table(seq)}")
        else:
            assert alloc.block_table(seq) == shared, (
                f"the last sharer holds block {shared[1]} alone by now: it writes in place, "
                f"table {shared}; got {alloc.block_table(seq)}")
        check_invariants(alloc, seqs, 10, 4, f"after sequence {i}'s write")
    assert alloc.ref_count(shared[0]) == 3 and alloc.ref_count(shared[1]) == 1
    assert alloc.num_free_blocks() == 10 - 4, (
        f"2 shared-prompt blocks + 2 copies are used: expected 6 free, got "
        f"{alloc.num_free_blocks()}")


@points(1)
def test_a_full_shared_block_is_not_copied(sub, rng):
    """after a fork at a block edge, both sequences take new blocks and copy nothing"""
    alloc = sub.BlockAllocator(6, 4)
    parent = alloc.new_sequence()
    alloc.append(parent, 8)
    child = alloc.fork(parent)
    for seq in (parent, child, parent):
        checked_append(alloc, [parent, child], seq, 1, 6, 4,
                       "a fork of 8 tokens in blocks of 4")
    parent_table, child_table = alloc.block_table(parent), alloc.block_table(child)
    assert parent_table[:2] == child_table[:2] and parent_table[2] != child_table[2], (
        f"the two full blocks stay shared and each sequence gets a block of its own: got "
        f"parent {parent_table}, child {child_table}")
    assert alloc.num_free_blocks() == 2, (
        f"2 shared blocks + one new block each: expected 2 free of 6, got "
        f"{alloc.num_free_blocks()}")
    check_invariants(alloc, [parent, child], 6, 4, "after both wrote")


@points(2)
def test_freeing_the_parent_keeps_the_childs_blocks(sub, rng):
    """free drops one reference; only blocks nobody holds become free"""
    alloc = sub.BlockAllocator(8, 4)
    parent = alloc.new_sequence()
    alloc.append(parent, 7)
    child = alloc.fork(parent)
    alloc.append(child, 3)                           # copies block 1, then one new block
    parent_table, child_table = alloc.block_table(parent), alloc.block_table(child)
    free = alloc.num_free_blocks()
    alloc.free(parent)
    own = [b for b in parent_table if b not in child_table]
    assert alloc.num_free_blocks() == free + len(own), (
        f"freeing the parent (table {parent_table}) returns only the blocks the child "
        f"(table {child_table}) does not hold, {own}: expected {free + len(own)} free, got "
        f"{alloc.num_free_blocks()}")
    assert alloc.block_table(child) == child_table and alloc.length(child) == 10
    for b in child_table:
        assert alloc.ref_count(b) == 1, (
            f"block {b} of the child: expected ref count 1 after the parent is freed, got "
            f"{alloc.ref_count(b)}")
    check_invariants(alloc, [child], 8, 4, "after freeing the parent")
    # the child's blocks must not be handed out again while it holds them
    other = alloc.new_sequence()
    checked_append(alloc, [child, other], other, 4 * alloc.num_free_blocks(), 8, 4,
                   "a new sequence takes every free block")
    assert not set(alloc.block_table(other)) & set(child_table), (
        f"the new sequence got {alloc.block_table(other)}, which overlaps the child's "
        f"{child_table}")
    alloc.free(child)
    alloc.free(other)
    assert alloc.num_free_blocks() == 8, f"all freed: expected 8 free, got {alloc.num_free_blocks()}"
    check_invariants(alloc, [], 8, 4, "after freeing everything")


@points(2)
def test_out_of_blocks_changes_nothing(sub, rng):
    """OutOfBlocks leaves every table, length and count as it was (a copy counts too)"""
    alloc = sub.BlockAllocator(6, 2)
    a = alloc.new_sequence()
    alloc.append(a, 3)                               # a full block and a partly filled one
    b = alloc.fork(a)                                # b shares the partly filled block
    seqs = [a, b]
    assert alloc.num_free_blocks() == 4, (
        f"a holds 2 blocks and b shares them: expected 4 of 6 free, got {alloc.num_free_blocks()}")
    before = state(alloc, seqs, 6)
    # b needs a copy and 4 new blocks: 5 > 4 free
    with raises("OutOfBlocks", "append(b, 8) needs a copy and 4 new blocks, 4 are free"):
        alloc.append(b, 8)
    assert state(alloc, seqs, 6) == before, (
        f"append(b, 8) ran out of blocks (a copy + 4 new > 4 free) and must change nothing:\n"
        f"  before {before}\n  after  {state(alloc, seqs, 6)}")
    # exactly enough: a copy + 3 new blocks
    copies = checked_append(alloc, seqs, b, 6, 6, 2, "then append(b, 6)")
    assert copies is not None, "append(b, 6) needs a copy + 3 new blocks, the 4 free: it must succeed"
    assert alloc.num_free_blocks() == 0
    # a holds its partly filled block alone now: one token fits, the next needs a block
    checked_append(alloc, seqs, a, 1, 6, 2, "then append(a, 1)")
    before = state(alloc, seqs, 6)
    with raises("OutOfBlocks", "append(a, 1) needs a new block, none is free"):
        alloc.append(a, 1)
    assert state(alloc, seqs, 6) == before, (
        f"append(a, 1) with no free block must change nothing:\n  before {before}\n"
        f"  after  {state(alloc, seqs, 6)}")
    check_invariants(alloc, seqs, 6, 2, "after running out")


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


@points(2)
def test_three_samples_decoded_by_the_bundled_model(sub, rng):
    """n=3 samples of one prompt, decoded by the model in a pool: same books as yours"""
    model = bundled_model()
    num_blocks, block_size = 9, 4
    pool = model.new_paged_pool(num_blocks=num_blocks, block_size=block_size)
    alloc = sub.BlockAllocator(num_blocks, block_size)
    prompt = model.encode("ROMEO:\n")                # 7 tokens: a full block and 3 rows
    first = alloc.new_sequence()
    handles = [pool.new_sequence()]
    model.prefill(prompt, handles[0])
    alloc.append(first, len(prompt))
    seqs = [first, alloc.fork(first), alloc.fork(first)]
    handles += [pool.fork(handles[0]), pool.fork(handles[0])]
    log = []
    for t in range(12):
        if t == 8:                                   # sample 0 is done: its blocks go back
            alloc.free(seqs.pop(0))
            pool.free(handles.pop(0))
        for i, (seq, handle) in enumerate(zip(seqs, handles)):
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
            where = (f"decode step {t}, sample {i} (a prompt of 7 tokens forked into 3, "
                     f"{num_blocks} blocks of {block_size})")
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
