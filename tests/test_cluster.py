"""kvlab.cluster, chapter 11's simulations: the radix tree reuses exactly the longest common
prefix with any earlier prompt (against brute force), block hashing reuses that prefix cut
to full blocks (the pool's own prefix cache), tensor parallelism's K/V bytes are the hand
formula, the tiers give back the same K and V and cost in proportion to their bytes, a
disaggregated run gives one engine's greedy tokens, and bad arguments are refused."""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab import cluster


def small_model(seed=0) -> kvlab.Model:
    config = kvlab.ModelConfig(dim=32, hidden_dim=44, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=8, vocab_size=40, max_seq_len=256)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=seed))


@pytest.fixture(scope="module")
def small():
    return small_model()


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def drawn_prompts(rng, n=30, vocab=5):
    """Prompts that share prefixes often: each copies a stretch of an earlier one, then
    goes its own way (a small vocabulary makes chance matches common too)."""
    prompts = []
    for _ in range(n):
        tail = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        if prompts and rng.random() < 0.7:
            earlier = prompts[int(rng.integers(len(prompts)))]
            prompts.append(earlier[:int(rng.integers(0, len(earlier) + 1))] + tail)
        else:
            prompts.append(tail)
    return prompts


# ---- the radix tree ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_radix_match_is_the_longest_common_prefix_with_any_inserted_prompt(seed):
    rng = np.random.default_rng(seed)
    tree, inserted = cluster.RadixTree(), []
    for prompt in drawn_prompts(rng):
        query = prompt[:len(prompt) // 2] + rng.integers(0, 5, 3).tolist()
        want = max((lcp(query, p) for p in inserted), default=0)
        assert tree.match(query) == want
        held = max((lcp(prompt, p) for p in inserted), default=0)
        assert tree.insert(prompt) == held
        inserted.append(prompt)
        assert tree.match(prompt) == len(prompt)
    # the tree stores each distinct prefix once: its tokens are the trie's nodes
    prefixes = {tuple(p[:i]) for p in inserted for i in range(1, len(p) + 1)}
    assert tree.n_tokens == len(prefixes)


def test_radix_hits_leave_the_last_token_to_compute():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9], [7]]
    assert cluster.radix_hits(prompts) == [0, 3, 2, 0]


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_block_hashing_reuses_the_shared_prefix_cut_to_full_blocks(small, block_size):
    prompts = drawn_prompts(np.random.default_rng(7), n=14, vocab=3)
    radix = cluster.radix_hits(prompts)
    blocks = cluster.block_hash_hits(small, prompts, block_size)
    assert blocks == [r - cluster.block_loss(r, block_size) for r in radix]
    if block_size == 1:
        assert blocks == radix            # blocks of one token are a radix tree's reuse


def test_radix_and_blocks_refuse_what_is_not_token_ids(small):
    tree = cluster.RadixTree()
    for bad in ([1.5, 2.0], "abc", [[1, 2]]):
        with pytest.raises(TypeError, match="integer ids"):
            tree.insert(bad)
    with pytest.raises(ValueError, match="at least one token"):
        cluster.block_hash_hits(small, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="block_size"):
        cluster.block_hash_hits(small, [[1, 2]], 0)
    with pytest.raises(ValueError, match="block_size"):
        cluster.block_loss(5, 0)


# ---- tensor parallelism ---------------------------------------------------------------

@pytest.mark.parametrize("name,tp,heads", [
    ("Llama-3-8B", 1, 8), ("Llama-3-8B", 2, 4), ("Llama-3-8B", 8, 1), ("Llama-3-8B", 16, 1),
    ("Llama-3-70B", 4, 2), ("Llama-3-70B", 32, 1), ("SmolLM2-135M", 3, 1),
    ("SmolLM2-135M", 9, 1)])
def test_tp_bytes_are_the_hand_formula(name, tp, heads):
    c = cluster.SHAPES[name]
    got = cluster.kv_bytes_per_gpu(c, tp, element_bytes=2)
    assert got["kv_heads_per_gpu"] == heads
    assert got["per_gpu"] == 2 * c.n_layers * heads * c.head_dim * 2
    assert got["all_gpus"] == tp * got["per_gpu"]
    assert got["copies"] == max(1.0, tp / c.n_kv_heads)
    # with tp = 1 it is the kit's own count of a token's K and V (chapter 2), in fp16
    one = cluster.kv_bytes_per_gpu(c, 1, element_bytes=2)["per_gpu"]
    assert one == kvlab.measure.kv_cache_bytes(c, 1, dtype="fp16")


