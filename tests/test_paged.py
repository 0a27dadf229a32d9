"""The paged pool (kvlab.PagedPool): allocator, copy-on-write, prefix cache, errors,
views and pictures, and the paged forward pass against the contiguous cache.

The heart of the file is a Hypothesis state machine that drives a small pool through long
random runs of new / append / fork / free / reuse_prefix and, after every step, compares
it with two independent models written here in plain Python:

  * what every live sequence must hold: its tokens, and for every position K and V rows
    that are a deterministic function of the token prefix up to that position (as in a
    real model), so a prefix-cache hit that hands out the wrong block shows up in gather();
  * the allocator as documented: a free stack ("next to be used last"), an LRU list of
    cached blocks (least recently used first), ref counts, copy-on-write of a shared
    partial block, and an exact prefix index keyed by (parent block, its generation,
    tokens), so block tables, free/cached lists and the reused length are predicted
    exactly.
"""
from __future__ import annotations

import gc
import hashlib
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import kvlab

VOCAB = 4  # tiny, so prefixes (and whole blocks) repeat all the time


# ---- K/V rows as a function of the token prefix ------------------------------------------

class PrefixRows:
    """K and V rows for a position, derived from every token up to and including it."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int):
        self.shape = (2, n_layers, n_kv_heads, head_dim)
        self.memo: dict = {}

    def row(self, prefix: tuple) -> np.ndarray:
        kv = self.memo.get(prefix)
        if kv is None:
            digest = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(),
                                     digest_size=8).digest()
            rng = np.random.default_rng(int.from_bytes(digest, "little"))
            kv = rng.standard_normal(self.shape).astype(np.float32)
            self.memo[prefix] = kv
        return kv

    def rows(self, tokens, start: int, stop: int):
        """keys, values for positions start..stop-1, each (n, n_layers, n_kv_heads, head_dim)."""
        tokens = tuple(tokens)
        stacked = np.stack([self.row(tokens[:pos + 1]) for pos in range(start, stop)])
        return np.ascontiguousarray(stacked[:, 0]), np.ascontiguousarray(stacked[:, 1])


# ---- the allocator as documented, in plain Python -----------------------------------------

class AllocatorModel:
    """Free stack, LRU list, ref counts, copy-on-write and an exact prefix index."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.n, self.bs = num_blocks, block_size
        self.max_seqs, self.max_bps = max_seqs, max_blocks_per_seq
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 on top (the end)
        self.lru: list = []                               # least recently used first
        self.ref = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.tokens = [[0] * block_size for _ in range(num_blocks)]
        self.index: dict = {}    # (parent, parent's generation, tokens) -> block
        self.key_of: dict = {}   # registered block -> its key
        self.tables: dict = {}   # slot -> [block ids]
        self.lengths: dict = {}
        self.hits = self.misses = 0

    # blocks
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b = self.lru.pop(0)
            del self.index[self.key_of.pop(b)]
        self.ref[b], self.fill[b] = 1, 0
        self.gen[b] += 1
        return b

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            (self.lru if b in self.key_of else self.free).append(b)

    def retain(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.remove(b)
        self.ref[b] += 1

    def key(self, parent: int, tokens) -> tuple:
        return (parent, self.gen[parent] if parent >= 0 else 0, tuple(tokens))

    def register(self, slot: int, i: int) -> None:
        """Block i of a sequence just became full: into the prefix index, or, if the index
        already knows an identical block, the sequence takes that one and frees its own."""
        table = self.tables[slot]
        b, parent = table[i], table[i - 1] if i > 0 else -1
        if parent >= 0 and parent not in self.key_of:
            return
        key = self.key(parent, self.tokens[b])
        twin = self.index.get(key)
        if twin is None:
            self.index[key] = b
            self.key_of[b] = key
        elif twin != b:
            self.retain(twin)
            table[i] = twin
            self.release(b)

    # sequences
    def new_slot(self):
        if len(self.tables) >= self.max_seqs:
            return None
        slot = min(set(range(self.max_seqs)) - set(self.tables))
        self.tables[slot], self.lengths[slot] = [], 0
        return slot

    def fork(self, slot: int):
        child = self.new_slot()
        if child is not None:
            self.tables[child] = list(self.tables[slot])
            self.lengths[child] = self.lengths[slot]
            for b in self.tables[child]:
                self.retain(b)
        return child

    def free_seq(self, slot: int) -> None:
        for b in reversed(self.tables.pop(slot)):
            self.release(b)
        del self.lengths[slot]

    def reuse(self, slot: int, tokens, max_tokens: int) -> int:
        table, bs = self.tables[slot], self.bs
        n_full = min(max_tokens // bs, self.max_bps)
        parent = -1
        for i in range(n_full):
            b = self.index.get(self.key(parent, tokens[i * bs:(i + 1) * bs]))
            if b is None:
                self.misses += n_full - i
                break
            self.hits += 1
            self.retain(b)
            table.append(b)
            parent = b
        self.lengths[slot] = len(table) * bs
        return self.lengths[slot]

    def append(self, slot: int, tokens):
        """None on success (applied), else the error the pool must raise (nothing applied)."""
        bs, table, length, n = self.bs, self.tables[slot], self.lengths[slot], len(tokens)
        partial = length % bs
        copy = partial > 0 and self.ref[table[-1]] > 1
        new = -(-(length + n) // bs) - len(table)
        if len(table) + new > self.max_bps:
            return kvlab.CacheFullError
        if new + copy > self.available():
            return kvlab.OutOfBlocks
        if copy:
            last, c = table[-1], self.take()
            self.tokens[c][:partial] = self.tokens[last][:partial]
            self.fill[c] = partial
            self.release(last)
            table[-1] = c
        for _ in range(new):
            table.append(self.take())
        for t, token in enumerate(tokens):
            pos = length + t
            b = table[pos // bs]
            self.tokens[b][pos % bs] = token
            self.fill[b] = max(self.fill[b], pos % bs + 1)
        self.lengths[slot] = length + n
        for i in range(length // bs, (length + n) // bs):
            self.register(slot, i)
        return None


# ---- snapshots: "the pool is exactly as before" ----------------------------------------------

def snapshot(pool, handles=()) -> dict:
    handles = list(handles) + list(pool.sequences())
    return {
        "key_codes": pool.key_codes.copy(), "value_codes": pool.value_codes.copy(),
        "ref_counts": pool.ref_counts.copy(),
        "fill": pool.fill.copy(), "block_tokens": pool.block_tokens.copy(),
        "free_blocks": pool.free_blocks, "cached_blocks": pool.cached_blocks,
        "stats": pool.stats(), "sequences": sorted(s.id for s in pool.sequences()),
        "tables": {h.id: h.block_table.copy() for h in handles if h.alive},
        "lengths": {h.id: h.length for h in handles if h.alive},
    }


def assert_unchanged(before: dict, pool, handles=()) -> None:
    after = snapshot(pool, handles)
    assert before.keys() == after.keys()
    for key in before:
        if key == "tables":
            assert before[key].keys() == after[key].keys()
            for slot in before[key]:
                assert np.array_equal(before[key][slot], after[key][slot]), f"table of {slot}"
        elif isinstance(before[key], np.ndarray):
            assert np.array_equal(before[key], after[key]), f"{key} changed"
        else:
            assert before[key] == after[key], f"{key} changed"


def as_i32(tokens) -> np.ndarray:
    return np.asarray(list(tokens), dtype=np.int32)


# ---- the state machine -------------------------------------------------------------------

class PagedPoolMachine(RuleBasedStateMachine):
    HASH_BITS = (64, 64, 2, 1)
    N_LAYERS, HEAD_DIM = 2, 2

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(8, 24),
                max_seqs=st.integers(2, 6), n_kv_heads=st.integers(1, 2),
                table_room=st.sampled_from([None, None, None, 2, 3, 5, 8]), data=st.data())
    def make_pool(self, block_size, num_blocks, max_seqs, n_kv_heads, table_room, data):
        hash_bits = data.draw(st.sampled_from(self.HASH_BITS), label="hash_bits")
        kwargs = {"max_seqs": max_seqs, "hash_bits": hash_bits}
        if table_room is not None:
            kwargs["max_blocks_per_seq"] = table_room
        self.pool = kvlab.PagedPool(self.N_LAYERS, n_kv_heads, self.HEAD_DIM, num_blocks,
                                    block_size, **kwargs)
        self.bs, self.num_blocks = block_size, num_blocks
        self.max_bps = table_room or num_blocks
        assert self.pool.max_blocks_per_seq == self.max_bps
        assert self.pool.key_codes.shape == (num_blocks, self.N_LAYERS, block_size, n_kv_heads,
                                             self.HEAD_DIM)
        assert self.pool.value_codes.shape == self.pool.key_codes.shape
        self.rows = PrefixRows(self.N_LAYERS, n_kv_heads, self.HEAD_DIM)
        self.model = AllocatorModel(num_blocks, block_size, max_seqs, self.max_bps)
        self.live: dict = {}      # slot -> [handle, tokens]
        self.history: list = []   # token lists of freed sequences, newest last
        self.stale: list = []     # handles of freed sequences
        self.new_sequence()

    # helpers
    def handles(self):
        return [h for h, _ in self.live.values()]

    def do_append(self, slot: int, tokens) -> bool:
        handle, have = self.live[slot]
        keys, values = self.rows.rows(have + list(tokens), len(have), len(have) + len(tokens))
        before = snapshot(self.pool, self.handles())
        expected_error = self.model.append(slot, list(tokens))
        try:
            self.pool.append(handle, as_i32(tokens), keys, values)
        except (kvlab.OutOfBlocks, kvlab.CacheFullError) as error:
            assert type(error) is expected_error, f"raised {error!r}, expected {expected_error}"
            assert_unchanged(before, self.pool, self.handles())
            return False
        assert expected_error is None, f"append succeeded, expected {expected_error.__name__}"
        have.extend(tokens)
        return True

    def pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.live)), label="slot")

    # rules
    @rule()
    def new_sequence(self):
        if len(self.live) >= self.model.max_seqs:
            before = snapshot(self.pool, self.handles())
            with pytest.raises(kvlab.OutOfSequences):
                self.pool.new_sequence()
            assert_unchanged(before, self.pool, self.handles())
            return
        handle = self.pool.new_sequence()
        slot = self.model.new_slot()
        assert handle.id == slot and handle.length == 0 and handle.alive
        self.live[slot] = [handle, []]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=18))
    def append(self, data, tokens):
        self.do_append(self.pick(data), tokens[:4 * self.bs + 2])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append_one(self, data, token):
        self.do_append(self.pick(data), [token])

    def do_fork(self, slot: int):
        """Fork slot; the child's slot, or None when the pool holds max_seqs sequences."""
        handle, tokens = self.live[slot]
        if len(self.live) >= self.model.max_seqs:
            before = snapshot(self.pool, self.handles())
            with pytest.raises(kvlab.OutOfSequences):
                self.pool.fork(handle)
            assert_unchanged(before, self.pool, self.handles())
            return None
        keys_before, values_before = self.pool.key_codes.copy(), self.pool.value_codes.copy()
        child = self.pool.fork(handle)
        assert np.array_equal(self.pool.key_codes, keys_before), "fork copied K"
        assert np.array_equal(self.pool.value_codes, values_before), "fork copied V"
        child_slot = self.model.fork(slot)
        assert child.id == child_slot and child.length == handle.length
        assert np.array_equal(child.block_table, handle.block_table)
        self.live[child_slot] = [child, list(tokens)]
        return child_slot

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        self.do_fork(self.pick(data))

    @precondition(lambda self: self.live and len(self.live) < self.model.max_seqs)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
          child_writes=st.booleans())
    def fork_and_write(self, data, tokens, child_writes):
        """Fork, then write at once into the (often partial, so shared) last block."""
        parent = self.pick(data)
        child = self.do_fork(parent)
        self.do_append(child if child_writes else parent, tokens[:2 * self.bs + 1])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        slot = self.pick(data)
        handle, tokens = self.live.pop(slot)
        self.pool.free(handle)
        self.model.free_seq(slot)
        assert not handle.alive
        self.history = (self.history + [tokens])[-12:]
        self.stale = (self.stale + [handle])[-4:]

    @precondition(lambda self: len(self.live) < self.model.max_seqs)
    @rule(data=st.data(),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=8),
          limit=st.one_of(st.none(), st.integers(0, 40)))
    def reuse_prefix(self, data, suffix, limit):
        sources = self.history + [tokens for _, tokens in self.live.values()]
        source = data.draw(st.sampled_from(sources), label="source") if sources else []
        cut = data.draw(st.integers(0, len(source)), label="cut")
        prompt = list(source[:cut]) + suffix
        handle = self.pool.new_sequence()
        slot = self.model.new_slot()
        assert handle.id == slot
        self.live[slot] = [handle, []]
        hits, misses = self.pool.stats().prefix_hits, self.pool.stats().prefix_misses
        if limit is None:
            reused = self.pool.reuse_prefix(handle, as_i32(prompt))
            max_tokens = len(prompt)
        else:
            max_tokens = min(limit, len(prompt))
            reused = self.pool.reuse_prefix(handle, as_i32(prompt), max_tokens)
        expected = self.model.reuse(slot, prompt, max_tokens)
        assert reused == expected, f"reused {reused} tokens, the allocator model says {expected}"
        assert reused % self.bs == 0 and reused <= max_tokens and handle.length == reused
        stats = self.pool.stats()
        assert stats.prefix_hits - hits == reused // self.bs
        assert stats.prefix_hits + stats.prefix_misses - hits - misses == \
            min(max_tokens // self.bs, self.max_bps)
        self.live[slot][1] = prompt[:reused]
        if reused < len(prompt):
            self.do_append(slot, prompt[reused:])

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def freed_handles_are_refused(self, data):
        handle = data.draw(st.sampled_from(self.stale), label="stale")
        before = snapshot(self.pool, self.handles())
        keys, values = self.rows.rows([0], 0, 1)
        assert not handle.alive and "freed" in repr(handle)
        for action in (lambda: handle.length, lambda: handle.block_table,
                       lambda: self.pool.append(handle, as_i32([0]), keys, values),
                       lambda: self.pool.fork(handle), lambda: self.pool.free(handle),
                       lambda: self.pool.gather(handle),
                       lambda: self.pool.reuse_prefix(handle, as_i32([0, 1, 2, 3]))):
            with pytest.raises(ValueError):
                action()
        assert_unchanged(before, self.pool, self.handles())

    @precondition(lambda self: any(tokens for _, tokens in self.live.values()))
    @rule(data=st.data())
    def reuse_prefix_needs_an_empty_sequence(self, data):
        slot = data.draw(st.sampled_from(sorted(s for s, (_, t) in self.live.items() if t)))
        handle, tokens = self.live[slot]
        before = snapshot(self.pool, self.handles())
        with pytest.raises(ValueError, match="empty"):
            self.pool.reuse_prefix(handle, as_i32(tokens))
        assert_unchanged(before, self.pool, self.handles())

    # after every step
    @invariant()
    def pool_matches_both_models(self):
        pool, model, bs, n = self.pool, self.model, self.bs, self.num_blocks
        pool.check()
        stats = pool.stats()
        refs, fill, block_tokens = pool.ref_counts, pool.fill, pool.block_tokens
        tables = {slot: handle.block_table for slot, (handle, _) in self.live.items()}

        # bookkeeping, independent of the allocator model
        counts = np.zeros(n, dtype=np.int64)
        rows_read = np.zeros(n, dtype=np.int64)
        for slot, table in tables.items():
            length = len(self.live[slot][1])
            assert len(table) == -(-length // bs)
            np.add.at(counts, table, 1)
            for i, b in enumerate(table):
                rows_read[b] = max(rows_read[b], min(bs, length - i * bs))
        assert np.array_equal(refs, counts), "ref_counts != block-table entries per block"
        used = set(np.flatnonzero(counts).tolist())
        free, cached = pool.free_blocks, pool.cached_blocks
        assert stats.blocks_used == len(used)
        assert stats.blocks_used + stats.blocks_free + stats.blocks_cached == n
        assert stats.tokens_stored + stats.slots_unused == stats.blocks_used * bs
        assert stats.slots_allocated == stats.blocks_used * bs
        assert stats.tokens_stored == sum(int(fill[b]) for b in used)
        assert stats.n_sequences == len(self.live)
        assert len(free) == stats.blocks_free and len(cached) == stats.blocks_cached
        assert len(set(free) | set(cached) | used) == n, "a block is lost or in two places"
        assert all(fill[b] == rows_read[b] for b in used), "fill != rows the tables read"
        assert all(fill[b] == bs for b in cached), "a cached block is not full"
        assert sorted(s.id for s in pool.sequences()) == sorted(self.live)
        expected_frag = 100.0 * stats.slots_unused / (stats.blocks_used * bs) if used else 0.0
        assert stats.fragmentation_percent == pytest.approx(expected_frag)

        # the allocator model: exact free stack, LRU order, ref counts, tables, prefix stats
        assert free == model.free, "free stack differs from the model"
        assert cached == model.lru, "LRU order differs from the model"
        assert refs.tolist() == model.ref
        assert fill.tolist() == model.fill
        assert block_tokens.tolist() == model.tokens
        for slot, table in tables.items():
            assert table.tolist() == model.tables[slot], f"block table of sequence {slot}"
        assert (stats.prefix_hits, stats.prefix_misses) == (model.hits, model.misses)

        # content: gather() and the documented layout both give the prefix-determined rows
        key_codes, value_codes = pool.key_codes, pool.value_codes
        for slot, (handle, tokens) in self.live.items():
            length = len(tokens)
            assert handle.length == length
            keys, values = pool.gather(handle)
            assert keys.shape == values.shape == (self.N_LAYERS, length) + key_codes.shape[3:]
            if length == 0:
                continue
            want_k, want_v = self.rows.rows(tokens, 0, length)
            assert np.array_equal(keys, want_k.transpose(1, 0, 2, 3)), f"keys of {slot}"
            assert np.array_equal(values, want_v.transpose(1, 0, 2, 3)), f"values of {slot}"
            pos = np.arange(length)
            blocks, rows = tables[slot][pos // bs], pos % bs
            assert np.array_equal(key_codes[blocks, :, rows], want_k)
            assert np.array_equal(value_codes[blocks, :, rows], want_v)
            assert block_tokens[blocks, rows].tolist() == tokens


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                            database=None, print_blob=True,
                            suppress_health_check=[HealthCheck.too_slow])
PagedPoolMachine.TestCase.settings = MACHINE_SETTINGS
TestPagedPoolMachine = PagedPoolMachine.TestCase


class CollidingPoolMachine(PagedPoolMachine):
    """Every hash collides (hash_bits=1): the prefix cache must still never hand out wrong
    K/V; all of the checking above runs unchanged."""
    HASH_BITS = (1,)


CollidingPoolMachine.TestCase.settings = settings(MACHINE_SETTINGS, max_examples=100)
TestCollidingPoolMachine = CollidingPoolMachine.TestCase


# ---- paged vs contiguous with a model ------------------------------------------------------

def make_model(n_heads=4, n_kv_heads=2, head_dim=8, dim=32, layers=2, vocab=40,
               max_seq_len=96, seed=0, tied=True, interleaved=True) -> kvlab.Model:
    config = kvlab.ModelConfig(dim=dim, hidden_dim=dim + 12, n_layers=layers, n_heads=n_heads,
                               n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=vocab,
                               max_seq_len=max_seq_len, tied_embeddings=tied,
                               rope_interleaved=interleaved)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=seed))


