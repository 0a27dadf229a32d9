"""Public self-checks for lab 7 (prefix caching): `kvlab check prefix_caching prefix_caching.py`.

One rule each, on tiny pools you can follow by hand. The grade comes from hidden tests:
fixed scenarios for every rule and random request streams compared, operation by
operation, with kvlab's C pool.
"""
from kvlab.grading.testkit import described, points


@points(1)
def test_block_hash_chains_through_the_parent(sub, rng):
    """[1, 2] first and [1, 2] after [0, 0] hash differently; the same arguments, the same hash"""
    first = sub.block_hash(None, [1, 2])
    assert sub.block_hash(None, [1, 2]) == first, (
        "block_hash(None, [1, 2]) gave two different values")
    after = sub.block_hash(sub.block_hash(None, [0, 0]), [1, 2])
    assert after != first, (f"[1, 2] after [0, 0] must not hash like [1, 2] at the start: "
                            f"both gave {described(first)}")


@points(1)
def test_a_repeated_prompt_reuses_its_full_blocks(sub, rng):
    """blocks of 2, prompt [1, 2, 3, 4, 5] twice: 0 tokens reused, then 4"""
    cache = sub.PrefixCache(6, 2)
    assert cache.admit(0, [1, 2, 3, 4, 5]) == 0, "nothing is cached yet: 0 tokens reused"
    stats = cache.stats()
    want = {"prefix_hits": 0, "prefix_misses": 2, "blocks_used": 3, "blocks_cached": 0,
            "blocks_free": 3}
    assert stats == want, f"after the first admit: expected {want}, got {described(stats)}"
    cache.free(0)
    stats = cache.stats()
    assert (stats["blocks_cached"], stats["blocks_free"]) == (2, 4), (
        f"after free: the 2 full blocks are cached, the last one (token 5) is free: expected "
        f"2 cached and 4 free, got {stats['blocks_cached']} and {stats['blocks_free']}")
    got = cache.admit(1, [1, 2, 3, 4, 5])
    assert got == 4, (f"the same prompt again: its 2 full blocks are hits, 4 tokens reused; "
                      f"got {described(got)}")
    hits = cache.stats()["prefix_hits"]
    assert hits == 2, f"expected 2 hits, got {described(hits)}"


@points(1)
def test_eviction_takes_the_least_recently_used_block(sub, rng):
    """4 blocks of 2: the block used least recently is the one evicted"""
    cache = sub.PrefixCache(4, 2)
    cache.admit("a", [1, 2, 9])                 # [1, 2] full, [9] partly filled
    a0 = cache.block_table("a")[0]
    cache.free("a")
    cache.admit("b", [3, 4, 9])
    b0 = cache.block_table("b")[0]
    cache.free("b")
    cached = cache.cached_blocks()
    assert cached == [a0, b0], (f"a's block {a0}, then b's {b0}, least recently used first; "
                                f"got {described(cached)}")
    cache.admit("c", [1, 2, 5])                 # a hit on [1, 2]: used again ...
    cache.free("c")                             # ... and now the most recently used
    cached = cache.cached_blocks()
    assert cached == [b0, a0], (f"[1, 2] was used last: expected [{b0}, {a0}], got "
                                f"{described(cached)}")
    cache.admit("d", [6, 7, 8, 8, 8])           # 3 blocks: 2 free, then b's block is evicted
    cached = cache.cached_blocks()
    assert cached == [a0], (f"b's block {b0} is evicted, {a0} stays cached: expected [{a0}], "
                            f"got {described(cached)}")


@points(1)
def test_a_block_filled_twice_is_kept_once(sub, rng):
    """blocks of 2: two requests decode [1] then [2] side by side: both hold one block"""
    cache = sub.PrefixCache(4, 2)
    cache.admit("a", [1])
    cache.admit("b", [1])
    cache.append("a", [2])
    cache.append("b", [2])           # b's block fills as a's did: b takes a's, lets go of its own
    assert cache.block_table("a") == cache.block_table("b"), (
        f"both sequences hold [1, 2] after no prefix: one block, shared; the tables are "
        f"{described(cache.block_table('a'))} and {described(cache.block_table('b'))}")
    stats = cache.stats()
    want = {"blocks_used": 1, "blocks_cached": 0, "blocks_free": 3}
    got = {key: stats.get(key) for key in want}
    assert got == want, f"expected {want}, got {described(got)}"
