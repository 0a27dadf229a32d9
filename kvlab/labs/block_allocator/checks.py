"""Public self-checks for lab 5 (block allocator): `kvlab check block_allocator block_allocator.py`.

One rule each, on tiny pools. The grade comes from hidden tests: fixed scenarios for every
rule and random runs of operations compared, step by step, with kvlab's C pool.
"""
from kvlab.grading.testkit import described, points, raises


@points(1)
def test_a_sequence_takes_a_block_every_block_size_tokens(sub, rng):
    """blocks of 4: 1 token takes a block, 4 tokens still one, 5 tokens two"""
    alloc = sub.BlockAllocator(4, 4)
    seq = alloc.new_sequence()
    for n_tokens, blocks in ((1, 1), (3, 1), (1, 2)):
        alloc.append(seq, n_tokens)
        table = alloc.block_table(seq)
        assert len(table) == blocks, (f"after {alloc.length(seq)} tokens in blocks of 4: expected "
                                      f"{blocks} block(s), got table {described(table)}")
    assert alloc.num_free_blocks() == 2, f"2 of 4 blocks used: expected 2 free, got {alloc.num_free_blocks()!r}"


@points(1)
def test_fork_shares_blocks(sub, rng):
    """fork: the child has the parent's table, each block's ref count is 2, nothing is taken"""
    alloc = sub.BlockAllocator(4, 2)
    parent = alloc.new_sequence()
    alloc.append(parent, 3)
    child = alloc.fork(parent)
    table = alloc.block_table(parent)
    assert alloc.block_table(child) == table, f"the child's table should be {table}"
    refs = [alloc.ref_count(b) for b in table]
    assert refs == [2, 2], f"each shared block is held twice: expected [2, 2], got {refs}"
    assert alloc.num_free_blocks() == 2, f"fork takes no block: expected 2 free, got {alloc.num_free_blocks()!r}"


@points(1)
def test_running_out_changes_nothing(sub, rng):
    """an append that needs more blocks than are free raises OutOfBlocks and changes nothing"""
    alloc = sub.BlockAllocator(2, 2)
    seq = alloc.new_sequence()
    alloc.append(seq, 3)
    with raises("OutOfBlocks", "append(seq, 2) needs a third block of 2"):
        alloc.append(seq, 2)
    assert alloc.length(seq) == 3 and len(alloc.block_table(seq)) == 2, (
        "a refused append must leave the length (3) and the table (2 blocks) as they were")