MODELS = {  # name: keyword arguments of make_model
    "gqa": dict(n_heads=8, n_kv_heads=2, head_dim=8, dim=48, tied=False, interleaved=False),
    "mqa": dict(n_heads=6, n_kv_heads=1, head_dim=10, dim=40),
}
BLOCK_SIZES = (1, 3, 16, 64)


def assert_bit_identical(got, want, what: str) -> None:
    """The core claims paged == contiguous bit for bit; say how far off it is if not."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if np.array_equal(got, want):
        return
    diff = float(np.max(np.abs(got.astype(np.float64) - want)))
    pytest.fail(f"{what}: paged and contiguous differ by up to {diff:.3g} "
                f"({'within' if diff <= 1e-6 else 'NOT within'} 1e-6); they should be "
                f"bit-identical")


def pool_for(model, block_size: int, tokens: int, spare: int = 2, **kwargs):
    return model.new_paged_pool(num_blocks=-(-tokens // block_size) + spare,
                                block_size=block_size, **kwargs)


def paged_vs_contiguous(model, prompt, n_decode: int, block_size: int, chunks=None):
    """Prefill (in chunks if given) and greedy-decode on both caches; compare everything.
    Returns the greedy tokens."""
    pool = pool_for(model, block_size, len(prompt) + n_decode)
    seq = pool.new_sequence()
    cache = model.new_cache(len(prompt) + n_decode)
    bounds = [0] + list(chunks or []) + [len(prompt)]
    for a, b in zip(bounds, bounds[1:]):
        paged = model.prefill(prompt[a:b], seq, all_logits=True)
        contiguous = model.prefill(prompt[a:b], cache, all_logits=True)
        assert_bit_identical(paged, contiguous, f"prefill logits of tokens {a}..{b}")
    logits_p, logits_c = paged[-1], contiguous[-1]
    tokens = []
    for step in range(n_decode):
        tp, tc = int(np.argmax(logits_p)), int(np.argmax(logits_c))
        assert tp == tc, f"greedy token {step} differs"
        tokens.append(tp)
        logits_p, logits_c = model.decode(tp, seq), model.decode(tc, cache)
        assert_bit_identical(logits_p, logits_c, f"decode step {step}")
    assert seq.length == cache.length == len(prompt) + n_decode
    keys, values = pool.gather(seq)
    assert_bit_identical(keys, cache.keys, "gathered keys")
    assert_bit_identical(values, cache.values, "gathered values")
    assert len(seq.block_table) == -(-seq.length // block_size)
    pool.check()
    return tokens


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_equals_contiguous(name, block_size):
    model = make_model(**MODELS[name], seed=11)
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, size=67)
    paged_vs_contiguous(model, prompt, n_decode=9, block_size=block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_prefill_across_block_edges(block_size):
    model = make_model(**MODELS["gqa"], seed=2)
    prompt = np.random.default_rng(9).integers(0, model.config.vocab_size, size=70)
    paged_vs_contiguous(model, prompt, n_decode=3, block_size=block_size,
                        chunks=[1, 4, 5, 20, 64, 65])


@settings(max_examples=8, deadline=None, database=None)
@given(n_kv_heads=st.sampled_from([1, 2, 3]), kv_mul=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([2, 4, 6]), layers=st.integers(1, 2),
       block_size=st.sampled_from(BLOCK_SIZES), prompt_len=st.integers(1, 70),
       seed=st.integers(0, 2 ** 16))
def test_paged_equals_contiguous_random_configs(n_kv_heads, kv_mul, head_dim, layers,
                                                 block_size, prompt_len, seed):
    n_heads = n_kv_heads * kv_mul
    model = make_model(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                       dim=n_heads * head_dim + 2, layers=layers, vocab=23, seed=seed,
                       interleaved=bool(seed % 2))
    prompt = np.random.default_rng(seed).integers(0, 23, size=prompt_len)
    paged_vs_contiguous(model, prompt, n_decode=4, block_size=block_size)


@pytest.fixture(scope="module")
def stories(shared_models):
    path = shared_models / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip("stories260K not in ../shared/models")
    return kvlab.load(path, tokenizer=path.parent / "tok512.bin")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_stories260k_paged_equals_contiguous(stories, golden, block_size):
    prompt = np.array([1] + golden.ids[:4])
    tokens = paged_vs_contiguous(stories, prompt, n_decode=70, block_size=block_size)
    assert tokens == golden.ids[4:74]


# ---- fork, copy-on-write ----------------------------------------------------------------

@pytest.mark.parametrize("block_size", [2, 3, 4, 16])
def test_fork_then_diverge(block_size):
    model = make_model(**MODELS["gqa"], seed=4)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, size=2 * block_size + 1)
    partial = len(prompt) % block_size
    assert partial
    pool = model.new_paged_pool(num_blocks=40, block_size=block_size)
    parent = pool.new_sequence()
    model.prefill(prompt, parent)
    table = parent.block_table.copy()
    assert len(table) == 3
    data_before = {"K": pool.key_codes.copy(), "V": pool.value_codes.copy()}

    child = pool.fork(parent)
    assert np.array_equal(child.block_table, table) and child.length == parent.length
    assert pool.ref_counts[table].tolist() == [2, 2, 2]
    assert pool.stats().blocks_used == 3
    assert np.array_equal(pool.key_codes, data_before["K"]), "fork must copy nothing"
    assert np.array_equal(pool.value_codes, data_before["V"]), "fork must copy nothing"
    pool.check()

    caches = {}
    for name, first in (("parent", 5), ("child", 7)):
        caches[name] = model.new_cache(len(prompt) + 3 * block_size)
        model.prefill(prompt, caches[name])

    # the parent writes first: it gets its own copy of the shared partial block
    got = model.decode(5, parent)
    assert_bit_identical(got, model.decode(5, caches["parent"]), "parent after fork")
    copy = int(parent.block_table[2])
    assert parent.block_table[:2].tolist() == table[:2].tolist() and copy != table[2]
    assert np.array_equal(child.block_table, table), "the child's table must not change"
    assert pool.ref_counts[table].tolist() == [2, 2, 1] and pool.ref_counts[copy] == 1
    assert pool.stats().blocks_used == 4
    rows = slice(0, partial)
    for name, codes in (("K", pool.key_codes), ("V", pool.value_codes)):
        assert np.array_equal(codes[copy][:, rows], data_before[name][table[2]][:, rows]), \
            f"the copy must hold the shared {name} rows exactly"
        assert np.array_equal(codes[table[2]], data_before[name][table[2]]), \
            f"the original partial block's {name} must be left alone"
    pool.check()

    # the child now owns the original alone: it writes in place, no second copy
    got = model.decode(7, child)
    assert_bit_identical(got, model.decode(7, caches["child"]), "child after fork")
    assert np.array_equal(child.block_table, table)
    assert pool.stats().blocks_used == 4
    pool.check()

    # keep going past block edges; full blocks stay shared, new ones are private
    rng = np.random.default_rng(3)
    for _ in range(2 * block_size):
        for name, seq in (("parent", parent), ("child", child)):
            token = int(rng.integers(0, model.config.vocab_size))
            assert_bit_identical(model.decode(token, seq), model.decode(token, caches[name]),
                                 f"{name} decode")
        assert pool.ref_counts[table[:2]].tolist() == [2, 2]
        assert not set(parent.block_table[2:].tolist()) & set(child.block_table[2:].tolist())
        pool.check()
    stats = pool.stats()
    assert stats.blocks_used == 2 + len(parent.block_table) - 2 + len(child.block_table) - 2
    for name, seq in (("parent", parent), ("child", child)):
        keys, values = pool.gather(seq)
        assert np.array_equal(keys, caches[name].keys)
        assert np.array_equal(values, caches[name].values)


@pytest.mark.parametrize("block_size", [3, 4])
def test_fork_then_prefill_chunks_on_both(block_size):
    """A multi-token pass that starts in a shared partial block: copy first, then new
    blocks, all in one forward call."""
    model = make_model(**MODELS["mqa"], seed=12)
    rng = np.random.default_rng(block_size)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, size=2 * block_size + 1)
    pool = model.new_paged_pool(num_blocks=20, block_size=block_size)
    parent = pool.new_sequence()
    model.prefill(prompt, parent)
    child = pool.fork(parent)
    for seq in (child, parent):
        chunk = rng.integers(0, vocab, size=2 * block_size + 2)
        cache = model.new_cache(64)
        model.prefill(prompt, cache)
        assert_bit_identical(model.prefill(chunk, seq, all_logits=True),
                             model.prefill(chunk, cache, all_logits=True), "chunk after fork")
        keys, values = pool.gather(seq)
        assert np.array_equal(keys, cache.keys) and np.array_equal(values, cache.values)
        pool.check()
    assert pool.ref_counts[parent.block_table[:2]].tolist() == [2, 2]
    # 2 shared + for each: 1 own partial (one copy, one original) + 2 new
    assert pool.stats().blocks_used == 2 + 2 * 3


def test_fork_at_a_block_edge_copies_nothing():
    model = make_model(**MODELS["mqa"], seed=8)
    pool = model.new_paged_pool(num_blocks=10, block_size=4)
    parent = pool.new_sequence()
    model.prefill(list(range(8)), parent)
    child = pool.fork(parent)
    model.decode(1, parent)
    model.decode(2, child)
    assert parent.block_table[:2].tolist() == child.block_table[:2].tolist()
    assert parent.block_table[2] != child.block_table[2]
    assert pool.stats().blocks_used == 4   # two shared + one new each, no copies
    pool.check()


def test_three_way_fork_copies_for_all_but_the_last_writer():
    pool = kvlab.PagedPool(1, 1, 2, 10, 4)
    rows = PrefixRows(1, 1, 2)
    a = pool.new_sequence()
    pool.append(a, as_i32([1, 2]), *rows.rows([1, 2], 0, 2))
    b, c = pool.fork(a), pool.fork(a)
    original = int(a.block_table[0])
    assert pool.ref_counts[original] == 3
    for seq, token in ((a, 3), (b, 0), (c, 1)):
        pool.append(seq, as_i32([token]), *rows.rows([1, 2, token], 2, 3))
    assert a.block_table[0] != original and b.block_table[0] != original
    assert c.block_table[0] == original       # the last sharer writes in place
    assert pool.stats().blocks_used == 3
    for seq, token in ((a, 3), (b, 0), (c, 1)):
        keys, _ = pool.gather(seq)
        assert np.array_equal(keys, rows.rows([1, 2, token], 0, 3)[0].transpose(1, 0, 2, 3))
    pool.check()


# ---- prefix caching with a model -----------------------------------------------------------

def test_prefix_reuse_with_a_model():
    model = make_model(**MODELS["gqa"], seed=6)
    bs = 4
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, size=21)
    fresh = model.new_cache(40)
    want = model.prefill(prompt, fresh)
    pool = model.new_paged_pool(num_blocks=32, block_size=bs)

    a = pool.new_sequence()
    model.prefill(prompt, a)
    a_blocks = a.block_table[:5].tolist()
    pool.free(a)
    assert pool.cached_blocks == a_blocks[::-1], "a chain's tail is evicted before its head"
    assert pool.stats().blocks_cached == 5

    b = pool.new_sequence()
    hits = pool.stats().prefix_hits
    reused = pool.reuse_prefix(b, prompt.astype(np.int32), len(prompt) - 1)
    assert reused == 20 and b.length == 20
    assert b.block_table.tolist() == a_blocks, "the cached blocks themselves are reused"
    assert pool.stats().prefix_hits == hits + 5
    assert pool.stats().blocks_cached == 0
    assert_bit_identical(model.prefill(prompt[reused:], b), want, "logits after reuse")
    for token in (3, 1, 4):
        assert_bit_identical(model.decode(token, b), model.decode(token, fresh), "decode")
    pool.check()

    # a prompt that shares only the first block reuses only that block
    other = prompt.copy()
    other[4] = (other[4] + 1) % model.config.vocab_size
    c = pool.new_sequence()
    stats = pool.stats()
    assert pool.reuse_prefix(c, other.astype(np.int32), len(other) - 1) == 4
    assert c.block_table.tolist() == a_blocks[:1]
    assert pool.stats().prefix_hits == stats.prefix_hits + 1
    assert pool.stats().prefix_misses == stats.prefix_misses + 4
    expect = model.new_cache(40)
    assert_bit_identical(model.prefill(other[4:], c), model.prefill(other, expect),
                         "logits after a partial reuse")
    assert pool.ref_counts[a_blocks[0]] == 2
    pool.check()


def test_prefix_reuse_from_a_live_sequence_shares_its_blocks():
    model = make_model(**MODELS["mqa"], seed=1)
    prompt = np.random.default_rng(4).integers(0, model.config.vocab_size, size=12)
    pool = model.new_paged_pool(num_blocks=16, block_size=4)
    a = pool.new_sequence()
    model.prefill(prompt, a)
    b = pool.new_sequence()
    assert pool.reuse_prefix(b, prompt.astype(np.int32), 11) == 8
    assert pool.ref_counts[a.block_table[:2]].tolist() == [2, 2]
    logits_b = model.prefill(prompt[8:], b)
    cache = model.new_cache(16)
    assert_bit_identical(logits_b, model.prefill(prompt, cache), "reuse from a live sequence")
    assert_bit_identical(model.decode(2, a), model.decode(2, cache), "the owner is untouched")
    pool.check()


@pytest.mark.parametrize("hash_bits", [1, 2])
def test_colliding_hashes_never_give_wrong_logits(hash_bits):
    """Many prompts over a 3-token vocabulary with every hash in 1-2 buckets: each
    reuse must find exactly its own prefix, and logits equal a fresh prefill."""
    model = make_model(**MODELS["gqa"], vocab=3, seed=9)
    c = model.config
    bs = 2
    pool = kvlab.PagedPool(c.n_layers, c.n_kv_heads, c.head_dim, 40, bs, hash_bits=hash_bits)
    rng = np.random.default_rng(hash_bits)
    prompts = [rng.integers(0, 3, size=int(rng.integers(3, 12))) for _ in range(30)]
    total_reused = 0
    for prompt in prompts:
        seq = pool.new_sequence()
        reused = pool.reuse_prefix(seq, prompt.astype(np.int32), len(prompt) - 1)
        total_reused += reused
        got = model.prefill(prompt[reused:], seq)
        assert_bit_identical(got, model.forward(prompt), f"prompt {prompt.tolist()}")
        keys, _ = pool.gather(seq)
        cache = model.new_cache(len(prompt))
        model.prefill(prompt, cache)
        assert np.array_equal(keys, cache.keys)
        pool.check()
        pool.free(seq)
    assert total_reused > 0 and pool.stats().prefix_hits > 0


def test_reuse_prefix_with_a_negative_max_tokens_does_not_reuse_the_whole_prompt():
    """reuse_prefix(seq, tokens, max_tokens) reuses the longest cached prefix of
    tokens[:max_tokens]. An explicit negative max_tokens must either be refused (the C
    core returns KV_ERR_INVALID_ARG for it) or mean what the slice means (all but the
    last -max_tokens tokens); it must not silently mean "all of them", which leaves a
    caller who computed len(prompt) - k with nothing left to prefill."""
    pool, rows = small_pool(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4]
    seq = pool.new_sequence()
    append(pool, rows, seq, prompt)
    pool.free(seq)
    seq = pool.new_sequence()
    try:
        reused = pool.reuse_prefix(seq, as_i32(prompt), -3)
    except ValueError:
        return
    allowed = len(prompt[:-3]) // 2 * 2
    assert reused <= allowed, (f"reuse_prefix(seq, 4 tokens, max_tokens=-3) reused {reused} "
                               f"tokens; tokens[:-3] holds only {allowed} reusable ones")


def test_eviction_is_least_recently_used_first():
    pool = kvlab.PagedPool(1, 1, 2, 4, 2)
    rows = PrefixRows(1, 1, 2)
    chains = {}
    for first in (0, 1):
        seq = pool.new_sequence()
        pool.append(seq, as_i32([first, 9]), *rows.rows([first, 9], 0, 2))
        chains[first] = int(seq.block_table[0])
        pool.free(seq)
    assert pool.cached_blocks == [chains[0], chains[1]]
    # touching chain 0 makes it the most recently used
    seq = pool.new_sequence()
    assert pool.reuse_prefix(seq, as_i32([0, 9])) == 2
    pool.free(seq)
    assert pool.cached_blocks == [chains[1], chains[0]]
    # fill the two free blocks, then one more block evicts chain 1, not chain 0
    hog = pool.new_sequence()
    pool.append(hog, as_i32([2] * 6), *rows.rows([2] * 6, 0, 6))
    assert pool.cached_blocks == [chains[0]]
    assert chains[1] in hog.block_table.tolist()
    probe = pool.new_sequence()
    assert pool.reuse_prefix(probe, as_i32([1, 9])) == 0
    assert pool.reuse_prefix(pool.new_sequence(), as_i32([0, 9])) == 2
    pool.check()


# ---- errors: each one leaves the pool exactly as it was, and nothing crashes -----------------

def small_pool(num_blocks=6, block_size=2, **kwargs):
    pool = kvlab.PagedPool(2, 1, 2, num_blocks, block_size, **kwargs)
    return pool, PrefixRows(2, 1, 2)


def append(pool, rows, seq, tokens, before=()):
    """Append tokens to seq; `before` are the tokens seq already holds."""
    tokens = list(tokens)
    keys, values = rows.rows(list(before) + tokens, len(before), len(before) + len(tokens))
    pool.append(seq, as_i32(tokens), keys, values)


def test_out_of_blocks_leaves_the_pool_unchanged():
    pool, rows = small_pool(num_blocks=6, block_size=2)
    a = pool.new_sequence()
    append(pool, rows, a, [1, 2, 3])                # blocks: full + partial
    b = pool.fork(a)                                # shares the partial block
    c = pool.new_sequence()
    append(pool, rows, c, [0, 0])                   # a full block ...
    pool.free(c)                                    # ... kept cached
    assert pool.stats().blocks_free == 3 and pool.stats().blocks_cached == 1
    # b needs a copy of the shared partial block and 4 new blocks: 5 > 3 free + 1 cached
    before = snapshot(pool, [a, b])
    with pytest.raises(kvlab.OutOfBlocks, match="unchanged"):
        append(pool, rows, b, [4] * 8, before=[1, 2, 3])
    assert_unchanged(before, pool, [a, b])
    pool.check()
    # exactly enough (copy + 3 new = 3 free + 1 evicted cached block) succeeds
    append(pool, rows, b, [4] * 6, before=[1, 2, 3])
    assert pool.stats().blocks_free == pool.stats().blocks_cached == 0
    # a owns its partial block alone now: one more row needs no block, two rows need one
    append(pool, rows, a, [5], before=[1, 2, 3])
    before = snapshot(pool, [a, b])
    with pytest.raises(kvlab.OutOfBlocks):
        append(pool, rows, a, [6], before=[1, 2, 3, 5])
    assert_unchanged(before, pool, [a, b])
    pool.check()


def test_out_of_blocks_in_a_forward_pass_leaves_the_pool_unchanged():
    model = make_model(**MODELS["gqa"], seed=3)
    pool = model.new_paged_pool(num_blocks=5, block_size=4)
    a = pool.new_sequence()
    model.prefill(list(range(10)), a)               # 3 blocks, the last partial
    b = pool.fork(a)
    before = snapshot(pool, [a, b])
    with pytest.raises(kvlab.OutOfBlocks):
        model.prefill(list(range(12)), b)           # copy + 2 new > 2 free
    assert_unchanged(before, pool, [a, b])
    with pytest.raises(kvlab.OutOfBlocks):
        model.prefill(list(range(20)), pool.new_sequence())
    assert pool.stats().n_sequences == 3
    pool.check()
    # and the pool still works: the failed sequence can go on once there is room
    pool.free(a)
    cache = model.new_cache(30)
    model.prefill(list(range(10)), cache)
    assert_bit_identical(model.prefill([7, 8], b), model.prefill([7, 8], cache), "after OOB")
    pool.check()


def test_table_full_raises_cache_full_and_changes_nothing():
    pool, rows = small_pool(num_blocks=10, block_size=2, max_blocks_per_seq=2)
    seq = pool.new_sequence()
    before = snapshot(pool, [seq])
    with pytest.raises(kvlab.CacheFullError, match="unchanged"):
        append(pool, rows, seq, [1] * 5)
    assert_unchanged(before, pool, [seq])
    append(pool, rows, seq, [1] * 4)
    before = snapshot(pool, [seq])
    with pytest.raises(kvlab.CacheFullError):
        append(pool, rows, seq, [1], before=[1] * 4)
    assert_unchanged(before, pool, [seq])
    pool.check()

    model = make_model(**MODELS["mqa"], max_seq_len=8)
    mpool = model.new_paged_pool(num_blocks=10, block_size=3)
    assert mpool.max_blocks_per_seq == 3
    seq = mpool.new_sequence()
    model.prefill(list(range(9)), seq)
    before = snapshot(mpool, [seq])
    with pytest.raises(kvlab.CacheFullError):
        model.decode(1, seq)
    assert_unchanged(before, mpool, [seq])


def test_out_of_sequences():
    pool, rows = small_pool(max_seqs=2)
    a, b = pool.new_sequence(), pool.new_sequence()
    append(pool, rows, a, [1, 2, 3])
    before = snapshot(pool, [a, b])
    with pytest.raises(kvlab.OutOfSequences):
        pool.new_sequence()
    with pytest.raises(kvlab.OutOfSequences):
        pool.fork(a)
    assert_unchanged(before, pool, [a, b])
    pool.free(b)
    assert pool.fork(a).length == 3
    pool.check()


def test_freed_sequence_is_refused_everywhere():
    model = make_model(**MODELS["mqa"])
    pool = model.new_paged_pool(num_blocks=8, block_size=2)
    seq = pool.new_sequence()
    model.prefill([1, 2, 3], seq)
    pool.free(seq)
    assert not seq.alive and "freed" in repr(seq)
    newer = pool.new_sequence()                     # takes the same slot
    assert newer.id == seq.id
    model.prefill([4, 5], newer)
    before = snapshot(pool, [newer])
    keys, values = PrefixRows(model.config.n_layers, 1, model.config.head_dim).rows([1], 0, 1)
    for action in (lambda: seq.length, lambda: seq.block_table,
                   lambda: pool.append(seq, as_i32([1]), keys, values),
                   lambda: pool.fork(seq), lambda: pool.free(seq), lambda: pool.gather(seq),
                   lambda: pool.reuse_prefix(seq, as_i32([1, 2])),
                   lambda: model.decode(1, seq), lambda: model.prefill([1, 2], seq)):
        with pytest.raises(ValueError, match="freed"):
            action()
    assert_unchanged(before, pool, [newer])
    assert newer.alive and newer.length == 2
    pool.check()


def test_sequence_of_another_pool_is_refused():
    pool, rows = small_pool()
    other, _ = small_pool()
    mine, theirs = pool.new_sequence(), other.new_sequence()
    append(pool, rows, mine, [1, 2, 3])
    before, before_other = snapshot(pool, [mine]), snapshot(other, [theirs])
    keys, values = rows.rows([1], 0, 1)
    for action in (lambda: pool.append(theirs, as_i32([1]), keys, values),
                   lambda: pool.fork(theirs), lambda: pool.free(theirs),
                   lambda: pool.gather(theirs), lambda: pool.reuse_prefix(theirs, as_i32([1]))):
        with pytest.raises(ValueError, match="another pool"):
            action()
    assert_unchanged(before, pool, [mine])
    assert_unchanged(before_other, other, [theirs])


@pytest.mark.parametrize("block_size", [0, -1, 4097, 100000])
def test_bad_block_sizes(block_size):
    with pytest.raises(ValueError, match="block_size"):
        kvlab.PagedPool(1, 1, 2, 4, block_size)
    with pytest.raises(ValueError, match="block_size"):
        make_model().new_paged_pool(num_blocks=4, block_size=block_size)


def test_block_size_bounds_and_other_sizes():
    for block_size in (1, 256, 4096):        # 4096: a whole context in one block
        pool = kvlab.PagedPool(1, 1, 2, 2, block_size)
        assert pool.block_size == block_size and pool.key_codes.shape[2] == block_size
        assert pool.max_seqs == 256 and pool.max_blocks_per_seq == 2
        assert pool.nbytes == 2 * 1 * 2 * block_size * 1 * 2 * 4 == 2 * pool.key_codes.nbytes
    for args, kwargs in [((0, 1, 2, 4, 2), {}), ((1, 0, 2, 4, 2), {}), ((1, 1, 0, 4, 2), {}),
                         ((1, 1, 2, 0, 2), {}), ((1, 1, 2, 4, 2), {"max_seqs": 0}),
                         ((1, 1, 2, 4, 2), {"max_blocks_per_seq": -1}),
                         ((1, 1, 2, 4, 2), {"hash_bits": 0}), ((1, 1, 2, 4, 2), {"hash_bits": 65})]:
        with pytest.raises(ValueError):
            kvlab.PagedPool(*args, **kwargs)
    for kwargs in ({"num_blocks": 0}, {"num_blocks": 2.5}, {"max_seqs": 0},
                   {"num_blocks": True}, {"num_blocks": 4, "dtype": "fp64"}):
        with pytest.raises(ValueError):
            make_model().new_paged_pool(**{"num_blocks": 4, **kwargs})


BAD_APPENDS = [  # (tokens, keys, values, error, match); shapes are for small_pool()
    (np.array([1, 2], dtype=np.int64), (2,), (2,), TypeError, "int32"),
    ([1, 2], (2,), (2,), TypeError, "int32"),
    (np.array([[1, 2]], dtype=np.int32), (2,), (2,), ValueError, "1-D"),
    (np.arange(4, dtype=np.int32)[::2], (2,), (2,), ValueError, "contiguous"),
    (np.array([], dtype=np.int32), (0,), (0,), ValueError, "empty"),
    (np.array([1, 2], dtype=np.int32), "f64", (2,), TypeError, "float32"),
    (np.array([1, 2], dtype=np.int32), (2,), "list", TypeError, "float32"),
    (np.array([1, 2], dtype=np.int32), (3,), (2,), ValueError, "shape"),
    (np.array([1, 2], dtype=np.int32), (2,), (1,), ValueError, "shape"),
    (np.array([1, 2], dtype=np.int32), (2, 2, 1, 3), (2,), ValueError, "shape"),
    (np.array([1, 2], dtype=np.int32), (2, 2, 2), (2,), ValueError, "shape"),
    (np.array([1, 2], dtype=np.int32), (2, 2, 1, 2, 1), (2,), ValueError, "shape"),
    (np.array([1, 2], dtype=np.int32), "fortran", (2,), ValueError, "contiguous"),
    (np.array([1, 2], dtype=np.int32), "swapped", (2,), TypeError, "float32"),
]


@pytest.mark.parametrize("tokens, keys, values, error, match", BAD_APPENDS)
def test_append_rejects_bad_arrays(tokens, keys, values, error, match):
    pool, rows = small_pool()
    seq = pool.new_sequence()
    append(pool, rows, seq, [1, 2, 3])

    def make(spec):
        if spec == "f64":
            return np.zeros((2, 2, 1, 2))
        if spec == "list":
            return np.zeros((2, 2, 1, 2), dtype=np.float32).tolist()
        if spec == "fortran":
            return np.asfortranarray(np.zeros((2, 2, 1, 2), dtype=np.float32))
        if spec == "swapped":
            return np.zeros((2, 2, 1, 2), dtype=np.dtype(np.float32).newbyteorder())
        shape = spec + (2, 1, 2) if len(spec) == 1 else spec   # (n_tokens,) or a full shape
        return np.zeros(shape, dtype=np.float32)

    before = snapshot(pool, [seq])
    with pytest.raises(error, match=match):
        pool.append(seq, tokens, make(keys), make(values))
    assert_unchanged(before, pool, [seq])
    with pytest.raises(TypeError, match="PagedSequence"):
        pool.append("not a sequence", as_i32([1]), make((1,)), make((1,)))
    with pytest.raises(TypeError, match="integers"):
        pool.reuse_prefix(pool.new_sequence(), np.array([1.0, 2.0]))
    # lists and int64 arrays are fine, and find the same blocks as int32 ones
    assert pool.reuse_prefix(pool.new_sequence(), [1, 2]) == \
        pool.reuse_prefix(pool.new_sequence(), as_i32([1, 2]))


def test_pool_for_another_model_shape_is_refused():
    model, other = make_model(**MODELS["gqa"]), make_model(**MODELS["mqa"])
    pool = other.new_paged_pool(num_blocks=8, block_size=4)
    seq = pool.new_sequence()
    other.prefill([1, 2, 3], seq)
    before = snapshot(pool, [seq])
    with pytest.raises(ValueError, match="model needs"):
        model.prefill([1, 2], seq)
    with pytest.raises(ValueError, match="model needs"):
        model.decode(1, seq)
    assert_unchanged(before, pool, [seq])


def test_bad_tokens_on_a_paged_sequence_change_nothing():
    model = make_model(**MODELS["gqa"])
    pool = model.new_paged_pool(num_blocks=8, block_size=4)
    seq = pool.new_sequence()
    model.prefill([1, 2, 3], seq)
    before = snapshot(pool, [seq])
    for tokens in ([0, 40], [-1], [], [[1, 2]]):
        with pytest.raises(ValueError):
            model.prefill(tokens, seq)
    with pytest.raises(ValueError, match="out of range"):
        model._core.forward(np.array([1, 99], dtype=np.int32), seq)
    with pytest.raises(TypeError):
        model._core.forward(np.array([1], dtype=np.int32), "not a sequence")
    assert_unchanged(before, pool, [seq])


def test_uninitialized_and_reinitialized_objects_raise_instead_of_crashing():
    empty = kvlab.PagedPool.__new__(kvlab.PagedPool)
    for action in (empty.new_sequence, empty.stats, empty.check, empty.sequences,
                   lambda: empty.key_codes, lambda: empty.ref_counts, empty.render, lambda: repr(empty),
                   lambda: empty.free_blocks, lambda: empty.cached_blocks, empty.take_events,
                   lambda: empty.num_blocks):
        with pytest.raises(RuntimeError, match="not initialized"):
            action()
    assert empty.nbytes == 0 and not empty.record_events
    bare = kvlab._kvlab.BlockManager.__new__(kvlab._kvlab.BlockManager)
    with pytest.raises(RuntimeError, match="BlockManager was not initialized"):
        bare.new_sequence()
    pool = kvlab.PagedPool(1, 1, 2, 4, 2)
    with pytest.raises(RuntimeError, match="already initialized"):
        pool.__init__(1, 1, 2, 4, 2)
    with pytest.raises(TypeError):
        kvlab.PagedSequence()
    with pytest.raises(RuntimeError, match="not initialized"):
        empty.gather(pool.new_sequence())


def test_check_finds_broken_invariants():
    """Corrupt the pool behind its back (through the views' memory) and check() must
    say so; put it back and check() passes again."""
    import ctypes
    pool, rows = small_pool(num_blocks=6, block_size=2)
    a = pool.new_sequence()
    append(pool, rows, a, [1, 2, 3])
    gone = pool.new_sequence()
    append(pool, rows, gone, [0, 0])
    pool.free(gone)
    pool.check()
    full, partial = (int(b) for b in a.block_table)
    cached = pool.cached_blocks[0]

    def poke(view, index, value):
        cell = ctypes.c_int32.from_address(view.ctypes.data + index * view.itemsize)
        old, cell.value = cell.value, value
        return old

    for view, index, value, match in [
        (pool.ref_counts, full, 2, "ref_count"),
        (pool.fill, partial, 0, "reads 1 rows"),
        (pool.fill, cached, 1, "not full"),
        (a.block_table, 1, 99, "out of range"),
        (a.block_table, 1, full, "ref_count"),
    ]:
        old = poke(view, index, value)
        try:
            with pytest.raises(kvlab.PoolInvariantError, match=match):
                pool.check()
        finally:
            poke(view, index, old)
        pool.check()


def test_threads_on_separate_pools_match_serial_runs():
    import threading
    model = make_model(**MODELS["gqa"], seed=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]

    def run(prompt):
        pool = model.new_paged_pool(num_blocks=12, block_size=3)
        seq = pool.new_sequence()
        logits = model.prefill(prompt, seq)
        out = []
        for _ in range(15):
            out.append(int(np.argmax(logits)))
            logits = model.decode(out[-1], seq)
        return out

    serial = [run(p) for p in prompts]
    results = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


def test_a_pool_busy_in_another_thread_refuses_cleanly():
    """While one thread runs forward passes on a sequence, the pool's other operations
    either work or raise RuntimeError ("in use"): never a crash or a corrupt pool."""
    import threading
    model = make_model(**MODELS["gqa"], max_seq_len=200, seed=2)
    pool = model.new_paged_pool(num_blocks=120, block_size=2)
    seq = pool.new_sequence()
    done = threading.Event()

    def worker():
        try:
            for i in range(120):
                model.decode(i % 40, seq)
        finally:
            done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    others = []
    while not done.is_set():
        for action in (pool.stats, pool.check, lambda: pool.gather(seq),
                       lambda: others.append(pool.new_sequence()),
                       lambda: others and pool.free(others.pop()),
                       lambda: model.prefill([1, 2], pool.new_sequence())):
            try:
                action()
            except RuntimeError as error:
                assert "in use" in str(error)
    thread.join()
    pool.check()
    cache = model.new_cache(200)
    for i in range(120):
        model.decode(i % 40, cache)
    keys, values = pool.gather(seq)
    assert np.array_equal(keys, cache.keys) and np.array_equal(values, cache.values)


# ---- views ------------------------------------------------------------------------------------

def base_chain_reaches(array, owner) -> bool:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base is owner


def test_views_are_read_only_zero_copy_and_keep_the_pool_alive():
    pool, rows = small_pool(num_blocks=6, block_size=2)
    seq = pool.new_sequence()
    data = pool.key_codes
    assert data.dtype == np.float32 and data.shape == (6, 2, 2, 1, 2)
    assert not data.flags.writeable          # a strided view of the layer-major memory
    assert np.shares_memory(data, pool.key_codes) and base_chain_reaches(data, pool)
    with pytest.raises(ValueError):
        data[0, 0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        data.flags.writeable = True
    append(pool, rows, seq, [1, 2, 3])
    keys, values = rows.rows([1, 2, 3], 0, 3)
    table = seq.block_table
    # the view taken before the append sees the rows written after it: zero-copy
    assert np.array_equal(data[table[1], :, 0], keys[2])
    assert np.array_equal(pool.value_codes[table[1], :, 0], values[2])
    assert table.dtype == np.int32 and not table.flags.writeable
    assert np.shares_memory(table, seq.block_table) and base_chain_reaches(table, pool)
    with pytest.raises(ValueError):
        table[0] = 5
    with pytest.raises(ValueError):
        table.flags.writeable = True
    others = {"ref_counts": pool.ref_counts, "fill": pool.fill, "block_tokens": pool.block_tokens}
    for name, view in others.items():
        assert not view.flags.writeable, name
        assert np.shares_memory(view, getattr(pool, name)) and base_chain_reaches(view, pool)
        with pytest.raises(ValueError):
            view.flags.writeable = True
    copies = {name: view.copy() for name, view in others.items()}
    data_copy, table_copy = data.copy(), table.copy()

    alive = weakref.ref(pool)
    del pool, seq
    gc.collect()
    assert alive() is not None, "the views must keep the pool alive"
    assert np.array_equal(data, data_copy) and np.array_equal(table, table_copy)
    for name, view in others.items():
        assert np.array_equal(view, copies[name])
    del data, table, others, view
    gc.collect()
    assert alive() is None, "the pool leaked after its last view was dropped"


def test_sequence_handles_keep_the_pool_alive():
    pool, rows = small_pool()
    seq = pool.new_sequence()
    append(pool, rows, seq, [3, 1])
    alive = weakref.ref(pool)
    del pool
    gc.collect()
    assert alive() is not None and seq.pool is alive()
    keys, _ = seq.pool.gather(seq)
    assert np.array_equal(keys, rows.rows([3, 1], 0, 2)[0].transpose(1, 0, 2, 3))
    del seq, keys
    gc.collect()
    assert alive() is None


# ---- pictures ---------------------------------------------------------------------------------

def test_render_html_and_repr_show_every_live_sequence_and_the_counts():
    pool, rows = small_pool(num_blocks=10, block_size=2)
    a = pool.new_sequence()
    append(pool, rows, a, [1, 2, 3, 4, 5])
    b = pool.fork(a)
    append(pool, rows, b, [6], before=[1, 2, 3, 4, 5])
    gone = pool.new_sequence()
    append(pool, rows, gone, [0, 0, 1])
    empty = pool.new_sequence()
    pool.free(gone)
    live = [a, b, empty]
    s = pool.stats()
    assert (s.blocks_used, s.blocks_cached, s.blocks_free) == (4, 1, 5)   # b copied its last block
    counts = f"{s.blocks_used} used, {s.blocks_cached} cached, {s.blocks_free} free"

    text = pool.render()
    assert counts in text
    for seq in live:
        table = ", ".join(str(x) for x in seq.block_table)
        assert f"seq {seq.id}: length {seq.length}, blocks [{table}]" in text
    assert f"seq {gone.id}:" not in text
    cells = text.splitlines()[1].split()[1]
    assert len(cells) == 10
    assert cells.count(".") == s.blocks_free and cells.count("c") == s.blocks_cached
    assert [cells[x] for x in a.block_table[:2]] == ["2", "2"]
    assert len(pool.render(width=4).splitlines()) == 1 + 3 + len(live)

    page = pool._repr_html_()
    assert counts in page
    for seq in live:
        assert f"<td>seq {seq.id}</td><td>{seq.length}</td>" in page
    assert f"<td>seq {gone.id}</td>" not in page
    assert page.count("title=\"block ") == 10

    assert (f"used={s.blocks_used}, cached={s.blocks_cached}, free={s.blocks_free}, "
            f"sequences=3") in repr(pool)
    assert repr(a) == f"PagedSequence(id={a.id}, length=5, blocks=3)"
    assert repr(empty) == f"PagedSequence(id={empty.id}, length=0, blocks=0)"
    assert "freed" in repr(gone)
    states = [pool.block_state(x) for x in range(10)]
    assert states.count("used") == 4 and states.count("cached") == 1 and states.count("free") == 5


def test_a_prefix_computed_twice_is_stored_once():
    # Two sequences prefill the same prompt side by side (as one engine step does): when
    # the second one's blocks fill up, the pool already knows identical ones, so the second
    # sequence switches to them and its own copies go back to the free list.
    model = make_model()
    prompt = list(np.random.default_rng(7).integers(0, model.config.vocab_size, 22))
    pool = model.new_paged_pool(num_blocks=12, block_size=4)
    first, second = pool.new_sequence(), pool.new_sequence()
    model.prefill(prompt, first)
    model.prefill(prompt, second)
    full = len(prompt) // 4
    assert second.block_table[:full].tolist() == first.block_table[:full].tolist()
    assert second.block_table[full] != first.block_table[full]   # the partial block is its own
    assert pool.stats().blocks_used == full + 2 and len(pool.free_blocks) == 12 - full - 2
    pool.check()
    # both go on exactly like a sequence that never shared anything
    alone = model.new_cache(32)
    model.prefill(prompt, alone)
    assert_bit_identical(model.decode(3, second), model.decode(3, alone), "after sharing")
    # and the whole chain is findable: a third prompt reuses every full block
    third = pool.new_sequence()
    assert pool.reuse_prefix(third, np.array(prompt, dtype=np.int32)) == full * 4


def test_a_pool_without_prefix_cache_never_shares_blocks_by_their_tokens():
    """Rows appended under equal tokens stay each sequence's own with prefix_cache=False
    (with it on, the pool takes rows to be what the model computes for the tokens and
    shares equal full blocks, which would swap these random rows for the first ones)."""
    model = kvlab.load()
    config = model.config
    rng = np.random.default_rng(0)
    shape = (40, config.n_layers, config.n_kv_heads, config.head_dim)
    for prefix_cache, shared in ((True, True), (False, False)):
        pool = model.new_paged_pool(16, 16, prefix_cache=prefix_cache)
        rows = []
        for _ in range(2):
            seq = pool.new_sequence()
            keys = rng.standard_normal(shape, dtype=np.float32)
            pool.append(seq, np.zeros(40, np.int32), keys, -keys)
            rows.append((seq, keys))
        pool.check()
        seq, keys = rows[1]
        gathered_keys, gathered_values = pool.gather(seq)
        same = np.array_equal(gathered_keys, keys.transpose(1, 0, 2, 3))
        assert same != shared
        if not prefix_cache:
            assert np.array_equal(gathered_values, -keys.transpose(1, 0, 2, 3))
            assert pool.stats().blocks_used == 6
            assert pool.reuse_prefix(pool.new_sequence(), np.zeros(40, np.int32)) == 0


def test_render_counts_read_in_the_right_number():
    """Issue 22: a pool's summary said "1 slots"; one of anything is singular."""
    pool, rows = small_pool(num_blocks=1, block_size=2)
    seq = pool.new_sequence()
    append(pool, rows, seq, [7])
    for text in (pool.render(), pool._repr_html_()):
        assert "1 block x 2 tokens" in text and "1 token" in text and "1 slot unused" in text
        assert "1 blocks" not in text and "1 tokens" not in text and "1 slots" not in text
    append(pool, rows, seq, [8], before=[7])
    assert "2 tokens stored, 0 slots unused" in pool.render()
