"""Hidden grading tests for lab 6 (attention through a block table). Each test says in its
message what it expected. Run by the judge (kvlab/grading/judge.py), never shipped in the
package.

Pools are made here, of random rows or filled by the bundled model through kvlab's own
PagedPool, with tables shuffled across the pool, lengths that leave the last block partly
filled (its other rows hold stale values, as a reused block does) and sequences that share
their first blocks (a fork). Attention is compared with the C core's cache.attend over the
same rows laid out contiguously.
"""
import functools

import numpy as np

from kvlab.grading.testkit import as_array, c_attend, bundled_model, check_close, described, points, whole_number

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east!"
# 73 tokens, then 21 more (94): neither fills its last block of 4 or 5 rows
FILLER = ("MERCUTIO:\nNay, gentle Romeo, we must have you dance. I dreamt a dream to-night. "
          "O, then, I see Queen Mab hath been with you. She is the fairies' midwife, and she "
          "comes in shape no bigger than an agate-stone on the fore-finger of an alderman. ") * 2


def random_pool(rng, n_kv_heads, head_dim, block_size, length, spare=3):
    """(key_blocks, value_blocks, table, keys, values): a pool of random rows (stale ones
    too) and a shuffled table holding the sequence's `length` positions."""
    n_blocks = -(-length // block_size)
    num_blocks = n_blocks + spare
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    key_blocks = rng.standard_normal(shape).astype(np.float32) * np.float32(3)   # stale rows: loud
    value_blocks = rng.standard_normal(shape).astype(np.float32) * np.float32(3)
    table = [int(b) for b in rng.permutation(num_blocks)[:n_blocks]]
    if n_blocks > 1 and table == sorted(table):
        table.reverse()                                  # never the pool's own order
    positions = np.arange(length)
    keys = key_blocks[np.array(table)[positions // block_size], positions % block_size]
    values = value_blocks[np.array(table)[positions // block_size], positions % block_size]
    return key_blocks, value_blocks, table, keys, values


def shapes(rng):
    n_kv, mul = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    return {"MHA": (n_kv, n_kv), "GQA": (n_kv * mul, n_kv), "MQA": (int(rng.integers(2, 6)), 1)}


@functools.lru_cache(maxsize=None)
def model_pool(block_size):
    """The bundled model's K and V for PROMPT, in a kvlab PagedPool of blocks of
    block_size, a second sequence forked from it and decoded on, and a contiguous cache."""
    model = bundled_model()
    tokens = model.encode(PROMPT)
    pool = model.new_paged_pool(num_blocks=64, block_size=block_size)
    # other sequences come and go first, so that this one's blocks are scattered over the pool
    # and their spare rows hold stale keys: a filler takes every block left, so that the
    # blocks PROMPT and its fork take are all reused ones (their last blocks included)
    others = [pool.new_sequence() for _ in range(3)]
    for i, other in enumerate(others):
        model.prefill(model.encode("JULIET:\nO Romeo, Romeo! " * (i + 1)), other)
    filler = pool.new_sequence()
    model.prefill(model.encode(FILLER)[:pool.stats().blocks_free * block_size], filler)
    pool.free(others[2])
    pool.free(filler)
    pool.free(others[0])
    first = pool.new_sequence()
    model.prefill(tokens, first)
    second = pool.fork(first)
    extra = model.encode(" and Juliet is the sun")[:21]
    for token in extra:
        model.decode(int(token), second)
    contiguous = model.new_cache(128)
    model.prefill(list(tokens) + list(extra), contiguous)
    return pool, first, second, contiguous


def prepare():
    for block_size in (4, 5):
        model_pool(block_size)


@points(1)
def test_blocks_needed_and_unused_rows(sub, rng):
    """ceil(length / block_size) blocks, and the rows of the last block left empty"""
    for i in range(12):
        length, block_size = int(rng.integers(1, 500)), int(rng.choice([1, 2, 3, 8, 16, 32]))
        if i % 3 == 0:                          # lengths that fill their last block exactly
            length = block_size * int(rng.integers(1, 500 // block_size + 1))
        got = whole_number(sub.blocks_needed(length, block_size), "blocks_needed")
        want = -(-length // block_size)
        assert got == want, f"{length} positions in blocks of {block_size}: expected {want} blocks, got {got}"
        got = whole_number(sub.unused_rows(length, block_size), "unused_rows")
        assert got == want * block_size - length, (
            f"{length} positions in {want} blocks of {block_size}: expected "
            f"{want * block_size - length} unused rows, got {got}")


@points(1)
def test_slot(sub, rng):
    """position p is in block table[p // block_size], row p % block_size"""
    block_size = int(rng.integers(2, 9))
    table = [int(b) for b in rng.permutation(40)[:10]]
    for position in rng.integers(0, 10 * block_size, 15):
        got = sub.slot(int(position), table, block_size)
        want = (table[position // block_size], int(position % block_size))
        assert isinstance(got, (tuple, list)) and [int(x) for x in got] == list(want), (
            f"table {table}, blocks of {block_size}: position {position} is in block {want[0]}, "
            f"row {want[1]}; got {described(got)}")


@points(2)
def test_gather_reads_through_a_shuffled_table(sub, rng):
    """gather: the sequence's rows in position order, stale rows of the last block left out"""
    for length, block_size in ((int(rng.integers(10, 40)), int(rng.integers(3, 8))), (1, 4), (16, 16)):
        key_blocks, _, table, keys, _ = random_pool(rng, 2, 8, block_size, length)
        got = as_array(sub.gather(key_blocks, table, length), "gather", shape=keys.shape)
        assert np.array_equal(got, keys), (
            f"{length} positions in blocks of {block_size} under table {table}: gather must "
            f"return the rows of positions 0..{length - 1} in order (block table[p // "
            f"{block_size}], row p % {block_size}), and nothing past them")


@points(3)
def test_paged_attention_matches_contiguous_attention(sub, rng):
    """paged_attend over shuffled tables, as cache.attend over the same rows laid out in order"""
    for kind, (n_heads, n_kv_heads) in shapes(rng).items():
        head_dim = int(rng.choice([8, 16]))
        for block_size in (int(rng.integers(2, 6)), 16):
            length = int(rng.integers(block_size + 1, 60))
            key_blocks, value_blocks, table, keys, values = random_pool(rng, n_kv_heads, head_dim,
                                                                         block_size, length)
            q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
            got = sub.paged_attend(q, key_blocks, value_blocks, table, length)
            check_close(got, c_attend(q, keys, values),
                        f"{kind}, {length} positions in blocks of {block_size}, table {table}")


@points(2)
def test_the_last_block_is_read_only_up_to_the_length(sub, rng):
    """lengths 1 past a block's end and 1 short of it: stale rows must not count, the rest must"""
    # Compared with the student's own attention over the same rows in blocks of 1, where no
    # row is stale: the attention itself (its scale, its heads) is the other tests' concern,
    # so a mistake there fails them, not this one. Every row in the length must count (an
    # output that reads only the last row would match itself in blocks of 1 too).
    n_heads, n_kv_heads = shapes(rng)["GQA"]
    block_size = int(rng.integers(4, 9))
    for length in (block_size + 1, 2 * block_size - 1, 1):
        key_blocks, value_blocks, table, keys, values = random_pool(rng, n_kv_heads, 8, block_size, length)
        q = rng.standard_normal((n_heads, 8)).astype(np.float32)
        held = length - (-(-length // block_size) - 1) * block_size
        what = (f"{length} positions in blocks of {block_size}, table {table}: the last block "
                f"holds {held} of them, its other {block_size - held} rows are stale")
        got = as_array(sub.paged_attend(q, key_blocks, value_blocks, table, length), what,
                       shape=(n_heads, 8))
        alone = sub.paged_attend(q, keys[:, None], values[:, None], list(range(length)), length)
        try:
            check_close(got, as_array(alone, what, shape=(n_heads, 8)), what)
        except AssertionError as error:
            raise AssertionError(
                f"{error}; 'expected' is your own paged_attend over the same {length} rows in "
                f"blocks of 1, where no row is stale: rows past the length must not count") from None
        changed_keys, changed_values = key_blocks.copy(), value_blocks.copy()
        last = (table[(length - 1) // block_size], (length - 1) % block_size)
        changed_keys[last] += np.float32(2)
        changed_values[last] += np.float32(5)
        again = as_array(sub.paged_attend(q, changed_keys, changed_values, table, length), what,
                         shape=(n_heads, 8))
        assert not np.allclose(again, got, rtol=1e-5, atol=1e-5), (
            f"{what}: the row of position {length - 1} (block {last[0]}, row {last[1]}) changed, "
            f"and your output did not: every position up to the length must count")
        # and every other position counts too (a gentle query: no row's weight is tiny)
        gentle = q * np.float32(0.1)
        before = as_array(sub.paged_attend(gentle, key_blocks, value_blocks, table, length), what,
                          shape=(n_heads, 8))
        for position in range(length - 1):
            block, row = table[position // block_size], position % block_size
            changed_values = value_blocks.copy()
            changed_values[block, row] += np.float32(5)
            again = as_array(sub.paged_attend(gentle, key_blocks, changed_values, table, length),
                             what, shape=(n_heads, 8))
            assert not np.allclose(again, before, rtol=1e-5, atol=1e-5), (
                f"{what}: the value of position {position} (block {block}, row {row}) changed, "
                f"and your output did not: every position up to the length must count")


def check_every_layer(sub, rng, pool, handle, contiguous, what):
    """paged_attend over the pool's layers, through the handle's table, as the contiguous cache attends."""
    c = bundled_model().config
    table, length = handle.block_table.tolist(), handle.length
    last, held = table[(length - 1) // pool.block_size], (length - 1) % pool.block_size + 1
    assert np.all(np.abs(pool.key_codes[last, :, held:]).max(axis=(2, 3)) > 0), (
        "the last block's unused rows should hold stale keys (the grader's own setup)")
    for layer in range(c.n_layers):
        q = (rng.standard_normal((c.n_heads, c.head_dim)) * 2).astype(np.float32)
        got = sub.paged_attend(q, pool.key_codes[:, layer], pool.value_codes[:, layer], table, length)
        check_close(got, contiguous.attend(q, layer),
                    f"layer {layer} of a pool of blocks of {pool.block_size} (pool.key_codes[:, "
                    f"{layer}]), {what}, table {table}, {length} positions (8 query heads on 2 KV "
                    f"heads; the last block, {last}, holds {held} of them, its other rows are "
                    f"stale)")


@points(3)
def test_a_pool_the_bundled_model_filled(sub, rng):
    """a kvlab PagedPool after a prompt: every layer, as the model's contiguous cache attends"""
    model = bundled_model()
    pool, first, _, _ = model_pool(int(rng.choice([4, 5])))
    table = first.block_table.tolist()
    assert table != sorted(table) or table[0] != 0, "the grader's pool should scatter the blocks"
    contiguous = model.new_cache(128)
    model.prefill(model.encode(PROMPT), contiguous)
    check_every_layer(sub, rng, pool, first, contiguous, "the prompt")


@points(2)
def test_a_forked_sequence_reads_its_shared_blocks(sub, rng):
    """a fork shares the prompt's full blocks, then writes its own: its attention as a contiguous run's"""
    pool, first, second, contiguous = model_pool(int(rng.choice([4, 5])))
    shared = [b for b in second.block_table.tolist() if b in first.block_table.tolist()]
    assert shared, "the fork should share blocks with its parent (the grader's own setup)"
    check_every_layer(sub, rng, pool, second, contiguous,
                      f"a sequence forked after the prompt (blocks {shared} shared with its parent)")
