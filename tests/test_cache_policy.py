"""kvlab.cache_policy and the core under it (cache.keep, positions, attention weights):
caches that keep fewer positions give what attention over the kept positions gives,
whichever way the tokens are split, and say which positions they kept."""
import numpy as np
import pytest

import kvlab
from kvlab import reference
from kvlab.cache_policy import AttentionSinks, HeavyHitters, SlidingWindow, SnapKV
from policy_reference import masked_forward, window_mask


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def ids(model):
    text = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
            "First Citizen: You are all resolved rather to die than to famish?")
    return model.encode(text)[:120]


@pytest.mark.parametrize("policy, visible", [
    (SlidingWindow(16), window_mask(16)),
    (SlidingWindow(1), window_mask(1)),
    (AttentionSinks(4, 12), window_mask(12, sinks=4)),
])
def test_streaming_policies_attend_exactly_to_the_kept_positions(model, ids, policy, visible):
    cache = policy.new_cache(model)
    got = policy.forward(model, ids, cache, all_logits=True)
    want = masked_forward(model, ids, visible)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert cache.length == policy.budget and cache.next_position == len(ids)


@pytest.mark.parametrize("policy", [SlidingWindow(16), AttentionSinks(4, 12), HeavyHitters(16),
                                    HeavyHitters(16, recent=3)])
def test_splitting_the_tokens_differently_gives_the_same_bits(model, ids, policy):
    """The prompt in one call, or token by token, or in odd pieces: each query sees the
    same rows, so the logits are the same bits."""
    whole_cache = policy.new_cache(model)
    whole = policy.forward(model, ids, whole_cache, all_logits=True)
    for pieces in ([1] * len(ids), [7, 30, 1, 50, len(ids) - 88]):
        cache = policy.new_cache(model)
        start, parts = 0, []
        for n in pieces:
            parts.append(policy.forward(model, ids[start:start + n], cache, all_logits=True))
            start += n
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        np.testing.assert_array_equal(cache.positions, whole_cache.positions)


def test_a_budget_never_reached_changes_nothing(model, ids):
    plain = model.new_cache(len(ids))
    want = model.forward(ids, plain, all_logits=True)
    for policy in (SlidingWindow(len(ids)), HeavyHitters(len(ids) + 5), SnapKV(len(ids))):
        cache = policy.new_cache(model) if policy.bounded else policy.new_cache(model, max_seq_len=len(ids))
        np.testing.assert_array_equal(policy.forward(model, ids, cache, all_logits=True), want)
        np.testing.assert_array_equal(cache.positions[0, :, 0], np.arange(len(ids)))


def test_rows_are_kept_as_stored_rotated_at_their_own_positions(model, ids):
    """RoPE, claim 1: a kept row is not re-rotated when rows before it go. Layer 0's K
    depends only on the token and its position, so its kept rows are bit for bit the full
    cache's rows at the positions cache.positions names."""
    full = model.new_cache(len(ids))
    model.forward(ids, full)
    for policy in (SlidingWindow(16), AttentionSinks(4, 12), HeavyHitters(16)):
        cache = policy.new_cache(model)
        policy.forward(model, ids, cache)
        positions = cache.positions
        for i in range(cache.length):
            for head in range(cache.shape[2]):
                np.testing.assert_array_equal(cache.keys[0, i, head],
                                              full.keys[0, positions[0, i, head], head])


def test_snapkv_keeps_prompt_rows_bit_for_bit(model, ids):
    """SnapKV compresses after the prompt ran with every row: the kept rows are exactly
    the full cache's rows, in every layer."""
    full = model.new_cache(len(ids))
    model.forward(ids, full)
    policy = SnapKV(24, observation=8)
    cache = policy.new_cache(model, max_seq_len=len(ids) + 8)
    policy.forward(model, ids, cache)
    assert cache.length == 24 and cache.next_position == len(ids)
    positions = cache.positions
    assert (positions[:, -8:, :] == np.arange(len(ids) - 8, len(ids))[None, :, None]).all()
    for layer in range(cache.shape[0]):
        for head in range(cache.shape[2]):
            np.testing.assert_array_equal(cache.keys[layer, :, head],
                                          full.keys[layer, positions[layer, :, head], head])
    # after the prompt the cache grows as usual
    policy.forward(model, [5], cache)
    assert cache.length == 25 and cache.positions[0, -1, 0] == len(ids)