def test_tokens_per_gpu_counts_the_room_beside_a_share_of_the_weights():
    c = cluster.SHAPES["Llama-3-70B"]
    gpu = 80e9
    assert cluster.tokens_per_gpu(c, 1, gpu) == 0          # 141 GB of bf16 weights
    per_token = cluster.kv_bytes_per_gpu(c, 8)["per_gpu"]
    assert cluster.tokens_per_gpu(c, 8, gpu) == int((gpu - c.n_params() * 2 / 8) // per_token)


@pytest.mark.parametrize("name,tp,why", [
    ("SmolLM2-135M", 2, "query heads"), ("Llama-3-8B", 3, "query heads"),
    ("Llama-3-8B", 0, "tp"), ("Llama-3-8B", True, "tp"), ("Llama-3-8B", 2.0, "tp")])
def test_tp_refuses_a_split_that_cannot_be(name, tp, why):
    with pytest.raises((ValueError, TypeError), match=why):
        cluster.kv_bytes_per_gpu(cluster.SHAPES[name], tp)


def test_tp_refuses_kv_heads_that_do_not_split():
    with pytest.raises(ValueError, match="KV heads"):
        cluster.kv_heads_per_gpu(12, 6, 4)           # 4 divides 12 query heads, not 6 KV
    with pytest.raises(ValueError, match="multiple of the 6 KV heads"):
        cluster.kv_heads_per_gpu(24, 6, 8)


# ---- K/V tiers ----------------------------------------------------------------------

def test_a_tier_costs_its_latency_plus_its_bytes_over_its_bandwidth():
    tier = cluster.Tier("disk", bytes_per_s=2e9, latency_s=1e-4)
    assert tier.seconds(0) == 1e-4
    assert tier.seconds(4_000_000) == pytest.approx(1e-4 + 2e-3)
    # twice the bytes, twice what is past the latency
    assert tier.seconds(8_000_000) - 1e-4 == pytest.approx(2 * (tier.seconds(4_000_000) - 1e-4))
    for bad in (0, -1.0, float("nan"), float("inf"), "fast"):
        with pytest.raises(ValueError, match="bytes_per_s"):
            cluster.Tier("x", bad)
    with pytest.raises(ValueError, match="latency_s"):
        cluster.Tier("x", 1e9, latency_s=-1)
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        tier.seconds(-5)


def test_offload_to_a_file_and_back_gives_the_same_next_logits(small, tmp_path):
    tokens = np.arange(1, 30, dtype=np.int64) % 40
    pool = small.new_paged_pool(16, 4, prefix_cache=False)
    seq = pool.new_sequence()
    small.forward(tokens, cache=seq)
    twin = pool.fork(seq)
    want = small.forward(np.array([5]), cache=twin)
    host = cluster.offload(pool, seq, tmp_path / "kv.bin")
    assert (tmp_path / "kv.bin").stat().st_size == host.nbytes     # the pool's own bytes
    back = cluster.restore(pool, host, tmp_path / "kv.bin")
    assert back.length == len(tokens)
    np.testing.assert_array_equal(small.forward(np.array([5]), cache=back), want)


def test_restore_refuses_a_file_of_other_bytes(small, tmp_path):
    pool = small.new_paged_pool(16, 4)
    seq = pool.new_sequence()
    small.forward(np.arange(1, 9), cache=seq)
    host = cluster.offload(pool, seq, tmp_path / "kv.bin")
    (tmp_path / "kv.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="10 bytes"):
        cluster.restore(pool, host, tmp_path / "kv.bin")


def test_measure_tiers_moves_bytes_in_proportion_to_the_context(small, tmp_path):
    short = cluster.measure_tiers(small, np.arange(1, 33) % 40, tmp_path)
    long = cluster.measure_tiers(small, np.arange(1, 129) % 40, tmp_path)
    per_token = 2 * small.config.n_layers * small.config.kv_dim * 4      # fp32 rows
    assert long["tokens"] == 127 and short["tokens"] == 31
    # the copy is the rows plus a header and the tokens: its growth is the rows' growth
    grew = long["bytes"] - short["bytes"]
    assert per_token * 96 <= grew <= (per_token + 8) * 96
    for row in (short, long):
        assert all(row[k] >= 0 for k in ("compute_s", "host_out_s", "disk_write_s"))
    assert not list(tmp_path.iterdir())                    # the tier's file is gone
    with pytest.raises(ValueError, match="at least 2 tokens"):
        cluster.measure_tiers(small, [3], tmp_path)


# ---- disaggregated prefill and decode ----------------------------------------------------

def drawn_requests(rng, n=10, rate=400.0, vocab=40):
    """(arrival, prompt ids, new tokens) as kvlab.serving.workload makes them."""
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [(float(a), rng.integers(0, vocab, int(rng.integers(3, 40))).tolist(),
             int(rng.integers(1, 12))) for a in arrivals]


def tokens_of(outputs):
    return {i: [o.tokens for o in out.outputs] for i, out in outputs.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_disaggregated_run_gives_one_engines_greedy_tokens(small, seed):
    requests = drawn_requests(np.random.default_rng(seed))
    one, _ = cluster.colocated(small, requests, num_blocks=64, block_size=4)
    split = cluster.Disaggregated(small, link_bytes_per_s=1e9, num_blocks=64, block_size=4)
    apart = split.run(requests)
    assert tokens_of(apart) == tokens_of(one)
    for i, (_, prompt, new) in enumerate(requests):        # and kvlab.generate's, alone
        alone = kvlab.generate(small, prompt, max_new_tokens=new, stop_at_eos=False)
        assert apart[i].outputs[0].tokens == list(alone.tokens)
    # every request of more than one token crossed the link, and what left arrived
    assert split.hand_offs == sum(1 for _, _, new in requests if new > 1)
    assert split.moved_bytes == sum(step.swapped_in_bytes for step in split.decode.metrics) > 0
    assert all(out.preemptions == 0 for out in apart.values())
    assert split.seconds >= max(a for a, _, _ in requests)


def test_a_slower_link_delays_decode_not_the_first_token(small):
    requests = drawn_requests(np.random.default_rng(3), n=6)
    fast = cluster.Disaggregated(small, 1e12, num_blocks=64, block_size=4)
    slow = cluster.Disaggregated(small, 1e5, num_blocks=64, block_size=4)  # 100 kB/s
    a, b = fast.run(requests), slow.run(requests)
    assert tokens_of(a) == tokens_of(b)
    for i in a:
        assert b[i].metrics.ttft == a[i].metrics.ttft          # the prefill engine's alone
        if a[i].metrics.output_tokens > 1:                      # waited for the link
            assert b[i].metrics.e2e > a[i].metrics.e2e


def test_served_counts_goodput_under_an_slo(small):
    from kvlab import slo
    requests = drawn_requests(np.random.default_rng(4), n=8)
    outputs, seconds = cluster.colocated(small, requests, num_blocks=64, block_size=4)
    loose = cluster.served(outputs, seconds, slo.SLO(1e3, 1e3))
    assert loose["served"] == 8 and loose["goodput"] == pytest.approx(8 / seconds)
    tokens = sum(new for _, _, new in requests)
    assert loose["tokens_per_s"] == pytest.approx(tokens / seconds)
    tight = cluster.served(outputs, seconds, slo.SLO(1e-9, 1e-9))
    assert tight["served"] == 0 and tight["goodput"] == 0


def test_disaggregated_refuses_bad_arguments(small):
    for bad in (0, -1e9, float("nan"), "fast"):
        with pytest.raises(ValueError, match="bytes_per_s"):
            cluster.Disaggregated(small, bad)
    with pytest.raises(TypeError, match="cost"):
        cluster.Disaggregated(small, 1e9, cost="cheap")
    with pytest.raises(ValueError, match="num_blocks"):
        cluster.Disaggregated(small, 1e9, num_blocks=0)
    split = cluster.Disaggregated(small, 1e9, num_blocks=64, block_size=4)
    with pytest.raises(ValueError):
        split.run([(0.0, [], 3)])                          # a prompt of no tokens
    with pytest.raises(ValueError, match="arrival"):
        split.run([(float("nan"), [1, 2], 3)])
    with pytest.raises(ValueError, match="arrival"):
        cluster.colocated(small, [(-1.0, [1, 2], 3)], num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="must be .arrival seconds"):
        split.run([(0.0, [1, 2])])


# ---- the notebook's exercise (kvlab.your_turn, "11_serving_at_scale") --------------------

def _reuse(prompts, block_size, drop_last=True, blocks=True):
    out = []
    for i, p in enumerate(prompts):
        want = p[:-1] if drop_last else p
        best = max((lcp(want, q) for q in prompts[:i]), default=0)
        out.append(best - best % block_size if blocks else best)
    return out


@pytest.mark.parametrize("wrong,hint", [
    (lambda ps, b: _reuse(ps, b, drop_last=False), "last token of a prompt is always computed"),
    (lambda ps, b: _reuse(ps, b, blocks=False), "only full blocks"),
    (lambda ps, b: _reuse(ps, b)[1:], "one count per prompt"),
    (lambda ps, b: [0] * len(ps), "longest prefix")])
def test_the_exercise_refuses_plausible_mistakes_with_a_hint(wrong, hint, capsys):
    from kvlab import your_turn
    assert your_turn.check("11_serving_at_scale", _reuse, seed=3) is True
    capsys.readouterr()
    assert your_turn.check("11_serving_at_scale", wrong, seed=3) is False
    out = capsys.readouterr().out
    assert out.startswith("not yet: reused_tokens") and hint in out, out