def test_positions_may_run_past_the_trained_context(model):
    """RoPE, claim 2: positions are never renumbered, so a bounded cache runs past the
    model's context, with positions (and rotations) the model never saw in training."""
    policy = SlidingWindow(8)
    cache = policy.new_cache(model)
    tokens = np.arange(model.config.max_seq_len + 20) % model.config.vocab_size
    logits = policy.forward(model, tokens, cache)
    assert np.isfinite(logits).all()
    assert cache.next_position == len(tokens) > model.config.max_seq_len
    assert cache.positions.max() == len(tokens) - 1


def test_attention_weights_are_the_softmax_of_layer_0(model, ids):
    """The weights the core adds up are attention's own: layer 0's queries recomputed in
    NumPy give the same softmax."""
    c, w = model.config, model.weights
    cache = model.new_cache(len(ids))
    cache.track_attention()
    model.forward(ids[:40], cache)
    x = w.token_embedding[np.asarray(ids[:40])].astype(np.float32)
    h = reference.rmsnorm(x, w.attn_norm[0], c.norm_eps)
    q = reference.rope((h @ w.wq[0].T).reshape(40, c.n_heads, c.head_dim), np.arange(40),
                       c.rope_inv_freq(), c.rope_interleaved)
    keys = np.repeat(cache.keys[0], c.n_heads // c.n_kv_heads, axis=1)
    scores = np.einsum("thd,phd->htp", q, keys) / np.sqrt(c.head_dim)
    scores = np.where(np.tri(40, dtype=bool)[None], scores, -np.inf)
    weights = reference.softmax(scores).sum(axis=1)            # (n_heads, position)
    per_kv_head = weights.reshape(c.n_kv_heads, -1, 40).sum(axis=1).T
    np.testing.assert_allclose(cache.attention_weights[0], per_kv_head, rtol=1e-4, atol=1e-5)


def test_each_query_gives_out_one_unit_of_weight_per_head(model, ids):
    cache = model.new_cache(64)
    model.forward(ids[:10], cache)
    cache.track_attention()
    model.forward(ids[10:13], cache)
    kv_mul = model.config.n_heads // model.config.n_kv_heads
    np.testing.assert_allclose(cache.attention_weights.sum(axis=1), 3 * kv_mul, rtol=1e-5)
    cache.track_attention(False)
    assert cache.attention_weights is None and not cache.tracks_attention


def test_heavy_hitters_keep_the_recent_rows_and_the_most_attended(model, ids):
    """HeavyHitters(20, recent=6): after each step, the 6 newest positions (the new token's
    included) and the 14 most attended of the rest."""
    policy = HeavyHitters(20, recent=6)
    cache = policy.new_cache(model)
    policy.forward(model, ids[:20], cache)
    weights, positions = cache.attention_weights, cache.positions
    policy.forward(model, ids[20:21], cache)
    kept = cache.positions
    for layer in range(cache.shape[0]):
        for head in range(cache.shape[2]):
            older = weights[layer, :15, head]
            heavy = np.sort(np.argsort(-older, kind="stable")[:14])
            want = np.concatenate([positions[layer, heavy, head], positions[layer, 15:, head], [20]])
            np.testing.assert_array_equal(kept[layer, :, head], want)
    assert (cache.positions[:, -6:, :] == np.arange(15, 21)[None, :, None]).all()


def test_generate_with_a_policy_keeps_memory_flat(model):
    out = kvlab.generate(model, "ROMEO:", max_new_tokens=40, cache_policy=SlidingWindow(16))
    longer = kvlab.generate(model, "ROMEO:", max_new_tokens=80, cache_policy=SlidingWindow(16))
    assert len(out.tokens) == 40 and out.cache_nbytes == longer.cache_nbytes
    # a run that fits in the budget needs no policy, and no more memory than it uses
    short = kvlab.generate(model, "ROMEO:", max_new_tokens=4, cache_policy=SlidingWindow(16))
    assert short.cache_nbytes < out.cache_nbytes
    # the same as the policy run by hand
    ids = model.encode("ROMEO:")
    policy = SlidingWindow(16)
    cache, tokens = policy.new_cache(model), []
    logits = policy.forward(model, ids, cache)
    for _ in range(40):
        tokens.append(int(np.argmax(logits)))
        logits = policy.forward(model, [tokens[-1]], cache)
    assert out.tokens == tokens
    # a window that holds everything gives plain decoding's tokens
    wide = kvlab.generate(model, "ROMEO:", max_new_tokens=40, cache_policy=SlidingWindow(64))
    assert wide.tokens == kvlab.generate(model, "ROMEO:", max_new_tokens=40).tokens


def test_generate_past_the_context_only_with_a_bounded_policy(model):
    n = model.config.max_seq_len
    out = kvlab.generate(model, [1, 2, 3], max_new_tokens=n, cache_policy=AttentionSinks(4, 28),
                         stop_at_eos=False)
    assert len(out.tokens) == n
    with pytest.raises(kvlab.ContextLengthError):
        kvlab.generate(model, [1, 2, 3], max_new_tokens=n, cache_policy=SnapKV(16))


@pytest.mark.parametrize("kwargs, error", [
    ({"cache_policy": "window"}, TypeError),
    ({"cache_policy": SlidingWindow(8), "use_cache": False}, ValueError),
    ({"cache_policy": SlidingWindow(8), "window": 4}, ValueError),
    ({"cache_policy": SlidingWindow(8), "speculate": kvlab.speculative.PromptLookup()}, ValueError),
])
def test_generate_refuses_a_policy_it_cannot_honour(model, kwargs, error):
    with pytest.raises(error):
        kvlab.generate(model, "ROMEO:", max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("make", [lambda: SlidingWindow(0), lambda: SlidingWindow(2.5),
                                  lambda: AttentionSinks(0, 4), lambda: HeavyHitters(1),
                                  lambda: HeavyHitters(8, recent=8), lambda: SnapKV(4, observation=8),
                                  lambda: SlidingWindow(True)])
def test_policies_refuse_impossible_sizes(make):
    with pytest.raises(ValueError):
        make()


def test_a_policy_refuses_a_cache_it_cannot_use(model):
    with pytest.raises(ValueError, match="room for"):
        SlidingWindow(16).forward(model, [1, 2], model.new_cache(8))
    with pytest.raises(ValueError, match="residual window"):
        SlidingWindow(16).forward(model, [1, 2], model.new_cache(16, "int8", window=4))
    with pytest.raises(TypeError, match="KVCache"):
        SlidingWindow(16).forward(model, [1, 2], np.zeros(16))
    pool = model.new_paged_pool(num_blocks=8, block_size=4, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="room for 8"):
        SlidingWindow(16).forward(model, [1, 2], pool.new_sequence())


@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_quantized_caches_keep_their_codes(model, ids, dtype):
    """Dropping rows moves codes, scales and zero points together: layer 0's kept codes
    equal the full cache's at the same positions."""
    full = model.new_cache(len(ids), dtype)
    model.forward(ids, full)
    policy = AttentionSinks(4, 12)
    cache = policy.new_cache(model, dtype)
    policy.forward(model, ids, cache)
    positions = cache.positions
    for part in ("key_codes", "key_scales", "value_codes", "value_zeros"):
        kept, whole = getattr(cache, part), getattr(full, part)
        if whole is None:
            continue
        for i in range(cache.length):
            for head in range(cache.shape[2]):
                np.testing.assert_array_equal(kept[0, i, head], whole[0, positions[0, i, head], head])


# ---- the cache's own operations ------------------------------------------------------------

def rows(cache, kept):
    """The same kept rows for every layer and head, as cache.keep takes them."""
    kept = np.asarray(kept, dtype=np.int32)
    return np.ascontiguousarray(np.broadcast_to(kept[None, :, None],
                                                (cache.shape[0], len(kept), cache.shape[2])))


def test_positions_of_a_plain_cache_count_from_zero(model, ids):
    cache = model.new_cache(32)
    model.forward(ids[:5], cache)
    assert cache.positions.shape == (model.config.n_layers, 5, model.config.n_kv_heads)
    assert (cache.positions == np.arange(5)[None, :, None]).all() and cache.next_position == 5


def test_keep_then_truncate_takes_back_only_the_newest(model, ids):
    cache = model.new_cache(32)
    model.forward(ids[:10], cache)
    cache.keep(rows(cache, [0, 2, 5, 9]))
    assert cache.length == 4 and cache.next_position == 10
    model.forward(ids[10:13], cache)
    assert list(cache.positions[0, :, 0]) == [0, 2, 5, 9, 10, 11, 12]
    cache.truncate(5)                                   # drafts 11, 12 refused
    assert cache.next_position == 11 and list(cache.positions[0, :, 0]) == [0, 2, 5, 9, 10]
    # rows that are not the newest positions cannot be taken back
    cache.keep(rows(cache, [0, 1, 2, 4]))               # 9 dropped, 10 kept as the last row
    with pytest.raises(ValueError, match="newest"):
        cache.truncate(2)
    cache.truncate(3)                                   # drops position 10, the newest
    assert cache.next_position == 10
    cache.reset()
    assert cache.length == 0 and cache.next_position == 0
    model.forward(ids[:2], cache)
    assert list(cache.positions[0, :, 0]) == [0, 1]


@pytest.mark.parametrize("bad", [[1, 1, 2], [2, 1], [0, 10], [-1, 3]])
def test_keep_refuses_bad_rows_and_changes_nothing(model, ids, bad):
    cache = model.new_cache(32)
    model.forward(ids[:10], cache)
    keys = cache.keys.copy()
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(rows(cache, bad))
    np.testing.assert_array_equal(cache.keys, keys)
    assert cache.length == 10 and cache.next_position == 10


def test_keep_checks_the_array(model, ids):
    cache = model.new_cache(32)
    model.forward(ids[:10], cache)
    with pytest.raises(ValueError, match="shape"):
        cache.keep(np.zeros((1, 2, 1), np.int32))
    with pytest.raises(TypeError):
        cache.keep(np.zeros((model.config.n_layers, 2, model.config.n_kv_heads), np.int64))
    with pytest.raises(TypeError):
        cache.keep([0, 1])


def test_keep_differs_per_head(model, ids):
    cache = model.new_cache(32)
    model.forward(ids[:6], cache)
    full_keys = cache.keys.copy()
    kept = np.zeros((cache.shape[0], 2, cache.shape[2]), np.int32)
    kept[:, :, 0] = [1, 4]
    kept[:, :, 1] = [0, 5]
    cache.keep(kept)
    np.testing.assert_array_equal(cache.keys[:, :, 0], full_keys[:, [1, 4], 0])
    np.testing.assert_array_equal(cache.keys[:, :, 1], full_keys[:, [0, 5], 1])
    assert list(cache.positions[0, :, 1]) == [0, 5]


# ---- models trained with a sliding window (Mistral) -----------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny random Mistral with a window of 8, written by transformers itself."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        sliding_window=8, rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = transformers.MistralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, kvlab.load(folder)


def test_a_sliding_window_model_loads_with_its_window(mistral):
    _, model = mistral
    assert model.config.sliding_window == 8


def test_a_sliding_window_model_matches_transformers(mistral):
    torch = pytest.importorskip("torch")
    hf, model = mistral
    tokens = [int(t) for t in (np.arange(30) * 7 + 3) % 64]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    policy = SlidingWindow(8)
    got = policy.forward(model, tokens, policy.new_cache(model), all_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # and greedy generation past the window gives transformers' tokens
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([tokens[:5]]), max_new_tokens=25, do_sample=False,
                             pad_token_id=0)[0, 5:].tolist()
    out = kvlab.generate(model, tokens[:5], max_new_tokens=25, stop_at_eos=False)
    assert out.tokens == hf_out


def test_a_sliding_window_model_refuses_a_cache_that_sees_too_much(mistral):
    _, model = mistral
    with pytest.raises(ValueError, match="sliding_window"):
        model.forward(list(range(9)))
    cache = model.new_cache(32)
    model.forward(list(range(8)), cache)
    with pytest.raises(ValueError, match="SlidingWindow"):
        model.decode(1, cache)
    assert cache.length == 8


# ---- a paged pool's sequences ---------------------------------------------------------------

@pytest.mark.parametrize("policy", [SlidingWindow(16), AttentionSinks(4, 12)])
def test_a_paged_sequence_keeps_the_same_rows_as_a_cache(model, ids, policy):
    """Over a paged sequence the policy drops the same rows, the pool moves them as the
    cache does, and the logits are the same bits; the blocks past the kept rows go back."""
    cache = policy.new_cache(model)
    want = policy.forward(model, ids, cache, all_logits=True)
    pool = model.new_paged_pool(num_blocks=16, block_size=4)
    seq = pool.new_sequence()
    np.testing.assert_array_equal(policy.forward(model, ids, seq, all_logits=True), want)
    np.testing.assert_array_equal(pool.positions(seq), cache.positions)
    np.testing.assert_array_equal(pool.gather(seq)[0], cache.keys)
    assert seq.next_position == len(ids) and seq.length == 16
    assert pool.stats().blocks_used == 4
    pool.check()
    # a batch step over it rotates by its true position too
    rows = np.ascontiguousarray(policy.keep(cache, 15))
    cache.keep(rows)
    pool.keep(seq, rows)
    batch = model.forward_batch([seq, pool.new_sequence()], [[7], ids[:3]])
    np.testing.assert_array_equal(batch[0], model.forward([7], cache))


def test_a_paged_sequence_that_dropped_rows_never_feeds_the_prefix_cache(model, ids):
    pool = model.new_paged_pool(num_blocks=32, block_size=4)
    seq = pool.new_sequence()
    model.forward(ids[:16], seq)                    # four full blocks, in the prefix cache
    SlidingWindow(8).forward(model, ids[16:20], seq)
    model.forward(ids[20:28], seq)                  # more full blocks, after the drop
    fresh = pool.new_sequence()
    assert pool.reuse_prefix(fresh, ids[:28]) == 0  # its rows no longer follow its tokens
    pool.check()


def test_a_shared_paged_sequence_refuses_to_drop_rows(model, ids):
    pool = model.new_paged_pool(num_blocks=16, block_size=4)
    seq = pool.new_sequence()
    model.forward(ids[:10], seq)
    child = pool.fork(seq)
    with pytest.raises(ValueError, match="shared"):
        SlidingWindow(8).forward(model, ids[10:12], seq)
    assert seq.length == 10 and seq.next_position == 10
    pool.free(child)
    SlidingWindow(8).forward(model, ids[10:12], seq)
    assert seq.length == 8 and seq.next_position == 12
    pool.truncate(seq, 7)                           # the newest position, 11, taken back
    assert seq.next_position == 11
    kept = np.ascontiguousarray(np.broadcast_to(np.array([0, 1, 2, 3, 4, 6], np.int32)[None, :, None],
                                                (model.config.n_layers, 6, model.config.n_kv_heads)))
    pool.keep(seq, kept)                            # 9 dropped: row 5 now holds 10
    with pytest.raises(ValueError, match="between 0|newest"):
        pool.truncate(seq, 4)
    pool.check()


def test_attention_ranked_policies_need_a_contiguous_cache(model):
    pool = model.new_paged_pool(num_blocks=16, block_size=4)
    for policy in (HeavyHitters(8), SnapKV(8, observation=2)):
        with pytest.raises(TypeError, match="attention"):
            policy.forward(model, [1, 2, 3], pool.new_sequence())


def test_a_sliding_window_model_refuses_a_policy_that_keeps_older_positions(mistral):
    """Rows are not enough: sinks older than the window would be seen."""
    _, model = mistral
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSinks(2, 4).forward(model, list(range(12)), AttentionSinks(2, 4).new_cache(model))


def test_a_sliding_window_model_says_why_generate_cannot_run_it(mistral):
    _, model = mistral
    for kwargs in ({"use_cache": False}, {"speculate": kvlab.speculative.PromptLookup()}):
        with pytest.raises(ValueError, match="its last 8 positions"):
            kvlab.generate(model, [1, 2, 3], max_new_tokens=10, **kwargs)
    assert len(kvlab.generate(model, [1, 2, 3], max_new_tokens=6, use_cache=False).tokens) == 6


def test_the_engine_refuses_what_a_sliding_window_model_cannot_hold(mistral):
    _, model = mistral
    engine = kvlab.Engine(model, num_blocks=32)
    with pytest.raises(kvlab.ContextLengthError, match="sliding_window"):
        engine.add_request(list(range(6)), kvlab.SamplingParams(max_new_tokens=4))
    assert not engine.has_work
    engine.add_request(list(range(4)), kvlab.SamplingParams(max_new_tokens=5))
    assert len(engine.run()[0].outputs[0].tokens) == 5
